"""The one-process replay of a tensor-parallel job (``recorder/tp_layout.py``), within tolerance.

The recipe's whole, unsharded model recomputes each data-parallel rank's step, as for FSDP
(``replayer.Replayer``); what differs is what each rank recorded: its local gradient is TP's
slice of the whole (``ShardMesh.tp_box``), its reduced gradient and weights its box
(``ShardMesh.rank_box``), each fingerprinted at (parameter, global element index), so the
replay fingerprints the same elements of its whole tensors.

**Why tolerant.** A TP rank computes with TP's partial sums: a row-parallel layer's output is the
sum of the ranks' partial products (an all-reduce, or sequence parallel's reduce-scatter), a
column-parallel layer's input gradient likewise, and every later number inherits their
rounding; the whole model adds the same products in one matmul's order. Measured on the demo's
transformer (``tests/replay/test_tp_replay.py``): the local gradients differ from the whole
model's in the last bits, never bit for bit. So every step is compared within the sketch
tolerance (``fingerprint/tolerance.py``, graded by ``replay/compare.grade``), the weights after
the update are not compared bit for bit, and the coverage says "tolerant replay". A bit flip
that moves a gradient far beyond rounding is strong evidence; one in the low mantissa bits is
below the tolerance by design and only the exact replay sees it: ``replay/tp_exact.py``, the
job's TP plan under ``torchrun --nproc-per-node TP`` (``replay/window.py`` chooses it when the
processes and the recipe's ``parallelize`` hook are there), which certifies.
"""

from __future__ import annotations

import dataclasses

from sdc_forensics.fingerprint import shards
from sdc_forensics.fingerprint.core import Fingerprint
from sdc_forensics.replay.replayer import Replayer, ReplayResult, _RankStep

NOTE = (
    "tensor parallel: the one-process replay adds what TP's ranks added in partial sums in one matmul's order, "
    "so every step is compared within the sketch tolerance (weights after the update not bit for bit); "
    "the exact replay, which certifies: torchrun --nproc-per-node TP with a recipe that has parallelize(model, tp_mesh)"
)


def is_tp(trace) -> bool:
    """Whether the trace is a tensor-parallel job's (its manifest's mesh notes a ``tp`` dimension)."""
    mesh = trace.manifest.parallel
    return mesh is not None and mesh.tp_dim >= 0


class _TpRankStep(_RankStep):
    """A rank's recomputed step whose fingerprint is TP's slice of the whole local gradient."""

    def __init__(self, replayer: TpReplayer, rank: int, step: _RankStep) -> None:
        super().__init__(replayer, step.buckets, step._batches, step.loss)
        self.rng_dependent = step.rng_dependent
        self._rank = rank

    @property
    def fp(self) -> Fingerprint:
        if self._fp is None:
            self._fp = self._replayer.tp_local_fp(self.buckets[0], self._rank)
        return self._fp

    @property
    def digest(self) -> int:
        # the rank's boxes, never the whole bucket's digest (which no rank recorded)
        return self.fp.digest


class TpReplayer(Replayer):
    """:class:`Replayer` comparing each rank's TP boxes (see the module)."""

    # the bucket's parameter indices and shapes (one bucket: every trainable parameter, in order)
    _layout: tuple[int, ...] = ()
    _shapes: tuple[tuple[int, ...], ...] = ()

    def run(self, options, on_step=None) -> ReplayResult:
        result = super().run(dataclasses.replace(options, force_tolerant=True), on_step)
        notes = tuple(NOTE if n.startswith("--tolerant") else n for n in result.notes)
        return dataclasses.replace(result, notes=notes)

    def local_step(self, model, record, buckets_layout, slot=None) -> _RankStep:
        params = list(model.parameters())
        self._layout = tuple(buckets_layout[0]) if buckets_layout else ()
        self._shapes = tuple(tuple(params[i].shape) for i in self._layout)
        step = super().local_step(model, record, buckets_layout, slot)
        return _TpRankStep(self, int(record["rank"]), step)

    def received(self, rank: int, step):
        """A rank's step another replay process computed (``distributed.local_steps``): fingerprinted as
        the rank recorded it, TP's slice, not the whole buckets (a trial user's clean TP trace replayed
        on 4 processes named every rank but process 0's)."""
        return dataclasses.replace(step, fp_of=lambda buckets: self.tp_local_fp(buckets[0], rank))

    def _runs(self, flat, rank: int, tp_only: bool) -> list:
        """``(values, place)`` runs of ``rank``'s boxes in the flat vector of the bucket's parameters
        (TP's slice only, or TP's then FSDP's cut)."""
        box_of = self.mesh.tp_box if tp_only else self.mesh.rank_box
        runs, offset = [], 0
        for index, shape in zip(self._layout, self._shapes):
            numel = 1
            for size in shape:
                numel *= size
            for _, length, place in shards.box_runs(shape, *box_of(rank, index, shape)):
                runs.append((flat[offset + place : offset + place + length], offset + place))
            offset += numel
        return runs

    def tp_local_fp(self, flat, rank: int) -> Fingerprint:
        """The rank's recorded local gradient: TP's slice of the whole, one bucket (``shards.one_bucket``)."""
        pieces = [
            shards.fingerprint_piece(v, offset=o, k=self.k, seed=self.seed) for v, o in self._runs(flat, rank, True)
        ]
        return shards.one_bucket(pieces)

    def _shard_fp(self, flat, shapes, rank: int, k: int):
        return shards.fingerprint_runs(self._runs(flat, rank, False), k=k, seed=self.seed)

    def _per_rank(self, of_shard) -> list:
        """Every rank its own box (ranks of different TP coordinates hold different elements)."""
        return [of_shard(r) for r in range(self.world_size)]
