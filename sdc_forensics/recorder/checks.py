"""Decisions of the online checks, on values already gathered from every rank (numpy only).

Every rank runs the same decision on the same gathered numbers, so every rank reaches the
same verdict at the same time and raises (or continues) together: no rank is left waiting in
a collective that the others abandoned.

What lives here once, for every layout (``ddp_layout.py``, ``fsdp_layout.py``) and for the
stand-alone FSDP checks (``fsdp_monitor.py``, ``fsdp_fallback.py``, ``fsdp_checks.py``):

* :class:`Check`, the closed set of checks, and :class:`Finding`, the one type of what a check
  found. A sharded job's reduce-scatter checks are members too, each knowing the check it
  reports as (:attr:`Check.family`) and the trace flag it sets (:attr:`Check.flag`).
* :func:`majority_within` and :func:`vote_within`: the strict-majority vote within groups of
  ranks that must agree (every rank in DDP, the replicas of one shard in HSDP), built on
  ``trace/consensus.py``'s vote. Triage's per-group weights vote is the same question asked of
  a window of steps: :func:`majority_within` answers both (numpy only, like this whole module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from sdc_forensics.errors import SdcAlarm
from sdc_forensics.fingerprint import tolerance
from sdc_forensics.recorder.options import Choice

# the vote within groups is written once, in trace/consensus.py (numpy only: triage takes it from there too)
from sdc_forensics.trace.consensus import majority_within as majority_within
from sdc_forensics.trace.format import Flag


class Check(Choice):
    """The online checks, by the names alarms and exceptions give them.

    The first four are the recorder's alarm names; the last four are the finer names the FSDP
    monitor gives its findings (``fsdp_monitor.StepCheck``), each reported by the recorder as
    its :attr:`family`.
    """

    NONFINITE = "nonfinite"
    ALLREDUCE = "allreduce"
    AUDIT = "audit"
    WEIGHTS = "weights"
    #: NaN/Inf in a rank's local gradient, before its reduce-scatter
    NONFINITE_BEFORE = "nonfinite-before"
    #: NaN/Inf in a reduce-scatter (or replica all-reduce) output from finite inputs
    NONFINITE_AFTER = "nonfinite-after"
    #: a rank's reduce-scatter output is not the sum of every rank's chunk for it
    REDUCE_SCATTER = "reduce-scatter"
    #: HSDP: a rank's replica all-reduce output is not the sum of its replicas' shards
    REPLICA_ALL_REDUCE = "all-reduce"

    @property
    def family(self) -> "Check":
        """The recorder's alarm name for this check (itself for the first four)."""
        return _FAMILY.get(self, self)

    @property
    def flag(self) -> Flag:
        """The trace flag an ALARM of this check carries unless its finding names another."""
        return _FLAG[self]


_FAMILY = {
    Check.NONFINITE_BEFORE: Check.NONFINITE,
    Check.NONFINITE_AFTER: Check.NONFINITE,
    Check.REDUCE_SCATTER: Check.ALLREDUCE,
    Check.REPLICA_ALL_REDUCE: Check.ALLREDUCE,
}
_FLAG = {
    Check.NONFINITE: Flag.NONFINITE_LOCAL,
    Check.NONFINITE_BEFORE: Flag.NONFINITE_LOCAL,
    Check.NONFINITE_AFTER: Flag.NONFINITE_REDUCED,
    Check.ALLREDUCE: Flag.ALLREDUCE_MISMATCH,
    Check.REDUCE_SCATTER: Flag.ALLREDUCE_MISMATCH,
    Check.REPLICA_ALL_REDUCE: Flag.ALLREDUCE_MISMATCH,
    Check.AUDIT: Flag.AUDIT_MISMATCH,
    Check.WEIGHTS: Flag.WEIGHTS_DIVERGED,
}

#: The recorder's check names (the members; each equals its old string).
NONFINITE, ALLREDUCE, AUDIT, WEIGHTS = Check.NONFINITE, Check.ALLREDUCE, Check.AUDIT, Check.WEIGHTS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
    """One check that fired.

    Attributes:
        check: the :class:`Check` (a string naming one is accepted and becomes it).
        step: the optimizer step (-1 where the finder does not know it: the FSDP monitor's
            per-call findings, whose step is their ``StepCheck``'s).
        rank: the global rank found at fault, -1 when the check cannot name one.
        flag: the trace flag that names the check in the ALARM record (default: the check's).
        detail: one human sentence: what was compared and what was found.
        ranks: every rank implicated (``rank`` is the first of them).
        value: a number backing the finding (residual, count), 0 if none.
        call: which reduce-scatter of the step (the FSDP monitor's findings), else 0.
        where: host, device and mesh coordinates of ``rank`` when the finder knows them.
    """

    check: Check
    step: int = -1
    rank: int
    flag: Flag | None = None
    detail: str
    ranks: tuple[int, ...] = ()
    value: float = 0.0
    call: int = 0
    where: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "check", Check(self.check))
        if self.flag is None:
            object.__setattr__(self, "flag", self.check.flag)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Majority:
    """Outcome of a strict-majority vote over per-rank values."""

    # None when no value has more than half the votes
    value: int | None
    agreeing: tuple[int, ...]
    diverged: tuple[int, ...]


#: ``(group of global ranks, its vote in global ranks)``, one per group (:func:`vote_within`)
GroupVote = tuple[tuple[int, ...], Majority]


def vote_within(values, groups: Iterable[Sequence[int]]) -> list[GroupVote]:
    """The vote of each group of ranks over its members' values (``values[r]``: rank ``r``'s).

    A group of one agrees with itself. Without a strict majority the whole group is ``diverged``
    and the vote's value is None.
    """
    row = np.asarray(values, dtype=np.uint64).reshape(1, -1)
    groups = [tuple(int(r) for r in group) for group in groups]
    majority, has = majority_within(row, np.ones(row.shape, dtype=bool), groups)
    out = []
    for group in groups:
        if not group:
            continue
        if not has[0, group[0]]:
            out.append((group, Majority(value=None, agreeing=(), diverged=group)))
            continue
        value = int(majority[0, group[0]])
        out.append(
            (
                group,
                Majority(
                    value=value,
                    agreeing=tuple(r for r in group if int(row[0, r]) == value),
                    diverged=tuple(r for r in group if int(row[0, r]) != value),
                ),
            )
        )
    return out


def overall(votes: list[GroupVote], rank: int) -> Majority:
    """Every group's vote as one: its ``value`` is the majority of ``rank``'s own group, None as
    soon as any group has none (nothing may then be blessed); ranks sorted."""
    blessed = all(vote.value is not None for _, vote in votes)
    own = next((vote.value for group, vote in votes if rank in group), None)
    return Majority(
        value=own if blessed else None,
        agreeing=tuple(sorted(r for _, v in votes for r in v.agreeing)),
        diverged=tuple(sorted(r for _, v in votes for r in v.diverged)),
    )


def own_weights_flag(votes: list[GroupVote], rank: int) -> int:
    """The flag ``rank``'s STEP record gets from a weights vote: ``NO_MAJORITY`` when its group
    has no majority, ``WEIGHTS_DIVERGED`` when it is outside it, else 0."""
    for group, vote in votes:
        if rank in group:
            if vote.value is None:
                return int(Flag.NO_MAJORITY)
            return int(Flag.WEIGHTS_DIVERGED) if rank in vote.diverged else 0
    return 0


def strict_majority(values) -> Majority:
    """The value held by more than half of the ranks (index = rank), if any (one group of all)."""
    values = [int(v) for v in values]
    if not values:
        return Majority(value=None, agreeing=(), diverged=())
    return vote_within(values, [range(len(values))])[0][1]


def check_nonfinite(step: int, nonfinite_local: np.ndarray, nonfinite_reduced: np.ndarray) -> Finding | None:
    """NaN/Inf in local gradients (before the all-reduce) or in the reduced gradient (before the update).

    Args:
        nonfinite_local: ``(W,)`` NaN/Inf counts of each rank's local gradient.
        nonfinite_reduced: ``(W,)`` the same for each rank's reduced gradient.
    """
    local = np.flatnonzero(np.asarray(nonfinite_local) > 0)
    if local.size:
        ranks = tuple(int(r) for r in local)
        return Finding(
            check=NONFINITE,
            step=step,
            rank=ranks[0],
            ranks=ranks,
            flag=Flag.NONFINITE_LOCAL,
            value=float(np.asarray(nonfinite_local)[local].sum()),
            detail=f"NaN/Inf in the local gradient of rank(s) {', '.join(map(str, ranks))} before the all-reduce",
        )
    reduced = np.flatnonzero(np.asarray(nonfinite_reduced) > 0)
    if reduced.size:
        everywhere = reduced.size == len(nonfinite_reduced)
        ranks = tuple(int(r) for r in reduced)
        return Finding(
            check=NONFINITE,
            step=step,
            rank=-1 if everywhere else ranks[0],
            ranks=() if everywhere else ranks,
            flag=Flag.NONFINITE_REDUCED,
            value=float(np.asarray(nonfinite_reduced)[reduced].sum()),
            detail="NaN/Inf appeared in the reduced gradient on "
            + (
                "every rank although all local gradients were finite: inside the collective"
                if everywhere
                else f"rank(s) {', '.join(map(str, ranks))} only, after the all-reduce"
            ),
        )
    return None


def check_allreduce(
    step: int,
    local_sketch: np.ndarray,
    local_norm: np.ndarray,
    reduced_sketch: np.ndarray,
    reduced_norm: np.ndarray,
    reduced_digest: np.ndarray,
    grad_dtype: str,
    reduction: str = "mean",
) -> tuple[Finding | None, np.ndarray]:
    """The all-reduce check: each rank's reduced sketch against the mean of all local sketches.

    Args:
        local_sketch: ``(W, k)`` local (un-averaged) gradient sketches.
        local_norm: ``(W,)`` their L2 norms.
        reduced_sketch: ``(W, k)`` each rank's reduced-gradient sketch.
        reduced_norm: ``(W,)``.
        reduced_digest: ``(W,)`` exact digests of the reduced gradients (the collective hands every
            rank the same bits, so a rank outside the strict majority received something else).

    Returns:
        The finding (or None) and a ``(W,)`` bool mask of ranks whose reduced gradient is wrong.
    """
    world_size = len(local_norm)
    residual = np.array(
        [tolerance.allreduce_residual(local_sketch, reduced_sketch[r], reduction) for r in range(world_size)]
    )
    tol = np.array(
        [tolerance.allreduce_tolerance(grad_dtype, local_norm, reduced_norm[r], reduction) for r in range(world_size)]
    )
    # (W,)
    sketch_bad = residual > tol
    vote = strict_majority(np.asarray(reduced_digest).astype(np.uint64))
    digest_bad = np.zeros(world_size, dtype=bool)
    if vote.value is not None:
        digest_bad[list(vote.diverged)] = True
    bad = sketch_bad | digest_bad
    if not bad.any():
        return None, bad
    worst = float(np.max(residual / np.maximum(tol, 1e-300)))
    if bad.all():
        return Finding(
            check=ALLREDUCE,
            step=step,
            rank=-1,
            flag=Flag.ALLREDUCE_MISMATCH,
            value=worst,
            detail=f"the reduced gradient differs from the mean of the local sketches on every rank "
            f"(residual {worst:.3g}x the tolerance): corruption inside the collective",
        ), bad
    ranks = tuple(int(r) for r in np.flatnonzero(bad))
    how = (
        "sketch beyond tolerance"
        if sketch_bad[list(ranks)].any()
        else "bits differ from the other ranks' reduced gradient"
    )
    return Finding(
        check=ALLREDUCE,
        step=step,
        rank=ranks[0],
        ranks=ranks,
        flag=Flag.ALLREDUCE_MISMATCH,
        value=worst,
        detail=f"the reduced gradient on rank(s) {', '.join(map(str, ranks))} is not what the collective produced elsewhere ({how})",
    ), bad


def replica_weights_finding(step: int, vote: Majority, count: int) -> Finding | None:
    """What a vote of ``count`` whole replicas' weight digests after ``step``'s update found."""
    if vote.value is None:
        return Finding(
            check=WEIGHTS,
            step=step,
            rank=-1,
            flag=Flag.NO_MAJORITY,
            detail=f"replica weights after step {step} have no strict majority among {count} ranks",
        )
    if vote.diverged:
        return Finding(
            check=WEIGHTS,
            step=step,
            rank=vote.diverged[0],
            ranks=vote.diverged,
            flag=Flag.WEIGHTS_DIVERGED,
            detail=f"replica weights of rank(s) {', '.join(map(str, vote.diverged))} differ from the strict majority after step {step}",
        )
    return None


def check_weights(step: int, digests: np.ndarray) -> tuple[Finding | None, Majority]:
    """Replica weight digests after the update: a replica outside the strict majority is the suspect."""
    vote = strict_majority(np.asarray(digests).astype(np.uint64))
    return replica_weights_finding(step, vote, len(digests)), vote


def alarm_of(finding: Finding, identities: Sequence, trace_dir) -> SdcAlarm:
    """The exception a finding raises under policy ``raise``: what fired, the suspect rank with its
    host and GPU (``identities``: every rank's, by rank), where the trace is and what to run next."""
    ident = identities[finding.rank] if 0 <= finding.rank < len(identities) else None
    where = f"rank {finding.rank} on host {ident.host} ({ident.gpu})" if ident else "no single rank (see detail)"
    return SdcAlarm(
        f"{finding.check} check fired at step {finding.step}: {finding.detail}. Suspect: {where}. "
        f"The trace is in {trace_dir}; next, run: sdc-forensics bisect {trace_dir}",
        step=finding.step,
        rank=finding.rank,
        host=ident.host if ident else "",
        check=finding.check,
    )
