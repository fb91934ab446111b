"""The verdict of a bisection, as data: what was found, who is suspected, where to resume from.

``forensics.bisect`` turns evidence (from triage, replay and checkpoint certification) into a
:class:`BisectResult` with the functions below; the renderers (``render.py``) only read it. numpy-free and torch-free.

Rules:

* the first divergent step ``s*`` is the earliest step of evidence that marks the replicas' state
  as wrong (``Evidence.marks_divergence``); storage evidence (a damaged checkpoint file) and hints
  never set it;
* suspects are the ranks that evidence at ``s*`` names (a collective fault that hit every rank
  alike is one suspect with no rank, location ``collective``), or for a storage-only incident the
  rank whose state was saved; the location is the most specific one the evidence supports;
* a suspect rank named at more than one step (weight divergence counted at its onset only,
  evidence naming half the ranks or more not counted per rank) is ``recurring``: drain its node;
  otherwise ``transient``: run diagnostics before reusing it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from sdc_forensics.forensics.evidence import Evidence, EvidenceKind, Location, sort_key

# most specific first: the location a suspect gets when several kinds of evidence name it
_LOCATION_ORDER = (Location.INPUT_DATA, Location.COLLECTIVE, Location.LOCAL_COMPUTE, Location.OPTIMIZER_UPDATE,
                   Location.STORAGE, Location.UNKNOWN)


class Verdict(str, enum.Enum):
    CLEAN = "clean"
    CORRUPTION = "corruption"
    INCONCLUSIVE = "inconclusive"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Suspect:
    """A rank (or the collective as a whole, ``rank=None``) and why it is suspected."""

    rank: int | None
    host: str | None
    gpu: str | None
    location: Location
    recurring: bool
    steps: tuple[int, ...]
    evidence: tuple[Evidence, ...]

    @property
    def recommendation(self) -> str:
        if self.rank is None:
            return "check the interconnect and the collective library of every node in the job; rerun an all-reduce self-test"
        if self.recurring:
            return f"recurring: drain node {self.host or '?'} and take GPU {self.gpu or '?'} out of service"
        if self.location is Location.STORAGE:
            return "transient storage fault: rewrite or discard this checkpoint file; check the file system"
        return f"transient: run GPU diagnostics on {self.host or '?'} / {self.gpu or '?'} before reusing it"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "host": self.host, "gpu": self.gpu, "location": self.location.value,
            "recurring": self.recurring, "steps": list(self.steps), "recommendation": self.recommendation,
            "evidence": [e.to_json() for e in self.evidence],
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointVerdict:
    """One checkpoint's status (``clean-replay-verified``, ``clean-trace-consistent``, ``tainted``,
    ``corrupt``, ``unverified``) with reasons."""

    step: int
    path: str
    status: str
    reasons: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return self.status.startswith("clean")

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "status": self.status, "reasons": list(self.reasons)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayedWindow:
    """One replayed window: from checkpoint ``start`` over steps ``start..stop``; ``last`` replayed."""

    start: int
    stop: int
    last: int
    comparison: str
    tolerant_from: int | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"from": self.start, "to": self.stop, "last_replayed": self.last, "comparison": self.comparison,
                "tolerant_from": self.tolerant_from, "reason": self.reason}


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
    last_clean_checkpoint: CheckpointVerdict | None
    checkpoints: tuple[CheckpointVerdict, ...]
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
    # the checkpoint module's full records behind ``checkpoints`` (with the verification reports),
    # when files were verified; ``certify`` builds its certificate from them
    certification: tuple = ()

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (without ``schema_version``, which the CLI's emitter adds)."""
        last = self.last_clean_checkpoint
        return {
            "verdict": self.verdict.value,
            "first_divergent_step": self.first_divergent_step,
            "suspects": [s.to_json() for s in self.suspects],
            "last_clean_checkpoint": None if last is None else {"step": last.step, "path": last.path, "status": last.status},
            "checkpoints": [c.to_json() for c in self.checkpoints],
            "replayed": self.replayed.to_json(),
            "evidence": [e.to_json() for e in self.evidence if not e.is_hint],
            "hints": [e.to_json() for e in self.evidence if e.is_hint],
            "mode": self.mode,
            "scope": self.scope,
            "settle": list(self.settle),
            "notes": list(self.notes),
            "trace": {"path": self.trace_path, "world_size": self.world_size,
                      "steps": None if self.step_range is None else list(self.step_range), "damage": list(self.damage)},
        }


def first_divergent_step(evidence: list[Evidence] | tuple[Evidence, ...]) -> int | None:
    """The earliest step whose evidence marks the replicas' state as wrong."""
    steps = [e.step for e in evidence if e.marks_divergence]
    return min(steps) if steps else None


def find_suspects(evidence: tuple[Evidence, ...], world_size: int, identity) -> tuple[Suspect, ...]:
    """Suspects at the first divergent step, or of storage-only incidents.

    Args:
        evidence: all non-hint and hint evidence.
        world_size: ``W``.
        identity: ``rank -> RankIdentity`` (host, gpu).
    """
    first = first_divergent_step(evidence)
    real = [e for e in evidence if not e.is_hint]
    if first is not None:
        at_first = [e for e in real if e.step == first and e.marks_divergence]
    else:
        at_first = [e for e in real if e.location is Location.STORAGE]
    ranked: dict[int | None, list[Evidence]] = {}
    for ev in at_first:
        for rank in ev.ranks or (None,):
            ranked.setdefault(rank, []).append(ev)
    if None in ranked and len(ranked) > 1:
        ranked.pop(None)  # rank-specific evidence explains the rank-less observation (its consequence)
    suspects = []
    for rank, evs in sorted(ranked.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        location = min((e.location for e in evs), key=_LOCATION_ORDER.index)
        chain = [e for e in real if (rank in e.ranks) or (rank is None and not e.ranks)]
        steps = _incident_steps(chain, rank, world_size)
        ident = identity(rank) if rank is not None else None
        suspects.append(Suspect(
            rank=rank, host=(ident.host or None) if ident else None, gpu=(ident.gpu or None) if ident else None,
            location=location, recurring=rank is not None and len(steps) > 1, steps=steps,
            evidence=tuple(sorted(chain, key=sort_key)),
        ))
    return tuple(suspects)


def _incident_steps(chain: list[Evidence], rank: int | None, world_size: int) -> tuple[int, ...]:
    steps = set()
    for ev in chain:
        if ev.location is Location.STORAGE:
            steps.add(ev.step)
        elif ev.marks_divergence and (rank is None or len(ev.ranks) * 2 < max(world_size, 2)):
            steps.add(ev.step)
    return tuple(sorted(steps))


def unlocalised(evidence: tuple[Evidence, ...]) -> list[Evidence]:
    """Findings that point at no rank and no location: they make a verdict inconclusive."""
    return [e for e in evidence if e.marks_divergence and not e.ranks and e.location is Location.UNKNOWN]


def weight_only_locations(suspect: Suspect) -> bool:
    """True when only replica weight divergence names this suspect (location cannot be told apart)."""
    return all(e.kind is EvidenceKind.WEIGHT_DIVERGENCE for e in suspect.evidence)
