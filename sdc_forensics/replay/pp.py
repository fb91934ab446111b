"""The replay of a pipeline-parallel job (``recorder/pp_layout.py``): one process, exact.

The recipe's whole model recomputes each data-parallel rank's step, as for FSDP
(``replayer.Replayer``): every microbatch forward and backward, the gradients accumulated in the
schedule's order. A pipeline hands each stage's activations (and their gradients) to the next as
they are, with no arithmetic of its own, so the whole model computes every stage's numbers, bit
for bit at the recorded thread count (``benchmarks/pp_ddp_experiment.py`` for the pipeline alone;
``tests/replay/test_pp_replay.py`` holds it on the demo's PP x FSDP2 jobs). What differs from FSDP:

* **Each rank recorded its stage's parameters only**, at their place in the whole model's flat
  vector (``ShardMesh.stages``): the replay fingerprints the same elements of its whole tensors
  (``ShardMesh.rank_box``: nothing of another stage's parameters), as the TP replay does
  (:class:`~sdc_forensics.replay.tp.TpReplayer`, whose boxes it reuses, without its tolerance).
* **The data-parallel reduction is per stage**: the ranks of one stage reduce-scatter their
  stage's gradient among themselves. Every stage's ranks compute the same whole-model gradient
  per data-parallel coordinate here, so the reduction of stage 0's ranks, in data-parallel order,
  is every stage's (each element is reduced over the same data-parallel ranks), elementwise.
* **The schedule divides** the reduced gradient by its microbatch count after the reduction
  (``grad_divisor``), which the replay does before the recipe's ``before_step``.

An interleaved schedule (several stages per rank, ``ScheduleInterleaved1F1B``) changes nothing
here: each stage's gradient still accumulates its microbatches in order and is reduced once, and
the recorder reads each stage's reduced gradient before the schedule divides it
(``recorder/pp_layout.py``); ``tests/replay/test_pp_interleaved.py`` holds it bit for bit.
"""

from __future__ import annotations

import contextlib

import numpy as np

from sdc_forensics.replay.replayer import Replayer, ReplayResult
from sdc_forensics.replay.tp import TpReplayer
from sdc_forensics.trace.mesh import ShardMesh


def is_pp(trace) -> bool:
    """Whether the trace is a pipeline-parallel job's (its manifest's mesh notes a ``pp`` dimension)."""
    mesh = trace.manifest.parallel
    return mesh is not None and mesh.pp_dim >= 0


class PpReplayer(TpReplayer):
    """:class:`TpReplayer`'s per-rank boxes, exact, with the reduction of one stage's ranks (see the module)."""

    def run(self, options, on_step=None) -> ReplayResult:
        return Replayer.run(self, options, on_step)

    def reduce(self, per_rank, order: str):
        """The data-parallel mean of stage 0's ranks (in data-parallel order), as FSDP's on a 1-D mesh
        (HSDP's on a 2-D ``(dp_replicate, dp_shard)`` one: each replica's mean, then the replicas')."""
        mesh = self.mesh
        # the dimensions that are neither the pipeline's, the shard's nor TP's: HSDP's replicas
        rep = [d for d in range(len(mesh.shape)) if d not in (mesh.pp_dim, mesh.shard_dim, mesh.tp_dim)]
        group = sorted(
            (r for r in range(self.world_size) if mesh.pp_of(r) == mesh.pp_of(0) and mesh.tp_of(r) == 0),
            key=lambda r: (*(mesh.coords[r][d] for d in rep), mesh.shard_of(r)),
        )
        flat = ShardMesh(
            kind="hsdp" if rep else "fsdp",
            shape=(*(mesh.shape[d] for d in rep), mesh.shard_size),
            dim_names=(*(mesh.dim_names[d] for d in rep), mesh.dim_names[mesh.shard_dim]),
            shard_dim=len(rep),
            coords=tuple((*(mesh.coords[r][d] for d in rep), mesh.shard_of(r)) for r in group),
            groups=mesh.groups,
        )
        with _as_mesh(self, flat):
            return super().reduce([per_rank[r] for r in group], order)

    def _expected_weights(self, model) -> np.ndarray:
        """``(R,)`` uint64: each rank's boxes of the updated weights (its stage's rows), at their place."""
        from sdc_forensics.fingerprint import shards

        params = [p.detach().reshape(-1) for p in model.parameters()]
        shapes = [tuple(p.shape) for p in model.parameters()]

        def digest(rank: int) -> int:
            runs, offset = [], 0
            for index, (flat, shape) in enumerate(zip(params, shapes)):
                for _, length, place in shards.box_runs(shape, *self.mesh.rank_box(rank, index, shape)):
                    runs.append((flat[place : place + length], offset + place))
                offset += flat.numel()
            return shards.fingerprint_runs(runs, k=1, seed=self.seed).digest

        return np.array([digest(r) for r in range(self.world_size)], dtype=np.uint64)


@contextlib.contextmanager
def _as_mesh(replayer: Replayer, mesh: ShardMesh):
    saved = replayer.mesh
    replayer.mesh = mesh
    try:
        yield
    finally:
        replayer.mesh = saved
