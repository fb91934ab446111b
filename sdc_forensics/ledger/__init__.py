"""The ledger of examined intervals: replays recorded once, reused by every later command.

``TRACE_DIR/ledger.jsonl`` (or ``--ledger PATH``): append-only JSON lines, one checksummed record
per replayed checkpoint interval (``record.py``: the format; ``store.py``: appending under a lock
and reading what can be trusted; ``stamp.py``: cheap file checksums; ``reuse.py``: which records
still apply to the trace, and which checkpoints they cover exactly). Format: docs/trace-format.md,
"Ledger"; reuse rules: docs/checkpoints.md, "The ledger". numpy- and torch-free.
"""

from sdc_forensics.ledger.record import (
    LEDGER_VERSION,
    CheckpointRef,
    Comparison,
    EvidenceEntry,
    FileStamp,
    IntervalRecord,
    LedgerRecordError,
    Outcome,
)
from sdc_forensics.ledger.reuse import CheckpointCoverage, Reuse, exact_coverage, reusable_records
from sdc_forensics.ledger.stamp import checkpoint_ref, stamp_checkpoint, tensors_digest
from sdc_forensics.ledger.store import LEDGER_NAME, LedgerContents, append_record, ledger_path, read_ledger

__all__ = [
    "LEDGER_NAME",
    "LEDGER_VERSION",
    "CheckpointCoverage",
    "CheckpointRef",
    "Comparison",
    "EvidenceEntry",
    "FileStamp",
    "IntervalRecord",
    "LedgerContents",
    "LedgerRecordError",
    "Outcome",
    "Reuse",
    "append_record",
    "checkpoint_ref",
    "exact_coverage",
    "ledger_path",
    "read_ledger",
    "reusable_records",
    "stamp_checkpoint",
    "tensors_digest",
]
