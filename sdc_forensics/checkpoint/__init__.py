"""Checkpoint readers, structure and content verification, certification and certificates.

Readers (one per format) check structure when a checkpoint is opened; ``verify`` measures
content and compares it with the trace's checkpoint notes; ``certify`` gives every checkpoint
of a run a status and names the resume point; ``certificate`` writes and checks the JSON
record of that decision. See ``docs/checkpoints.md``.
"""

from sdc_forensics.checkpoint.certify import CheckpointStatus, Status, certify_checkpoints, last_clean
from sdc_forensics.checkpoint.formats import detect_format, open_checkpoint
from sdc_forensics.checkpoint.verify import Finding, FindingKind, VerificationReport, VerifyOptions, verify_checkpoint

__all__ = [
    "CheckpointStatus",
    "Finding",
    "FindingKind",
    "Status",
    "VerificationReport",
    "VerifyOptions",
    "certify_checkpoints",
    "detect_format",
    "last_clean",
    "open_checkpoint",
    "verify_checkpoint",
]
