"""A summary of a trace directory: what ``sdc-forensics inspect`` shows (numpy only)."""

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
    end: RunEnd  # how the latest attempt ended: stopped early or not, where, the last complete step


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
    )


def summary_document(summary: TraceSummary) -> dict:
    """The ``inspect --json`` document (without ``schema_version``)."""
    m = summary.manifest
    latest = max(m.attempts, key=lambda a: a.attempt) if m.attempts else None
    return {
        "trace_dir": str(summary.path),
        "format_version": m.format_version,
        "world_size": m.world_size,
        "recipe": m.recipe,
        "fingerprint": dataclasses.asdict(m.fingerprint),
        "steps": {"first": summary.first_step, "last": summary.last_step, "rank_steps": summary.num_rank_steps},
        "end": summary.end.to_json(),
        "records": summary.records_by_kind,
        "attempts": [dataclasses.asdict(a) for a in summary.attempts],
        "ranks": [dataclasses.asdict(r) for r in (latest.ranks if latest else ())],
        "environment": None
        if latest is None
        else {"torch": latest.torch_version, "cuda": latest.cuda_version, "determinism": latest.determinism},
        "checkpoints": [
            {"step": c.step, "path": c.path, "attempt": c.attempt, "blessed": c.blessed, "weights_digest": c.weights_digest}
            for c in summary.checkpoints
        ],
        "damage": [dataclasses.asdict(d) for d in summary.damage],
        "usable": True,
    }
