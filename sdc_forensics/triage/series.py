"""The per-step series the post-incident review plots, read from the trace alone over a bounded window of steps
(numpy only). The report's flow (``forensics/review.py``) reads them; ``present/plots.py`` draws them.

:func:`plot_window` picks the steps (the whole run when short; else the steps around the first
divergent step, or the last steps of a run without one), and :func:`incident_series` reads them:
per step and rank the loss, the local gradient norm, the all-reduce residual over its calibrated
tolerance (``fingerprint.tolerance``, the rule triage applies), the replica weight consensus
against the strict majority (``trace.consensus``), plus the audits and alarms of the window.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from sdc_forensics.trace import format as F
from sdc_forensics.trace.consensus import strict_majority
from sdc_forensics.trace.reader import Trace

#: The most steps a plot window holds: a longer run shows the steps around the first divergence
#: (or, when there is none, its last steps), so the report's size does not grow with the run.
MAX_PLOT_STEPS = 1000
#: Steps shown after the first divergent step in a window that cannot hold the whole run.
_AFTER_DIVERGENCE = MAX_PLOT_STEPS // 4


class Consensus(enum.IntEnum):
    """A replica's weights at one step, against the strict majority."""

    NOT_CHECKED = 0
    AGREES = 1
    DIFFERS = 2
    NO_MAJORITY = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Series:
    """Per-step, per-rank values of a window of steps.

    Attributes:
        steps: ``(S,)`` the window's recorded steps.
        present: ``(S, R)`` a STEP record exists.
        loss: ``(S, R)`` float64 (NaN where absent).
        grad_norm: ``(S, R)`` local gradient L2 norm (NaN where absent or not recorded).
        residual_ratio: ``(S, R)`` all-reduce residual / tolerance (NaN where the check does not
            apply: a step without every rank's gradients, or a non-finite local gradient).
        consensus: ``(S, R)`` :class:`Consensus` codes.
        audits: ``(A, 3)`` int64 rows ``(step, subject rank, 1 if its vote was lost else 0)``.
        alarms: ``(M, 2)`` int64 rows ``(step, rank)`` of online alarms.
        window: ``(first, last)`` step of the window; ``whole_run``: it holds every recorded step.
    """

    steps: np.ndarray
    present: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    residual_ratio: np.ndarray
    consensus: np.ndarray
    audits: np.ndarray
    alarms: np.ndarray
    window: tuple[int, int]
    whole_run: bool


def plot_window(
    step_range: tuple[int, int] | None, first_divergent_step: int | None, max_steps: int = MAX_PLOT_STEPS
) -> tuple[int, int] | None:
    """The steps to plot: the whole run when it holds at most ``max_steps``; else a window of
    ``max_steps`` around the first divergent step (three quarters before it), or the last
    ``max_steps`` steps when there is none."""
    if step_range is None:
        return None
    lo, hi = step_range
    if hi - lo + 1 <= max_steps:
        return lo, hi
    if first_divergent_step is None:
        return hi - max_steps + 1, hi
    after = min(_AFTER_DIVERGENCE, max_steps - 1)
    end = min(hi, max(first_divergent_step, lo) + after)
    start = max(lo, end - max_steps + 1)
    return start, min(hi, start + max_steps - 1)


_SERIES_FIELDS = (
    "flags",
    "loss",
    "local_norm",
    "reduced_norm",
    "nonfinite_local",
    "local_sketch",
    "reduced_sketch",
    "weights_digest",
)


def incident_series(trace: Trace, window: tuple[int, int]) -> Series:
    """The plotted values of steps ``window[0]..window[1]`` (at most a few thousand steps)."""
    from sdc_forensics.fingerprint import tolerance

    lo, hi = window
    grad_dtype, reduction = trace.manifest.fingerprint.grad_dtype, trace.manifest.reduction
    parts = []
    for win in trace.step_windows(window=max(1, hi - lo + 1), start=lo, stop=hi, fields=_SERIES_FIELDS):
        # (S, R)
        rec, present = win.records, win.present
        flags = rec["flags"]
        has_grads = ((flags & int(F.Flag.HAS_GRADS)) != 0) & present
        has_w = ((flags & int(F.Flag.HAS_WEIGHTS)) != 0) & present
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            loss = np.where(present, rec["loss"], np.nan)
            norm = np.where(has_grads, rec["local_norm"].astype(np.float64), np.nan)
            # (S,)
            full = has_grads.all(axis=1) & ((rec["nonfinite_local"] == 0) | ~present).all(axis=1)
            residual = tolerance.allreduce_residual(
                rec["local_sketch"][:, None, :, :],
                rec["reduced_sketch"],
                reduction,
                # (S, R)
            )
            # (S, 1, R)
            local_norms = np.where(present, rec["local_norm"], 0.0)[:, None, :]
            # (S, R)
            tol = tolerance.allreduce_tolerance(grad_dtype, local_norms, rec["reduced_norm"], reduction)
            ratio = np.where(full[:, None] & has_grads, residual / np.maximum(tol, 1e-300), np.nan)
        majority, has_majority = strict_majority(rec["weights_digest"], has_w)
        # (S,)
        checked = has_w.sum(axis=1) >= 2
        consensus = np.full(present.shape, int(Consensus.NOT_CHECKED), dtype=np.int8)
        agrees = (rec["weights_digest"] == majority[:, None]) & has_w & (checked & has_majority)[:, None]
        differs = (rec["weights_digest"] != majority[:, None]) & has_w & (checked & has_majority)[:, None]
        consensus[agrees] = int(Consensus.AGREES)
        consensus[differs] = int(Consensus.DIFFERS)
        consensus[has_w & (checked & ~has_majority)[:, None]] = int(Consensus.NO_MAJORITY)
        parts.append((win.steps, present, loss, norm, ratio, consensus))
    if parts:
        steps, present, loss, norm, ratio, consensus = (np.concatenate(p) for p in zip(*parts))
    else:
        world = trace.world_size
        steps = np.zeros(0, np.int64)
        present = np.zeros((0, world), bool)
        loss = norm = ratio = np.zeros((0, world))
        consensus = np.zeros((0, world), np.int8)
    bounds = trace.step_range()
    return Series(
        steps=steps,
        present=present,
        loss=loss,
        grad_norm=norm,
        residual_ratio=ratio,
        consensus=consensus,
        audits=_audit_rows(trace, lo, hi),
        alarms=_alarm_rows(trace, lo, hi),
        window=(lo, hi),
        whole_run=bounds is not None and bounds[0] >= lo and bounds[1] <= hi,
    )


def _audit_rows(trace: Trace, lo: int, hi: int) -> np.ndarray:
    """``(step, subject, lost)``: one row per audited (step, subject), lost = its own gradient is
    not what a strict majority of subject + auditors computed (``triage.audit_votes``)."""
    from sdc_forensics.triage.trace_only import audit_votes

    audits = trace.records(F.Kind.AUDIT)
    audits = audits[(audits["step"] >= lo) & (audits["step"] <= hi)]
    rows = []
    if len(audits):
        for step, subject, _, votes, winner, strict in audit_votes(audits):
            rows.append((step, subject, 0 if strict and votes[0][1] == winner else 1))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def _alarm_rows(trace: Trace, lo: int, hi: int) -> np.ndarray:
    alarms = trace.records(F.Kind.ALARM)
    alarms = alarms[(alarms["step"] >= lo) & (alarms["step"] <= hi)]
    return np.stack([alarms["step"].astype(np.int64), alarms["rank"].astype(np.int64)], axis=1).reshape(-1, 2)
