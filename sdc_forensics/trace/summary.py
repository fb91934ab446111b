"""A summary of a trace directory: what ``sdc-forensics inspect`` shows (numpy only).

Rendering (text and the ``inspect --json`` document) is ``present/inspect.py``'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, read_checkpoint_notes
from sdc_forensics.trace.ends import RunEnd
from sdc_forensics.trace.manifest import Manifest
from sdc_forensics.trace.reader import Damage, Trace


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttemptSummary:
    """Records found for one attempt."""

    attempt: int
    start_step: int
    first_step: int | None
    last_step: int | None
    num_records: int


# ALARM record flags -> (check, what it compared); trace/format.py, recorder/checks.py
_CHECKS = (
    (F.Flag.NONFINITE_LOCAL, "nonfinite", "NaN/Inf value(s) in a local gradient before the all-reduce"),
    (F.Flag.NONFINITE_REDUCED, "nonfinite", "NaN/Inf value(s) in the reduced gradient after the all-reduce"),
    (
        F.Flag.ALLREDUCE_MISMATCH,
        "allreduce",
        "the reduced gradient is not the mean of the local gradients' sketches (or its bits differ between ranks)",
    ),
    (F.Flag.AUDIT_MISMATCH, "audit", "an audit recomputation of a microbatch gave another gradient"),
    (F.Flag.WEIGHTS_DIVERGED, "weights", "replica weights differ from the strict majority after the step"),
    (F.Flag.NO_MAJORITY, "weights", "replica weights (or the parameters the ranks gathered) have no strict majority"),
    (
        F.Flag.GATHER_DIVERGED,
        "weights",
        "a rank's all-gathered parameters differ from the strict majority's (a sharded job)",
    ),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlarmSummary:
    """One online check that fired (every rank records the alarms it saw: counted once here).

    Attributes:
        step: the optimizer step it fired at.
        attempt: the attempt that recorded it.
        check: ``nonfinite``, ``allreduce``, ``audit``, ``weights`` (``unknown`` for a flag this
            version does not know).
        rank: the rank the check found at fault (None: it could not name one).
        detail: what the check compared and found, for people.
        value: the number backing it (NaN/Inf count, worst residual / tolerance; 0 if none).
        recorded_by: the ranks whose file holds this alarm.
    """

    step: int
    attempt: int
    check: str
    rank: int | None
    detail: str
    value: float
    recorded_by: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceSummary:
    """Everything ``inspect`` reports."""

    path: Path
    manifest: Manifest
    first_step: int | None
    last_step: int | None
    num_rank_steps: int
    records_by_kind: dict[str, int]
    attempts: tuple[AttemptSummary, ...]
    checkpoints: tuple[CheckpointNote, ...]
    damage: tuple[Damage, ...]
    # how the latest attempt ended: stopped early or not, where, the last complete step
    end: RunEnd
    alarms: tuple[AlarmSummary, ...] = ()


def summarize(trace: Trace) -> TraceSummary:
    """Scan ``trace`` once (vectorised) and summarise it."""
    counts: dict[str, int] = {kind.name: 0 for kind in F.Kind}
    per_attempt: dict[int, list[int]] = {}
    for rank_file in trace.files:
        recs = rank_file.records
        valid = trace.valid_mask(rank_file)
        kinds = recs["kind"][valid]
        for kind in F.Kind:
            counts[kind.name] += int(np.count_nonzero(kinds == int(kind)))
        steps = recs["step"][valid][kinds == int(F.Kind.STEP)]
        entry = per_attempt.setdefault(rank_file.attempt, [np.iinfo(np.int64).max, np.iinfo(np.int64).min, 0])
        entry[2] += int(valid.sum())
        if steps.size:
            entry[0] = min(entry[0], int(steps.min()))
            entry[1] = max(entry[1], int(steps.max()))
    starts = {a.attempt: a.start_step for a in trace.manifest.attempts}
    attempts = tuple(
        AttemptSummary(
            attempt=att,
            start_step=starts.get(att, -1),
            first_step=lo if hi >= lo else None,
            last_step=hi if hi >= lo else None,
            num_records=n,
        )
        for att, (lo, hi, n) in sorted(per_attempt.items())
    )
    bounds = trace.step_range()
    damage = tuple(trace.damage())
    num_rank_steps = 0
    for window in trace.step_windows():
        num_rank_steps += int(window.present.sum())
    return TraceSummary(
        path=trace.path,
        manifest=trace.manifest,
        first_step=None if bounds is None else bounds[0],
        last_step=None if bounds is None else bounds[1],
        num_rank_steps=num_rank_steps,
        records_by_kind=counts,
        attempts=attempts,
        checkpoints=tuple(read_checkpoint_notes(trace.path)),
        damage=damage,
        end=trace.run_end(),
        alarms=alarms(trace),
    )


def alarms(trace: Trace) -> tuple[AlarmSummary, ...]:
    """The trace's ALARM records, one per (attempt, step, check, rank, value), in step order."""
    # (A,) every rank's copies
    recs = trace.records(F.Kind.ALARM)
    seen: dict[tuple, list[int]] = {}
    for rec in recs:
        key = (int(rec["attempt"]), int(rec["step"]), int(rec["flags"]), int(rec["aux_rank"]), float(rec["aux_value"]))
        seen.setdefault(key, []).append(int(rec["rank"]))
    out = []
    for (attempt, step, flags, aux_rank, value), ranks in sorted(
        seen.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2], kv[0][3])
    ):
        check, what = next(
            ((c, w) for flag, c, w in _CHECKS if flags & int(flag)),
            ("unknown", f"an online check with flags {flags:#x}"),
        )
        if value and check == "nonfinite":
            what = f"{value:g} " + what
        elif value and check == "allreduce":
            what += f"; worst residual {value:.3g}x the tolerance"
        out.append(
            AlarmSummary(
                step=step,
                attempt=attempt,
                check=check,
                rank=aux_rank if aux_rank >= 0 else None,
                detail=what,
                value=value,
                recorded_by=tuple(sorted(set(ranks))),
            )
        )
    return tuple(out)
