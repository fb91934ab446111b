"""The result of a bisection, as data: what was found, who is suspected, where to resume from.

``forensics.bisect`` gathers the evidence and ``decide.decision`` decides; this module holds
the records the renderers in ``sdc_forensics.present`` read (the ``bisect --json`` document is
``present.bisect.bisect_document``'s). numpy-free and torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdc_forensics.decide.decision import CheckpointStatus, Suspect, Verdict
from sdc_forensics.evidence import Evidence

__all__ = ["BisectResult", "ReplaySummary", "ReplayedWindow", "Suspect", "Verdict"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayedWindow:
    """One replayed window: from checkpoint ``start`` over steps ``start..stop``; ``last`` replayed."""

    start: int
    stop: int
    last: int
    comparison: str
    tolerant_from: int | None
    reason: str
    max_residual_ratio: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReusedWindow:
    """Steps ``start..last`` taken from the ledger: replayed bit for bit and clean by an earlier
    command (``record_ids``), not replayed now (``forensics/ledger_use.py``)."""

    start: int
    last: int
    record_ids: tuple[str, ...]
    reason: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LedgerSummary:
    """What an analysis took from the ledger and appended to it.

    Attributes:
        path: the ledger file.
        reused: the windows taken from it instead of replayed.
        appended: the ids of the records this analysis appended (one per replayed window).
        notes: one line per record not reused, and a write failure.
    """

    path: str
    reused: tuple[ReusedWindow, ...] = ()
    appended: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def steps_reused(self) -> int:
        return sum(w.last - w.start + 1 for w in self.reused)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplaySummary:
    """What was replayed, where, and how it was compared."""

    windows: tuple[ReplayedWindow, ...] = ()
    device: str | None = None
    reduction_order: str = ""
    settings: dict = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # None: the ledger was not used (--no-ledger, trace-only)
    ledger: LedgerSummary | None = None

    @property
    def comparison(self) -> str:
        """``exact`` when every window compared bitwise, ``tolerant`` when any did not, ``none``."""
        if not self.windows:
            return "none"
        return "tolerant" if any(w.comparison == "tolerant" for w in self.windows) else "exact"

    @property
    def steps_replayed(self) -> int:
        return sum(w.last - w.start + 1 for w in self.windows if w.last >= w.start)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BisectResult:
    """Everything ``bisect`` concluded."""

    verdict: Verdict
    first_divergent_step: int | None
    suspects: tuple[Suspect, ...]
    last_clean_checkpoint: CheckpointStatus | None
    checkpoints: tuple[CheckpointStatus, ...]
    replayed: ReplaySummary
    evidence: tuple[Evidence, ...]
    # replay | trace-only
    mode: str
    scope: str
    settle: tuple[str, ...] = ()
    trace_path: str = ""
    world_size: int = 0
    step_range: tuple[int, int] | None = None
    damage: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    divergence_window: tuple[int, int] | None = None
    seed: int = 0
    # replay.preflight.Preflight of the replay (None: trace-only)
    preflight: Any = None
