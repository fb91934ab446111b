"""Checkpoint readers and content verification: they read files and decide nothing about runs.

Readers (one per format) check structure when a checkpoint is opened; ``verify`` measures
content and compares it with the trace's checkpoint notes; ``locate`` finds a noted file.
Whether a checkpoint is clean is decided in ``forensics/decision.py`` (``certify``, ``bisect``),
and certificates are in ``forensics/certificate.py``. See ``docs/checkpoints.md``.
"""

from sdc_forensics.checkpoint.formats import detect_format, open_checkpoint
from sdc_forensics.checkpoint.verify import Finding, FindingKind, VerificationReport, VerifyOptions, verify_checkpoint

__all__ = [
    "Finding",
    "FindingKind",
    "VerificationReport",
    "VerifyOptions",
    "detect_format",
    "open_checkpoint",
    "verify_checkpoint",
]
