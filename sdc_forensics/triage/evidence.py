"""The evidence vocabulary under its old name: it lives in ``sdc_forensics/evidence.py``, which
every stage imports; this module re-exports it for code written before it moved."""

from sdc_forensics.evidence import (
    Evidence,
    EvidenceKind,
    Location,
    Strength,
    divergence_window,
    first_divergent_step,
    sort_key,
)

__all__ = ["Evidence", "EvidenceKind", "Location", "Strength", "divergence_window", "first_divergent_step", "sort_key"]
