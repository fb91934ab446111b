"""Synthetic traces for tests, benchmarks and drills, written in bulk (numpy only).

:func:`write_synthetic_trace` produces a valid trace directory with ``num_ranks`` ranks and
``num_steps`` steps whose fingerprints are consistent the way a healthy DDP run's are (equal
reduced and weights digests across ranks, reduced sketch = mean of local sketches), with
optional faults planted at chosen (step, rank) cells.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import numpy as np

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.trace import format as F
from sdc_forensics.trace.manifest import (
    MANIFEST_NAME,
    Attempt,
    FingerprintSettings,
    Manifest,
    RankIdentity,
    write_manifest,
)
from sdc_forensics.trace.writer import make_header, rank_file_name


#: What ``PlantedFault.kind`` may be. ``allreduce-all`` has the meaning of the injection location of
#: that name (``inject.py``): the reduced result is wrong on every rank, ``rank`` is ignored.
KINDS = ("weights", "nonfinite", "allreduce-all")
#: Old spellings still read: ``allreduce`` planted on every rank (the injection location
#: ``allreduce`` is one rank's reduced gradient).
_OLD_KINDS = {"allreduce": "allreduce-all"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlantedFault:
    """A fault to plant: ``kind`` is ``weights`` (diverged weights digest of ``rank`` from ``step``
    on), ``nonfinite`` (NaN in ``rank``'s local gradient), or ``allreduce-all`` (reduced sketch off
    on every rank: corruption inside the collective; ``allreduce`` is read as this)."""

    kind: str
    step: int
    rank: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _OLD_KINDS.get(self.kind, self.kind))
        if self.kind not in KINDS:
            raise ValueError(f"unknown planted fault kind {self.kind!r}; use one of {', '.join(KINDS)}")


def write_synthetic_trace(
    trace_dir: str | os.PathLike,
    *,
    num_ranks: int = 4,
    num_steps: int = 20,
    sketch_k: int = C.DEFAULT_SKETCH_K,
    faults: tuple[PlantedFault, ...] = (),
    attempt: int = 0,
    start_step: int = 0,
    chunk_steps: int = 2048,
    seed: int = 0,
) -> Path:
    """Write (or add an attempt to) a synthetic trace; returns the directory."""
    trace_dir = Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + attempt)
    manifest_attempts = []
    manifest_path = trace_dir / MANIFEST_NAME
    if manifest_path.exists():
        from sdc_forensics.trace.manifest import read_manifest

        manifest_attempts = list(read_manifest(trace_dir).attempts)
    ranks = tuple(
        RankIdentity(
            rank=r, host=f"node{r // 8:03d}", node_rank=r // 8, local_rank=r % 8, gpu_uuid=f"GPU-synthetic-{r:04d}"
        )
        for r in range(num_ranks)
    )
    manifest_attempts.append(
        Attempt(
            attempt=attempt, start_step=start_step, started_ns=time.time_ns(), torch_version="synthetic", ranks=ranks
        )
    )
    write_manifest(
        trace_dir,
        Manifest(
            format_version=F.FORMAT_VERSION,
            world_size=num_ranks,
            fingerprint=FingerprintSettings(seed=C.DEFAULT_SEED, sketch_k=sketch_k),
            node_of_rank=tuple(r // 8 for r in range(num_ranks)),
            attempts=tuple(manifest_attempts),
        ),
    )
    dtype = F.record_dtype(sketch_k)
    files = []
    for rank in range(num_ranks):
        handle = open(trace_dir / rank_file_name(rank, attempt), "xb")
        handle.write(
            make_header(
                rank=rank, attempt=attempt, world_size=num_ranks, sketch_k=sketch_k, seed=C.DEFAULT_SEED
            ).tobytes()
        )
        files.append(handle)
    try:
        for lo in range(start_step, start_step + num_steps, chunk_steps):
            hi = min(lo + chunk_steps, start_step + num_steps)
            steps = np.arange(lo, hi, dtype=np.int64)
            # (S, R, k)
            local = rng.standard_normal((len(steps), num_ranks, sketch_k)).astype(np.float32)
            # (S, k)
            reduced = local.astype(np.float64).mean(axis=1).astype(np.float32)
            # (S,)
            weights = C.splitmix64(steps.astype(np.uint64) + np.uint64(0xABC))
            reduced_digest = C.splitmix64(steps.astype(np.uint64) + np.uint64(0xDEF))
            for rank, handle in enumerate(files):
                recs = np.zeros(len(steps), dtype=dtype)
                recs["magic"] = F.RECORD_MAGIC
                recs["kind"] = int(F.Kind.STEP)
                recs["flags"] = int(F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_WEIGHTS | F.Flag.HAS_GRADS)
                recs["step"] = steps
                recs["rank"] = rank
                recs["attempt"] = attempt
                recs["time_ns"] = steps * 1_000_000
                recs["loss"] = 2.0 / (1.0 + steps * 0.01) + rng.normal(0, 0.01, len(steps))
                recs["microbatch_first"] = steps * num_ranks + rank
                recs["microbatch_count"] = 1
                recs["local_digest"] = C.splitmix64(steps.astype(np.uint64) * np.uint64(1000) + np.uint64(rank))
                recs["reduced_digest"] = reduced_digest
                recs["weights_digest"] = weights
                recs["local_norm"] = np.linalg.norm(local[:, rank], axis=1)
                recs["reduced_norm"] = np.linalg.norm(reduced, axis=1)
                recs["weights_norm"] = 10.0
                recs["aux_rank"] = -1
                recs["local_sketch"] = local[:, rank]
                recs["reduced_sketch"] = reduced
                for fault in faults:
                    _plant(recs, fault, rank, steps)
                handle.write(F.seal(recs).tobytes())
    finally:
        for handle in files:
            handle.close()
    return trace_dir


def _plant(recs: np.ndarray, fault: PlantedFault, rank: int, steps: np.ndarray) -> None:
    if fault.kind == "weights" and rank == fault.rank:
        hit = steps >= fault.step
        recs["weights_digest"][hit] ^= np.uint64(0x1)
    elif fault.kind == "nonfinite" and rank == fault.rank:
        hit = steps == fault.step
        recs["nonfinite_local"][hit] = 1
        recs["local_norm"][hit] = np.nan
    elif fault.kind == "allreduce-all":
        hit = steps == fault.step
        recs["reduced_sketch"][hit, 0] += 1000.0
