"""Coverage from the ledger alone, replaying nothing: what ``inspect`` shows per checkpoint.

``certify`` and ``report`` say what examined the steps before each checkpoint after their own
replays (``decide/coverage.py``). ``inspect`` answers the same question for a run as it stands:
the ledger's records that still apply to the trace (``ledger/reuse.py``: same checkpoint
digests, same files or rotated away, same attempt) count as exact or tolerant replay; the rest
of the recorded steps had the online checks only (which ones: ``trace/online.py``); and what an
exact replay of the rest would cost is measured on the ledger's records. numpy only, no torch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sdc_forensics.decide.coverage import Coverage, coverage, with_details


@dataclasses.dataclass(frozen=True, kw_only=True)
class LedgerCoverage:
    """Coverage of a trace's checkpoints by its ledger.

    Attributes:
        ledger: the ledger file read (None: ``no_ledger``).
        coverage: per noted checkpoint, in step order.
        strong_evidence: ``(step, record id)`` of strong evidence held by a record that still applies.
        notes: one line per record read but not used (damaged, or citing another file).
    """

    ledger: Path | None
    coverage: tuple[Coverage, ...]
    strong_evidence: tuple[tuple[int, str], ...] = ()
    notes: tuple[str, ...] = ()


def ledger_coverage(trace, ledger_file: Path | None = None, no_ledger: bool = False) -> LedgerCoverage:
    """The coverage of ``trace``'s checkpoints by the ledger (``ledger_file``, default beside the trace).

    Args:
        trace: an open ``Trace``.
        ledger_file: the ledger (``--ledger``), or None for ``TRACE_DIR/ledger.jsonl``.
        no_ledger: ignore the ledger: every recorded step counts as checked online only.
    """
    from sdc_forensics.forensics.files import checkpoint_file
    from sdc_forensics.ledger import Comparison, ledger_path, read_ledger, reusable_records
    from sdc_forensics.ledger.reuse import STRONG

    notes = sorted((n for n in trace.checkpoint_notes() if n.weights_digest), key=lambda n: n.step)
    path, records, lines, valid = None, (), (), ()
    if not no_ledger:
        path = ledger_path(trace.path, ledger_file)
        contents = read_ledger(path)
        valid = contents.records
        reuse = reusable_records(
            valid,
            notes,
            trace_dir=trace.path,
            attempts=trace.manifest.attempts,
            locate=lambda note: checkpoint_file(note, trace.path),
        )
        records, lines = reuse.records, (*contents.notes, *reuse.notes)
    exact = [
        (r.start_step, r.last_step, (r.record_id,)) for r in records if r.certifies and r.last_step >= r.start_step
    ]
    tolerant = [
        (r.start_step, r.last_step)
        for r in records
        if not r.certifies and r.comparison is Comparison.TOLERANT and r.last_step >= r.start_step
    ]
    spans = coverage([n.step for n in notes], step_range=trace.step_range(), exact_ledger=exact, tolerant=tolerant)
    strong = tuple(sorted({(e.step, r.record_id) for r in records for e in r.evidence if e.strength == STRONG}))
    return LedgerCoverage(
        ledger=path, coverage=with_details(spans, trace, valid), strong_evidence=strong, notes=tuple(lines)
    )
