"""Turning what the recorder knows into trace records, the manifest and bucket-layout files.

Field meanings are the contract of ``docs/trace-format.md``; this module only fills them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint.core import Fingerprint, combine_digests
from sdc_forensics.recorder.identity import make_attempt
from sdc_forensics.trace import format as F
from sdc_forensics.trace.layouts import write_bucket_layouts
from sdc_forensics.trace.manifest import (
    MANIFEST_NAME,
    Attempt,
    FingerprintSettings,
    Manifest,
    read_manifest,
    write_manifest,
)
from sdc_forensics.trace.writer import RankTraceWriter

if TYPE_CHECKING:
    from sdc_forensics.recorder.step import StepState

_ATTEMPT_GLOB = "rank-*.attempt-*.sdct"


def start_attempt(trace_dir: Path, rank: int, group: Any, manifest: Callable[[int], Manifest]) -> int:
    """Rank 0 numbers the attempt and writes its ``manifest(attempt)``; every rank learns the
    outcome (a collective: a failure is raised on every rank, as a ``UsageError``)."""
    outcome: list = [None, None]
    if rank == 0:
        try:
            trace_dir.mkdir(parents=True, exist_ok=True)
            attempt = next_attempt(trace_dir)
            write_manifest(trace_dir, manifest(attempt))
            outcome = [attempt, None]
        except Exception as exc:  # noqa: BLE001 - every rank must learn it, not only rank 0
            outcome = [
                None,
                exc
                if isinstance(exc, UsageError)
                else UsageError(f"cannot write the trace manifest in {trace_dir}: {exc}"),
            ]
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0), group=group)
    if outcome[1] is not None:
        raise outcome[1]
    return int(outcome[0])


def next_attempt(trace_dir: Path) -> int:
    """0 for a new trace directory, else one more than the highest attempt found on disk."""
    attempts = [int(p.name.split(".attempt-")[1].split(".")[0]) for p in trace_dir.glob(_ATTEMPT_GLOB)]
    return max(attempts) + 1 if attempts else 0


def build_manifest(
    trace_dir: Path,
    *,
    world_size: int,
    settings: FingerprintSettings,
    recipe: str | None,
    recipe_args: dict | None = None,
    framework: dict | None = None,
    checkpoint_every: int | None,
    audit_every: int | None,
    weights_every: int,
    node_of_rank: tuple[int, ...],
    attempt: Attempt,
    parallel=None,
) -> Manifest:
    """This attempt's manifest: the previous attempts of a resumed run are kept."""
    previous: tuple[Attempt, ...] = ()
    if (trace_dir / MANIFEST_NAME).is_file():
        old = read_manifest(trace_dir)
        if old.world_size != world_size:
            raise UsageError(
                f"{trace_dir} holds a trace of {old.world_size} ranks; this run has {world_size}. "
                "Use a new trace directory for a job with a different world size"
            )
        if (old.fingerprint.seed, old.fingerprint.sketch_k) != (settings.seed, settings.sketch_k):
            raise UsageError(
                f"{trace_dir} was recorded with other fingerprint settings (seed, sketch_k); use the same or a new directory"
            )
        previous = tuple(a for a in old.attempts if a.attempt != attempt.attempt)
    return Manifest(
        format_version=F.FORMAT_VERSION,
        format_minor=F.FORMAT_MINOR,
        world_size=world_size,
        fingerprint=settings,
        recipe=recipe,
        recipe_args=recipe_args,
        framework=framework,
        reduction="mean",
        checkpoint_every=checkpoint_every,
        audit_every=audit_every,
        weights_every=weights_every,
        node_of_rank=node_of_rank,
        attempts=previous + (attempt,),
        parallel=parallel,
    )


def update_grad_dtype(trace_dir: Path, grad_dtype: str) -> None:
    """Rewrite the manifest's ``grad_dtype`` once the first bucket showed it (rank 0)."""
    import dataclasses

    manifest = read_manifest(trace_dir)
    if manifest.fingerprint.grad_dtype != grad_dtype:
        write_manifest(
            trace_dir,
            dataclasses.replace(manifest, fingerprint=dataclasses.replace(manifest.fingerprint, grad_dtype=grad_dtype)),
        )


def update_attempt_determinism(trace_dir: Path, attempt: int, settings: dict) -> None:
    """Rewrite this attempt's ``determinism`` with ``settings`` seen at its first step (rank 0):
    ``num_threads`` (rank 0's count: the manifest is written when the recorder is built and
    scripts often call ``torch.set_num_threads`` after that; per-step, per-rank counts are in the
    STEP records) and ``autocast_dtype`` (seen in the first forward)."""
    import dataclasses

    manifest = read_manifest(trace_dir)
    attempts = tuple(
        dataclasses.replace(a, determinism={**a.determinism, **settings})
        if a.attempt == attempt and any(a.determinism.get(k) != v for k, v in settings.items())
        else a
        for a in manifest.attempts
    )
    if attempts != manifest.attempts:
        write_manifest(trace_dir, dataclasses.replace(manifest, attempts=attempts))


def write_layouts(trace_dir: Path, attempt: int, layouts: list[dict]) -> Path:
    """This attempt's bucket layouts, ``[{"from_step", "buckets"}]``, written atomically (``trace/layouts.py``)."""
    return write_bucket_layouts(trace_dir, attempt, layouts)


def note_layout(layouts: list[dict], step: int, rec) -> None:
    """The gradient's buckets as of ``step``, appended to ``layouts`` (the recorder's) and written
    by rank 0 when they change: DDP rebuilds them after its first step. The first layout seen
    gives the manifest the gradient's dtype when the options did not."""
    buckets = rec.layout.buckets()
    if not buckets or (layouts and layouts[-1]["buckets"] == buckets):
        return
    layouts.append({"from_step": step, "buckets": buckets})
    if rec.rank == 0:
        write_layouts(rec.trace_dir, rec.attempt, layouts)
        seen = rec.layout.seen_grad_dtype()
        if rec.options.grad_dtype is None and seen and len(layouts) == 1:
            update_grad_dtype(rec.trace_dir, seen)


def ids_digest(ids) -> int:
    """Digest of the microbatch IDs as an int64 array (``microbatch_digest``): the exact digest of
    its little-endian bytes, which ``combine_digests`` computes with the compiled kernel (the
    numpy reference it falls back to cost ~0.4 ms a step)."""
    return combine_digests(int(i) for i in ids)


def fill_ids(record: np.ndarray, ids) -> bool:
    """Fill the microbatch fields; returns True when IDS records must follow (not contiguous)."""
    ids = [int(i) for i in ids]
    record["microbatch_count"] = len(ids)
    record["microbatch_digest"] = ids_digest(ids)
    if ids and ids == list(range(ids[0], ids[0] + len(ids))):
        record["microbatch_first"] = ids[0]
        record["flags"] |= int(F.Flag.CONTIGUOUS_IDS)
        return False
    record["microbatch_first"] = ids[0] if ids else 0
    return bool(ids)


def fill_grads(record: np.ndarray, prefix: str, fp: Fingerprint) -> None:
    """Fill ``local_*`` or ``reduced_*`` from a fingerprint."""
    record[f"{prefix}_digest"] = fp.digest % (1 << 64)
    record[f"{prefix}_norm"] = fp.norm
    record[f"{prefix}_max_abs"] = fp.max_abs
    record[f"{prefix}_sketch"] = fp.sketch.astype(np.float32)
    record[f"nonfinite_{prefix}"] = min(fp.nonfinite, 0xFFFF_FFFF)


def step_record(writer: RankTraceWriter, state: StepState) -> np.ndarray:
    """The STEP record of ``state`` (its thread count, ``aux_value``, is the caller's to fill)."""
    rec = writer.new(F.Kind.STEP, state.step)
    rec["loss"] = state.summed_loss()
    rec["input_digest"] = combine_digests(state.input_digests) % (1 << 64) if state.input_digests else 0
    if state.local is not None:
        fill_grads(rec, "local", state.local)
    if state.reduced is not None:
        fill_grads(rec, "reduced", state.reduced)
    if state.weights is not None:
        digest, norm, nonfinite = state.weights
        rec["weights_digest"], rec["weights_norm"], rec["nonfinite_weights"] = digest % (1 << 64), norm, nonfinite
    # a sharded job: the weight shard as the step found it
    if state.rest_weights is not None:
        rec["aux_digest"] = state.rest_weights % (1 << 64)
        rec["flags"] |= int(F.Flag.REST_WEIGHTS)
    rec["flags"] |= state.flags
    return rec


def append_step(writer: RankTraceWriter, record: np.ndarray, state: StepState) -> None:
    """``state``'s STEP record, its IDS record where its IDs are not a range, then a pipeline
    stage's HANDOFF record."""
    append_with_ids(writer, record, state.ids, state.step)
    found = state.handoff_digests()
    if found is None:
        return
    rec = writer.new(F.Kind.HANDOFF, state.step)
    rec["aux_digest"], rec["input_digest"], rec["microbatch_count"] = found
    writer.append(rec)


def append_with_ids(writer: RankTraceWriter, record: np.ndarray, ids, step: int) -> None:
    """Append a STEP or AUDIT record, followed by IDS records when the IDs are not a range."""
    if ids is not None and fill_ids(record, ids):
        writer.append(np.concatenate([record, writer.ids_records(step, np.asarray(list(ids), dtype=np.int64))]))
    else:
        writer.append(record)


def append_audits(writer: RankTraceWriter, step: int, recomputations) -> None:
    """One AUDIT record per recomputation this rank performed (``audit.Recomputation``)."""
    for recomputation in recomputations:
        rec = writer.new(F.Kind.AUDIT, step)
        rec["aux_rank"] = recomputation.subject
        rec["loss"] = recomputation.loss
        rec["input_digest"] = recomputation.input_digest % (1 << 64)
        rec["aux_digest"] = recomputation.subject_digest % (1 << 64)
        fill_grads(rec, "local", recomputation.fingerprint)
        rec["flags"] = (
            int(F.Flag.HAS_GRADS)
            | (int(F.Flag.AUDIT_TIEBREAK) if recomputation.tiebreak else 0)
            | (int(F.Flag.AUDIT_MISMATCH) if recomputation.mismatch else 0)
        )
        append_with_ids(writer, rec, recomputation.ids, step)


def manifest_of(rec, attempt: int) -> Manifest:
    """The manifest of attempt ``attempt`` of the recorder ``rec`` (rank 0 writes it: :func:`start_attempt`)."""
    options = rec.options
    settings = FingerprintSettings(
        seed=options.seed, sketch_k=options.sketch_k, grad_dtype=options.grad_dtype or "float32"
    )
    return build_manifest(
        rec.trace_dir,
        world_size=rec.world_size,
        settings=settings,
        recipe=rec.recipe_ref,
        recipe_args=rec.recipe_args,
        framework=rec.framework,
        checkpoint_every=options.checkpoint_every,
        audit_every=options.audit_every or None,
        weights_every=options.weights_every,
        node_of_rank=rec.nodes,
        parallel=rec.mesh,
        attempt=make_attempt(
            attempt,
            options.start_step,
            rec.identities,
            device=rec.device,
            backend=str(dist.get_backend(rec.group)),
            reduction=options.reduction.value,
            comm_hook=rec._comm_hook_name,
            layout_settings=rec.layout.numerics,
        ),
    )
