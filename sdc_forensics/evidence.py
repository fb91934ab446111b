"""Evidence: what one observation says about one step, as data (no torch, no numpy).

The vocabulary every stage speaks, so every stage may import it: triage of the trace, replay,
checkpoint certification, the decision and the renderers. An evidence record names its kind, the
step (checkpoint ``N``'s step for storage evidence), the ranks it points at (empty when it cannot
point at a rank), what was expected and what was found, how far it can carry a verdict
(:class:`Strength`) and where the fault most likely sits (:class:`Location`).

The rules that read only evidence live here too, once: the first divergent step
(:func:`first_divergent_step`) and the window a replay must examine to pin it
(:func:`divergence_window`); triage and the decision both call them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

__all__ = ["Evidence", "EvidenceKind", "Location", "Strength", "divergence_window", "first_divergent_step", "sort_key"]


class EvidenceKind(str, enum.Enum):
    """The kinds of evidence, in the order the analysis trusts them (hints last)."""

    NONFINITE = "nonfinite"
    ALLREDUCE_MISMATCH = "allreduce_mismatch"
    WEIGHT_DIVERGENCE = "weight_divergence"
    AUDIT_MISMATCH = "audit_mismatch"
    REPLAY_MISMATCH = "replay_mismatch"
    INPUT_MISMATCH = "input_mismatch"
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"
    # a statistical hint, never a verdict on its own
    OUTLIER = "outlier"


class Strength(str, enum.Enum):
    """How far an observation can carry a verdict (design brief, "Strength of evidence").

    ``strong``: exact digest mismatches, NaN/Inf, strict-majority votes, calibrated all-reduce
    residuals, and tolerant replay residuals far above the largest artefact clean replays of the
    same kind produce. ``weak``: a tolerant replay residual within that range; alone it gives
    ``inconclusive``, never ``corruption``, and never ends the backwards search.
    """

    STRONG = "strong"
    WEAK = "weak"


class Location(str, enum.Enum):
    """Where a fault sits."""

    # the rank's forward/backward
    LOCAL_COMPUTE = "local_compute"
    # the rank's weights changed in memory between two steps (after one update, before the next forward)
    STATE_AT_REST = "state_at_rest"
    # inside the all-reduce
    COLLECTIVE = "collective"
    # the rank's optimizer step
    OPTIMIZER_UPDATE = "optimizer_update"
    # the rank's input microbatch
    INPUT_DATA = "input_data"
    # a checkpoint file on disk
    STORAGE = "storage"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evidence:
    """One observation.

    Attributes:
        kind: what was compared.
        step: the optimizer step (reads theta_step, writes theta_step+1); for storage
            evidence, the checkpoint's step N.
        ranks: the global ranks the observation points at (empty: none in particular).
        expected: what a healthy run would show (a digest in hex, a number, a sentence).
        found: what was found.
        location: where the fault most likely sits.
        detail: one sentence for people.
        source: ``trace``, ``replay`` or ``checkpoint``: who produced it.
        affects_state: False when the observation does not mean the training state diverged
            at ``step`` (a hint, an auditor's own bad recomputation, a damaged file on disk).
        strength: :class:`Strength`; only strong evidence sets the first divergent step.
        earliest_step: when the observation only bounds the fault (replica weights found
            different at ``step`` but last compared equal earlier), the earliest step the fault
            can have happened at; None when it happened at ``step``.
        shared: the fault sits on ``ranks`` but other ranks computed with it at ``step`` (a sharded
            job's weight shard that changed at rest, then gathered by its replica): a cause of what
            those ranks show at that step (``decide/common_mode.py``), not one of its members.
        reach: with ``shared``, the ranks that computed with it (every rank when empty).
    """

    kind: EvidenceKind
    step: int
    ranks: tuple[int, ...] = ()
    expected: str = ""
    found: str = ""
    location: Location = Location.UNKNOWN
    detail: str = ""
    source: str = "trace"
    affects_state: bool = True
    strength: Strength = Strength.STRONG
    earliest_step: int | None = None
    shared: bool = False
    reach: tuple[int, ...] = ()

    @property
    def is_hint(self) -> bool:
        """True for evidence that may never carry a verdict on its own."""
        return self.kind is EvidenceKind.OUTLIER

    @property
    def marks_divergence(self) -> bool:
        """True when this says, strongly, that the replicas' training state went wrong at :attr:`step`."""
        return self.affects_state and not self.is_hint and self.strength is Strength.STRONG

    @property
    def is_weak(self) -> bool:
        """True for a state-affecting observation too weak to carry a verdict (a tolerant residual)."""
        return self.affects_state and not self.is_hint and self.strength is Strength.WEAK

    @property
    def onset(self) -> int:
        """The earliest step at which the fault behind this observation can have happened."""
        return self.step if self.earliest_step is None else min(self.earliest_step, self.step)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (enum values as strings)."""
        return {
            "kind": self.kind.value,
            "step": self.step,
            "ranks": list(self.ranks),
            "expected": self.expected,
            "found": self.found,
            "location": self.location.value,
            "detail": self.detail,
            "source": self.source,
            "affects_state": self.affects_state,
            "strength": self.strength.value,
            "earliest_step": self.earliest_step,
            **({"shared": True, "reach": list(self.reach)} if self.shared else {}),
        }


def sort_key(evidence: Evidence) -> tuple[int, int, int, tuple[int, ...]]:
    """Order: by step, hints after real evidence, then by kind's trust order, then ranks."""
    order = list(EvidenceKind).index(evidence.kind)
    return (evidence.step, int(evidence.is_hint), order, evidence.ranks)


def first_divergent_step(evidence: Iterable[Evidence]) -> int | None:
    """The earliest onset of strong, state-affecting evidence (None when there is none)."""
    onsets = [e.onset for e in evidence if e.marks_divergence]
    return min(onsets) if onsets else None


def divergence_window(evidence: Iterable[Evidence]) -> tuple[int, int] | None:
    """``(first divergent step, the step it was observed at)``: the steps a replay must examine to
    pin the divergence (an onset before the observation when a replica was found diverged at a
    weights check); None when no strong, state-affecting evidence names a divergence."""
    evidence = list(evidence)
    first = first_divergent_step(evidence)
    if first is None:
        return None
    observed = min(e.step for e in evidence if e.marks_divergence and e.onset == first)
    return first, observed
