"""The in-process calls each fuzz property makes, exactly as the CLI makes them, and the error
classes each may raise (``sdc_forensics/cli/main.py`` maps them to exit codes).

* a checkpoint (``verify-checkpoint PATH``): :func:`open_checkpoint` then :func:`verify_checkpoint`
  (every tensor digested and scanned for NaN/Inf, every file checksummed). May raise
  ``CheckpointError`` (exit 3); returns a report, whose ``ok`` is exit 0, else exit 1.
* a trace (``inspect``, ``bisect --trace-only``, ``export``): :func:`read_trace`. May raise
  ``TraceError`` (exit 3).
* a certificate (``verify-checkpoint PATH --certificate FILE``): :func:`read_certificate_for`.
  May raise ``InvalidInputError`` (exit 3).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from sdc_forensics.errors import CheckpointError, InvalidInputError, TraceError

#: Documented error classes per call (all exit 3 through ``cli/main.py``: ``exit_code == 3``).
CHECKPOINT_ERRORS = (CheckpointError,)
TRACE_ERRORS = (TraceError,)
CERTIFICATE_ERRORS = (InvalidInputError,)


def verify(path: Path):
    """What ``verify-checkpoint PATH`` computes (one worker, no pre-faulting: same code, smaller)."""
    from sdc_forensics.checkpoint import VerifyOptions, open_checkpoint, verify_checkpoint

    with open_checkpoint(path) as reader:
        return verify_checkpoint(reader, options=VerifyOptions(workers=1, populate=False))


def read_trace(trace_dir: Path):
    """What ``inspect``, ``export`` and ``bisect --trace-only`` read and compute from a trace.

    Returns:
        ``(inspect's JSON document, bisect's verdict value)``.
    """
    from sdc_forensics.forensics.bisect import bisect
    from sdc_forensics.replay.options import BisectOptions
    from sdc_forensics.present.bisect import bisect_document
    from sdc_forensics.present.inspect import inspect_document as summary_document
    from sdc_forensics.trace.export import export_csv
    from sdc_forensics.trace.reader import Trace
    from sdc_forensics.trace.summary import summarize

    trace = Trace.open(trace_dir)
    doc = summary_document(summarize(trace))
    json.dumps(doc)
    export_csv(trace, io.StringIO())
    result = bisect(trace_dir, BisectOptions(trace_only=True))
    json.dumps(bisect_document(result))
    return doc, result.verdict.value


def read_certificate_for(certificate: Path, checkpoint: Path):
    """What ``verify-checkpoint CHECKPOINT --certificate FILE`` does with the certificate."""
    from sdc_forensics.decide.certificate import check_against_certificate, read_certificate

    cert = read_certificate(certificate)
    entry = cert.entry_for(checkpoint)
    if entry is None:
        return None
    return check_against_certificate(verify(checkpoint), entry)
