"""Decisions of the online checks, on values already gathered from every rank (numpy only).

Every rank runs the same decision on the same gathered numbers, so every rank reaches the
same verdict at the same time and raises (or continues) together: no rank is left waiting in
a collective that the others abandoned.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdc_forensics.fingerprint import tolerance
from sdc_forensics.trace.consensus import vote
from sdc_forensics.trace.format import Flag

#: Check names as they appear in alarms and exceptions.
NONFINITE, ALLREDUCE, AUDIT, WEIGHTS = "nonfinite", "allreduce", "audit", "weights"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
    """One check that fired.

    Attributes:
        check: ``nonfinite``, ``allreduce``, ``audit`` or ``weights``.
        step: the optimizer step.
        rank: the global rank found at fault, -1 when the check cannot name one.
        flag: the trace flag that names the check in the ALARM record.
        detail: one human sentence: what was compared and what was found.
        ranks: every rank implicated (``rank`` is the first of them).
        value: a number backing the finding (residual, count), 0 if none.
    """

    check: str
    step: int
    rank: int
    flag: Flag
    detail: str
    ranks: tuple[int, ...] = ()
    value: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Majority:
    """Outcome of a strict-majority vote over per-rank values."""

    value: int | None  # None when no value has more than half the votes
    agreeing: tuple[int, ...]
    diverged: tuple[int, ...]


def strict_majority(values) -> Majority:
    """The value held by more than half of the ranks (index = rank), if any (``consensus.vote``)."""
    values = [int(v) for v in values]
    if not values:
        return Majority(value=None, agreeing=(), diverged=())
    value, _ = vote(values)
    if value is None:
        return Majority(value=None, agreeing=(), diverged=tuple(range(len(values))))
    agreeing = tuple(r for r, v in enumerate(values) if v == value)
    diverged = tuple(r for r, v in enumerate(values) if v != value)
    return Majority(value=value, agreeing=agreeing, diverged=diverged)


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
            check=NONFINITE, step=step, rank=ranks[0], ranks=ranks, flag=Flag.NONFINITE_LOCAL,
            value=float(np.asarray(nonfinite_local)[local].sum()),
            detail=f"NaN/Inf in the local gradient of rank(s) {', '.join(map(str, ranks))} before the all-reduce",
        )
    reduced = np.flatnonzero(np.asarray(nonfinite_reduced) > 0)
    if reduced.size:
        everywhere = reduced.size == len(nonfinite_reduced)
        ranks = tuple(int(r) for r in reduced)
        return Finding(
            check=NONFINITE, step=step, rank=-1 if everywhere else ranks[0], ranks=() if everywhere else ranks,
            flag=Flag.NONFINITE_REDUCED, value=float(np.asarray(nonfinite_reduced)[reduced].sum()),
            detail="NaN/Inf appeared in the reduced gradient on "
            + ("every rank although all local gradients were finite: inside the collective" if everywhere
               else f"rank(s) {', '.join(map(str, ranks))} only, after the all-reduce"),
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
    residual = np.array([tolerance.allreduce_residual(local_sketch, reduced_sketch[r], reduction) for r in range(world_size)])
    tol = np.array([tolerance.allreduce_tolerance(grad_dtype, local_norm, reduced_norm[r], reduction) for r in range(world_size)])
    sketch_bad = residual > tol  # (W,)
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
            check=ALLREDUCE, step=step, rank=-1, flag=Flag.ALLREDUCE_MISMATCH, value=worst,
            detail=f"the reduced gradient differs from the mean of the local sketches on every rank "
            f"(residual {worst:.3g}x the tolerance): corruption inside the collective",
        ), bad
    ranks = tuple(int(r) for r in np.flatnonzero(bad))
    how = "sketch beyond tolerance" if sketch_bad[list(ranks)].any() else "bits differ from the other ranks' reduced gradient"
    return Finding(
        check=ALLREDUCE, step=step, rank=ranks[0], ranks=ranks, flag=Flag.ALLREDUCE_MISMATCH, value=worst,
        detail=f"the reduced gradient on rank(s) {', '.join(map(str, ranks))} is not what the collective produced elsewhere ({how})",
    ), bad


def check_weights(step: int, digests: np.ndarray) -> tuple[Finding | None, Majority]:
    """Replica weight digests after the update: a replica outside the strict majority is the suspect."""
    vote = strict_majority(np.asarray(digests).astype(np.uint64))
    if vote.value is None:
        return Finding(
            check=WEIGHTS, step=step, rank=-1, flag=Flag.NO_MAJORITY,
            detail=f"replica weights after step {step} have no strict majority among {len(digests)} ranks",
        ), vote
    if vote.diverged:
        return Finding(
            check=WEIGHTS, step=step, rank=vote.diverged[0], ranks=vote.diverged, flag=Flag.WEIGHTS_DIVERGED,
            detail=f"replica weights of rank(s) {', '.join(map(str, vote.diverged))} differ from the strict majority after step {step}",
        ), vote
    return None, vote
