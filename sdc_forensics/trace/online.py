"""Which online checks ran on which steps: what examined a step that was never replayed.

The recorder runs its checks inside training and marks each rank's STEP record with what it did
(``trace/format.py`` flags): ``HAS_GRADS`` (local and reduced gradient fingerprints recorded:
the NaN/Inf count before and after the all-reduce and the all-reduce sketch check ran),
``WEIGHTS_CHECKED`` (replica weights compared after the update: a strict-majority vote with 3
replicas or more, a comparison that detects but cannot name a rank with 2), ``AUDITED`` (a
microbatch of this step recomputed by another rank). A check ran on a step only when *every*
rank's record of it says so: a check with a rank missing compared less than the run.

``coverage`` (``decide/coverage.py``) quotes this for the steps before a checkpoint that only
the online checks saw; ``inspect`` shows it without torch (numpy only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from sdc_forensics.trace import format as F


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineChecks:
    """What the online checks did on a set of steps.

    Attributes:
        steps: steps recorded by at least one rank.
        complete: steps recorded by every rank.
        gradients: steps whose every rank recorded gradient fingerprints (NaN/Inf before and
            after the all-reduce, the all-reduce sketch check).
        weights: steps after whose update every rank's weights were compared.
        audited: the steps at which some rank's microbatch was recomputed by another.
        world_size: ranks of the run (3 or more: the weight comparison is a vote).
    """

    steps: int = 0
    complete: int = 0
    gradients: int = 0
    weights: int = 0
    audited: tuple[int, ...] = ()
    world_size: int = 0
    #: a sharded job's ranks that hold each shard (``ShardMesh.same_shard``'s group size; 0: not sharded):
    #: its weights check is every rank's shard at rest, voted across that many replicas
    replicas_per_shard: int = 0

    def describe(self) -> str:
        """One clause for people: which check ran on how many of the steps."""
        if not self.steps:
            return "no step recorded"

        def of(n: int) -> str:
            return "every step" if n == self.steps else f"{n} of {self.steps} steps"

        parts = []
        if self.gradients:
            parts.append(f"NaN/Inf and all-reduce sketch on {of(self.gradients)}")
        if self.weights:
            copies = self.replicas_per_shard or self.world_size
            vote = (
                f"replica vote ({copies} replicas)"
                if copies >= 3
                else f"replica comparison ({copies} replicas: detects, cannot vote)"
            )
            if self.replicas_per_shard == 1:
                vote = "each rank's weight shard checked at rest (no replica holds it)"
            elif self.replicas_per_shard:
                vote = f"each rank's weight shard checked at rest, {vote} of each shard"
            parts.append(f"{vote} on {of(self.weights)}")
        if self.audited:
            shown = ", ".join(str(s) for s in self.audited[:6]) + (", ..." if len(self.audited) > 6 else "")
            parts.append(f"audits at {shown}")
        if self.complete < self.steps:
            parts.append(f"{self.steps - self.complete} step(s) missing a rank's record")
        return "; ".join(parts) if parts else "no online check recorded"


_FIELDS = ("flags",)


def online_checks(trace, spans: Iterable[tuple[int, int]]) -> OnlineChecks:
    """The online checks recorded on the steps of ``spans`` (inclusive ``(first, last)`` pairs) of ``trace``.

    Reads the STEP records of those steps only (``Trace.step_windows``: the latest attempt's
    record of each rank-step), flags field alone.
    """
    steps = complete = gradients = weights = 0
    audited: list[int] = []
    audit_steps = None
    for first, last in spans:
        if last < first:
            continue
        for window in trace.step_windows(start=first, stop=last, fields=_FIELDS):
            present = window.present
            flags = window.records["flags"].astype(np.int64)
            every = present.all(axis=1)
            steps += int(present.any(axis=1).sum())
            complete += int(every.sum())
            gradients += int((every & ((flags & int(F.Flag.HAS_GRADS)) != 0).all(axis=1)).sum())
            weights += int((every & ((flags & int(F.Flag.WEIGHTS_CHECKED)) != 0).all(axis=1)).sum())
            audited += [int(s) for s in window.steps[(present & ((flags & int(F.Flag.AUDITED)) != 0)).any(axis=1)]]
        # the recomputations themselves (AUDIT records), should a STEP record lack the flag
        if audit_steps is None:
            audit_steps = trace.records(F.Kind.AUDIT)["step"]
        audited += [int(s) for s in audit_steps[(audit_steps >= first) & (audit_steps <= last)]]
    return OnlineChecks(
        steps=steps,
        complete=complete,
        gradients=gradients,
        weights=weights,
        audited=tuple(sorted(set(audited))),
        world_size=trace.world_size,
        replicas_per_shard=_replicas_per_shard(trace),
    )


def _replicas_per_shard(trace) -> int:
    """How many ranks hold each shard of a sharded job (0: a DDP job, every rank the whole)."""
    mesh = getattr(getattr(trace, "manifest", None), "parallel", None)
    if mesh is None:
        return 0
    groups = mesh.same_shard()
    return min(len(g) for g in groups) if groups else 0
