"""Checkpoint readers and content verification: they read files and decide nothing about runs.

Readers (one per format) check structure when a checkpoint is opened; ``verify`` measures
content and compares it with the trace's checkpoint notes; ``locate`` finds a noted file.
Whether a checkpoint is clean is decided in ``decide/decision.py`` (``certify``, ``bisect``),
and certificates are in ``decide/certificate.py``. See ``docs/checkpoints.md``.

The names below are imported on first use, so that ``checkpoint.limits`` (no torch) can be
imported by the CLI without importing torch (``bisect --trace-only`` starts without it).
"""

import importlib

_EXPORTS = {
    "detect_format": "formats",
    "open_checkpoint": "formats",
    "Finding": "verify",
    "FindingKind": "findings",
    "VerificationReport": "verify",
    "VerifyOptions": "verify",
    "verify_checkpoint": "verify",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Finding",
    "FindingKind",
    "VerificationReport",
    "VerifyOptions",
    "detect_format",
    "open_checkpoint",
    "verify_checkpoint",
]
