"""The result of a bisection, as data: what was found, who is suspected, where to resume from.

``forensics.bisect`` gathers the evidence and ``forensics.decision`` decides; this module holds
the records the renderers in ``sdc_forensics.present`` read. numpy-free and torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdc_forensics.forensics.decision import CheckpointStatus, Suspect, Verdict
from sdc_forensics.forensics.evidence import Evidence

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

    def to_json(self) -> dict[str, Any]:
        return {"from": self.start, "to": self.stop, "last_replayed": self.last, "comparison": self.comparison,
                "tolerant_from": self.tolerant_from, "reason": self.reason, "max_residual_ratio": self.max_residual_ratio}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplaySummary:
    """What was replayed, where, and how it was compared."""

    windows: tuple[ReplayedWindow, ...] = ()
    device: str | None = None
    reduction_order: str = ""
    settings: dict = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def comparison(self) -> str:
        """``exact`` when every window compared bitwise, ``tolerant`` when any did not, ``none``."""
        if not self.windows:
            return "none"
        return "tolerant" if any(w.comparison == "tolerant" for w in self.windows) else "exact"

    @property
    def steps_replayed(self) -> int:
        return sum(w.last - w.start + 1 for w in self.windows if w.last >= w.start)

    def to_json(self) -> dict[str, Any]:
        return {"windows": [w.to_json() for w in self.windows], "device": self.device, "comparison": self.comparison,
                "steps_replayed": self.steps_replayed, "reduction_order": self.reduction_order or None,
                "settings": self.settings, "notes": list(self.notes)}


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
    mode: str  # replay | trace-only
    scope: str
    settle: tuple[str, ...] = ()
    trace_path: str = ""
    world_size: int = 0
    step_range: tuple[int, int] | None = None
    damage: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    divergence_window: tuple[int, int] | None = None
    seed: int = 0
    preflight: Any = None  # forensics.preflight.Preflight of the replay (None: trace-only)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (without ``schema_version``, which the CLI's emitter adds)."""
        last = self.last_clean_checkpoint
        return {
            "verdict": self.verdict.value,
            "first_divergent_step": self.first_divergent_step,
            "divergence_window": None if self.divergence_window is None else list(self.divergence_window),
            "suspects": [s.to_json() for s in self.suspects],
            "last_clean_checkpoint": None if last is None else {"step": last.step, "path": last.path, "status": last.status.value},
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "replayed": self.replayed.to_json(),
            "evidence": [e.to_json() for e in self.evidence if not e.is_hint],
            "hints": [e.to_json() for e in self.evidence if e.is_hint],
            "mode": self.mode,
            "scope": self.scope,
            "settle": list(self.settle),
            "notes": list(self.notes),
            "preflight": None if self.preflight is None else self.preflight.to_json(),
            "trace": {"path": self.trace_path, "world_size": self.world_size,
                      "steps": None if self.step_range is None else list(self.step_range), "damage": list(self.damage)},
        }
