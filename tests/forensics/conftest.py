"""Factories for forensics tests: synthetic traces with planted faults, written record by record.

``make_trace(ranks=4, steps=20, fault=Fault(kind, step, rank))`` writes a trace whose records are
consistent the way a healthy DDP run's are (local sketches average to the reduced sketch, equal
reduced and weights digests on every rank) and plants one fault. The fault kinds mirror what the
recorder can see: ``nonfinite``, ``allreduce`` (one rank's reduced result), ``allreduce-all``,
``weights`` (one replica's weights from ``step`` on), ``audit-subject``, ``audit-auditor``,
``input`` (an auditor fetched different input bytes), ``outlier`` (a huge local gradient norm).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.trace import format as F
from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, Manifest, RankIdentity, write_manifest
from sdc_forensics.trace.writer import RankTraceWriter


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    step: int
    rank: int = 0


def _digest(*parts: int) -> int:
    value = np.uint64(0)
    for part in parts:
        value = C.splitmix64(np.array([value ^ np.uint64(part % (1 << 64))], dtype=np.uint64))[0]
    return int(value)


def write_trace(path, *, ranks: int = 4, steps: int = 20, fault: Fault | tuple[Fault, ...] | None = None, audit_every: int | None = None,
                weights_every: int = 1, recipe: str | None = None, seed: int = 0):
    """Write a synthetic trace to ``path`` and return it."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    k = C.DEFAULT_SKETCH_K
    idents = tuple(RankIdentity(rank=r, host=f"node{r // 2}", node_rank=r // 2, gpu_uuid=f"GPU-{r:04d}") for r in range(ranks))
    write_manifest(path, Manifest(
        format_version=F.FORMAT_VERSION, world_size=ranks, fingerprint=FingerprintSettings(seed=C.DEFAULT_SEED, sketch_k=k),
        recipe=recipe, audit_every=audit_every, weights_every=weights_every, node_of_rank=tuple(r // 2 for r in range(ranks)),
        attempts=(Attempt(attempt=0, start_step=0, ranks=idents),),
    ))
    writers = [RankTraceWriter(path, rank=r, attempt=0, world_size=ranks, sketch_k=k, seed=C.DEFAULT_SEED) for r in range(ranks)]
    diverged = np.zeros(ranks, dtype=bool)
    faults = fault if isinstance(fault, tuple) else (fault,) if fault is not None else ()
    for step in range(steps):
        fault = next((f for f in faults if f.step == step), None)
        local = rng.standard_normal((ranks, k)).astype(np.float32)  # (R, k)
        norms = (1.0 + 0.01 * rng.standard_normal(ranks)).astype(np.float32)
        reduced = np.repeat(local.astype(np.float64).mean(axis=0, keepdims=True), ranks, axis=0).astype(np.float32)
        reduced_digest = np.full(ranks, _digest(step, 1), dtype=np.uint64)
        weights = np.full(ranks, _digest(step, 2), dtype=np.uint64)
        nonfinite = np.zeros(ranks, dtype=np.uint32)
        hit = fault is not None and fault.step == step
        if hit and fault.kind == "nonfinite":
            nonfinite[fault.rank] = 3
        if hit and fault.kind == "allreduce":
            reduced[fault.rank, 0] += 50.0
            reduced_digest[fault.rank] ^= np.uint64(1)
        if hit and fault.kind == "allreduce-all":
            reduced[:, 0] += 50.0
        if hit and fault.kind == "weights":
            diverged[fault.rank] = True
        if hit and fault.kind == "outlier":
            norms[fault.rank] = 1e4
        weights[diverged] ^= np.uint64(0xF00)
        for r, writer in enumerate(writers):
            rec = writer.new(F.Kind.STEP, step)
            flags = F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_GRADS
            if step % weights_every == 0:
                flags |= F.Flag.HAS_WEIGHTS | F.Flag.WEIGHTS_CHECKED
            rec["flags"] = int(flags)
            rec["loss"] = 2.0 - 0.01 * step + 0.001 * r
            rec["input_digest"] = _digest(step, r, 3)
            rec["microbatch_first"] = (step * ranks + r) * 2
            rec["microbatch_count"] = 2
            rec["local_digest"] = _digest(step, r, 4)
            rec["reduced_digest"] = reduced_digest[r]
            rec["weights_digest"] = weights[r] if step % weights_every == 0 else 0
            rec["local_norm"] = norms[r]
            rec["reduced_norm"] = 0.5
            rec["nonfinite_local"] = nonfinite[r]
            rec["nonfinite_reduced"] = 3 if nonfinite.any() else 0
            rec["local_sketch"] = local[r]
            rec["reduced_sketch"] = reduced[r]
            writer.append(rec)
        if audit_every and step % audit_every == 0:
            _write_audit(writers, step, ranks, fault if hit else None)
    for writer in writers:
        writer.close()
    return path


def _write_audit(writers, step: int, ranks: int, fault: Fault | None) -> None:
    subject = step % ranks
    auditor = (subject + 2) % ranks
    own = _digest(step, subject, 4)
    votes = [(auditor, own, False)]
    if fault is not None and fault.kind == "audit-subject" and fault.rank == subject:
        own ^= 0x1  # the subject's own result was wrong: both auditors disagree with it
        votes = [(auditor, _digest(step, subject, 4), False), ((subject + 3) % ranks, _digest(step, subject, 4), True)]
    if fault is not None and fault.kind == "audit-auditor":
        votes = [(auditor, own ^ 0x2, False), ((subject + 3) % ranks, own, True)]
    for who, value, tiebreak in votes:
        rec = writers[who].new(F.Kind.AUDIT, step)
        flags = F.Flag.CONTIGUOUS_IDS | (F.Flag.AUDIT_TIEBREAK if tiebreak else 0) | (F.Flag.AUDIT_MISMATCH if value != own else 0)
        rec["flags"] = int(flags)
        rec["aux_rank"] = subject
        rec["aux_digest"] = own
        rec["local_digest"] = value
        rec["input_digest"] = _digest(step, subject, 3) ^ (7 if fault is not None and fault.kind == "input" else 0)
        rec["microbatch_first"] = (step * ranks + subject) * 2
        rec["microbatch_count"] = 2
        writers[who].append(rec)


@pytest.fixture
def make_trace(tmp_path):
    """``make_trace(ranks=4, steps=20, fault=Fault(...), audit_every=None, weights_every=1)`` -> trace dir."""
    counter = iter(range(1_000_000))

    def _make(**kwargs):
        return write_trace(tmp_path / f"trace{next(counter)}", **kwargs)

    return _make


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """``demo_run(spec, steps=6, checkpoint_every=3)`` -> output dir of a real 4-process demo run, made once per session."""
    from sdc_forensics.demo.run import run_demo

    cache: dict[tuple, object] = {}

    def _run(spec: str | tuple[str, ...], steps: int = 6, checkpoint_every: int = 3, **options):
        key = (spec, steps, checkpoint_every, tuple(sorted(options.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("demo")
            run_demo(out, injections=(spec,) if isinstance(spec, str) else spec, steps=steps, checkpoint_every=checkpoint_every, **options)
            cache[key] = out
        return cache[key]

    return _run
