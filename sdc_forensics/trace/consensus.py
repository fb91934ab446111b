"""Replica consensus: the one strict-majority vote over per-rank digests, vectorised (numpy only).

A strict majority is a value held by more than half of the valid cells of a row. Every vote
calls :func:`strict_majority` (rows of a table) or :func:`vote` (one row): the recorder's online
checks (``recorder/checks.py``), triage and its audits (``triage/trace_only.py``), the replay's
reduced-gradient vote (``replay/compare.py``) and certification's majority weights
(:func:`majority_weights_digests`). The compiled trace scan (``trace/scan_kernels.rows``) keeps
its own Boyer-Moore pass for speed; ``tests/trace/test_consensus.py`` holds it to this one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import hex64
from sdc_forensics.trace.reader import Trace

_SENTINEL = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def strict_majority(values: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the value held by more than half of the valid cells.

    Args:
        values: ``(S, R)`` uint64 digests.
        valid: ``(S, R)`` bool, which cells vote.

    Returns:
        ``(majority (S,) uint64, has_majority (S,) bool)``; ``majority`` is meaningless where
        ``has_majority`` is False. O(S R log R): a strict majority, if any, holds the middle
        position of the sorted valid values of its row.
    """
    values = np.asarray(values, dtype=np.uint64)
    valid = np.asarray(valid, dtype=bool)
    # (S,)
    num_valid = valid.sum(axis=1)
    # valid values first
    ordered = np.sort(np.where(valid, values, _SENTINEL), axis=1)
    rows = np.arange(values.shape[0])
    candidate = (
        ordered[rows, np.minimum(num_valid // 2, max(values.shape[1] - 1, 0))]
        if values.shape[1]
        else np.zeros(0, np.uint64)
    )
    votes = ((values == candidate[:, None]) & valid).sum(axis=1)
    return candidate, (votes * 2 > num_valid) & (num_valid > 0)


def majority_within(
    values: np.ndarray, valid: np.ndarray, groups: Iterable[Sequence[int]] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, each group's strict-majority value, spread over the group's columns.

    Args:
        values: ``(S, R)`` uint64, a row per step, a column per rank.
        valid: ``(S, R)`` bool, which cells vote.
        groups: the groups of ranks that must agree (columns); None: every rank is one group.

    Returns:
        ``(majority (S, R) uint64, has_majority (S, R) bool)``: for each cell, its group's
        majority in that row and whether there is one (``trace.consensus.strict_majority``
        within each group).
    """
    values = np.asarray(values, dtype=np.uint64)
    valid = np.asarray(valid, dtype=bool)
    if groups is None:
        majority, has = strict_majority(values, valid)
        return np.repeat(majority[:, None], values.shape[1], axis=1), np.repeat(has[:, None], values.shape[1], axis=1)
    majority, has = np.zeros(values.shape, dtype=np.uint64), np.zeros(values.shape, dtype=bool)
    for group in groups:
        g = list(group)
        value, ok = strict_majority(values[:, g], valid[:, g])
        majority[:, g], has[:, g] = value[:, None], ok[:, None]
    return majority, has


def vote(values, valid=None) -> tuple[int | None, int]:
    """One row's strict-majority vote (:func:`strict_majority` on a single row).

    Args:
        values: ``(R,)`` digests (anything ``np.uint64`` holds).
        valid: ``(R,)`` bool, which cells vote (default: all).

    Returns:
        ``(value, votes)``: the value more than half of the valid cells hold and how many hold
        it, or ``(None, 0)`` when there is no strict majority (or nothing votes).
    """
    row = np.asarray(values, dtype=np.uint64).reshape(1, -1)
    if not row.size:
        return None, 0
    ok = np.ones(row.shape, dtype=bool) if valid is None else np.asarray(valid, dtype=bool).reshape(1, -1)
    majority, has_majority = strict_majority(row, ok)
    if not has_majority[0]:
        return None, 0
    return int(majority[0]), int(((row == majority[0]) & ok).sum())


def majority_weights_digests(trace: Trace, checkpoint_steps: list[int], window: int = 4096) -> dict[int, str]:
    """``{N: hex}``: the strict-majority weights digest of ``θ_N`` among the replicas.

    ``θ_N`` is what the STEP records of step ``N - 1`` hold (post-update weights); checkpoint 0
    has no such record and is absent from the result.
    """
    wanted = sorted({n - 1 for n in checkpoint_steps if n >= 1})
    out: dict[int, str] = {}
    if not wanted:
        return out
    for win in trace.step_windows(window, wanted[0], wanted[-1], fields=("flags", "weights_digest")):
        rows = np.flatnonzero(np.isin(win.steps, wanted))
        if not rows.size:
            continue
        rec = win.records[rows]
        has_w = win.present[rows] & ((rec["flags"] & int(F.Flag.HAS_WEIGHTS)) != 0)
        majority, ok = strict_majority(rec["weights_digest"], has_w)
        for row, value, good in zip(rows, majority, ok):
            if good:
                out[int(win.steps[row]) + 1] = hex64(int(value))
    return out
