"""The tensor-parallel layout: TP (with sequence parallel) x FSDP2 on a 2-D ``(dp, tp)`` mesh.

torchtitan's composition: ``parallelize_module(model, mesh["tp"], plan)`` (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``), then ``fully_shard(...,
mesh=mesh["dp"])``: every parameter is a DTensor on the 2-D mesh, cut by TP on ``tp`` (rows for
``Shard(0)``, columns for row-parallel ``Shard(1)``, whole where replicated) and by FSDP2 into
rows of that slice on ``dp``. ``Recorder(trace_dir, model, optimizer)`` records it through this
layout, which is :class:`~sdc_forensics.recorder.fsdp_layout.FsdpLayout` (the reduce-scatter tap,
its checks, the rest check, the failure exchange, checkpoints by DCP) with what TP changes:

* **Where a rank's elements sit.** A rank holds a *box* of each parameter
  (``ShardMesh.rank_box``: TP's slice, then FSDP's rows of it), not one run of it: a row-parallel
  block is one run per row (``fingerprint/shards.box_runs``). Its local gradient is TP's slice
  of the gradient its data-parallel microbatches give (``ShardMesh.tp_box``, read from the
  reduce-scatter input as FSDP's tap reads it), its reduced gradient and weights its box; every
  piece is placed by (parameter, global element index), so the ranks' pieces combine across
  TP and DP shards, and a replay recomputes them from a whole model.
* **Who is compared with whom.** The reduce-scatter is checked within each DP group (ranks of one
  TP coordinate), as FSDP's is; the ranks that hold the same box (``ShardMesh.same_shard``:
  equal DP-shard and TP coordinates) vote; a suspect is named with its mesh coordinates
  (``dp=1, tp=0``). The vote of the parameters every rank gathered (pure FSDP's consensus) is
  not run: ranks of different TP coordinates gather different slices.
* **HSDP x TP** on torchtitan's ``(dp_replicate, dp_shard, tp)`` mesh (``fully_shard`` over
  ``mesh["dp_replicate", "dp_shard"]``): the same boxes (the shard coordinate's rows of the TP
  slice), the reduce-scatter checked within each replica, HSDP's all-reduce across the replicas
  (FSDP's checks; redone in replica order with the ordered reduction), and the replicas of a box
  vote on its weights.
* **What is refused, in one line, before anything is written**: a mesh other than ``(dp, tp)``
  or ``(dp_replicate, dp_shard, tp)`` covering the world (context, expert or pipeline parallel
  dimensions, an unknown dimension name), also where the parameters sit on a
  sub-mesh of such a mesh (its root's dimensions are read: FSDP2 over ``mesh["dp"]`` of a
  ``(pp, dp)`` mesh is a pipeline job), TP's uneven split of a parameter, a placement other than
  TP's ``Shard(0)``/``Shard(1)``/``Replicate`` and FSDP's dim-0 shard, audits (their
  recomputation on a whole model is not bitwise TP's), mixed precision, and a torch without
  FSDP2's custom reduce-scatter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import shards
from sdc_forensics.recorder import fsdp_gathered
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checkpointing import Saver
from sdc_forensics.recorder.fsdp_checks import rank_place
from sdc_forensics.recorder.fsdp_layout import FsdpLayout, _fsdp_modules
from sdc_forensics.recorder.fsdp_tap import OrderedReduceScatter, ReduceScatterTap, flat_offsets
from sdc_forensics.recorder.layout import Job, local_tensor
from sdc_forensics.recorder.options import Reduction
from sdc_forensics.recorder.tp_checkpoint import TpSaver
from sdc_forensics.trace.mesh import ShardMesh

#: mesh dimension names the layout knows: FSDP's data-parallel one, HSDP's replicas (torchtitan's
#: names), and TP's
DP_NAMES = ("dp", "dp_shard")
REPLICATE_NAMES = ("dp_replicate",)
TP_NAMES = ("tp",)
#: dimension names of what is not built (said in the refusal)
_NOT_BUILT = {
    "cp": "context parallelism",
    "ep": "expert parallelism",
    "pp": "pipeline parallelism",
}


def not_recorded(model: Any) -> str:
    """What ``recorder.make_layout`` says of an object no layout records: that it wants the DDP or
    ``fully_shard`` model (or a pipeline schedule: ``pp_layout.py``); of a tensor-parallel model
    without ``fully_shard``, that it wants ``fully_shard`` over the mesh's dp dimension."""
    if is_tensor_parallel(model):
        return (
            "a tensor-parallel model without fully_shard is not recorded: apply fully_shard over mesh['dp'] after "
            "TP, on a (dp, tp) mesh (dp may be 1), as docs/recorder.md shows"
        )
    return (
        "Recorder needs the DistributedDataParallel-wrapped model, a model sharded by fully_shard, or a pipeline "
        "schedule (got a bare module?)"
    )


def mesh_names(mesh: Any) -> tuple[str, ...]:
    """The dimension names of ``mesh``'s root mesh (a sub-mesh such as ``mesh["dp"]`` keeps its root's
    other dimensions there), else its own."""
    root = getattr(mesh, "_get_root_mesh", None)
    root = root() if root is not None else None
    return tuple((root if root is not None else mesh).mesh_dim_names or ())


def is_tensor_parallel(model: Any) -> bool:
    """Whether ``model``'s parameters are DTensors on a mesh (or a sub-mesh of one) with a dimension
    named ``tp`` (or another model-parallel name this layout refuses in one line)."""
    for p in model.parameters() if isinstance(model, torch.nn.Module) else ():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            # HSDP's dp_replicate alone is FsdpLayout's; with tp, this layout's
            return any(n in TP_NAMES or n in _NOT_BUILT for n in mesh_names(mesh))
    return False


def tp_mesh_of(params: list[torch.Tensor], world_size: int, pipeline: bool = False) -> ShardMesh:
    """The ``(dp, tp)`` (or HSDP's ``(dp_replicate, dp_shard, tp)``) mesh the parameters are placed
    on, with every rank's coordinates and each parameter's TP cut; raises ``UsageError`` (one line)
    for what is not recorded. ``pipeline``: the mesh is a pipeline stage's ``(dp, tp)`` (or
    ``(dp_replicate, dp_shard, tp)``) sub-mesh
    (``pp_layout.py``), of ``world_size`` ranks."""
    placed = [p for p in params if hasattr(p, "device_mesh")]
    if len(placed) != len(params):
        raise UsageError("some parameters are not DTensors: fully_shard every module over the mesh's dp dimension")
    # the TP mesh where some parameters are on it (others left out of the TP plan are refused below)
    tp_placed = [p for p in placed if any(n in TP_NAMES for n in (p.device_mesh.mesh_dim_names or ()))]
    mesh = (tp_placed or placed)[0].device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    # the root's dimensions too: a pipeline or context dimension the parameters' sub-mesh leaves out
    other = [n for n in mesh_names(mesh) + names if n in _NOT_BUILT and not (pipeline and n == "pp")]
    if "pp" in other:
        raise UsageError(
            "a pipeline stage's module (mesh dimension 'pp'): pass the pipeline schedule to the Recorder "
            "(Recorder(trace_dir, schedule, optimizer)), which holds the stage, its microbatches and their scaling"
        )
    if other:
        raise UsageError(
            f"mesh dimension {other[0]!r} ({_NOT_BUILT[other[0]]}): not recorded yet; the recorder records "
            "tensor parallel x FSDP2 on a (dp, tp) mesh"
        )
    hsdp = len(names) == 3 and names[0] in REPLICATE_NAMES
    if len(names) != 2 + hsdp or names[-1] not in TP_NAMES or names[-2] not in DP_NAMES:
        raise UsageError(
            f"a mesh of dimensions {names or 'without names'}: the recorder records tensor parallelism on a mesh "
            "named (dp, tp) (or (dp_shard, tp)), or HSDP's (dp_replicate, dp_shard, tp), TP applied first, then "
            "fully_shard over mesh['dp'] (HSDP: mesh['dp_replicate', 'dp_shard'])"
        )
    if tp_placed and len(tp_placed) != len(placed):
        # e.g. embeddings and norms left out of the TP plan (no sequence parallel), then fully_shard-ed over dp only
        on_tp = {id(p) for p in tp_placed}
        first = next(i for i, p in enumerate(params) if id(p) not in on_tp)
        raise UsageError(
            f"parameter {first} is on a mesh without 'tp' ({tuple(params[first].device_mesh.mesh_dim_names or ())}) while "
            f"others are on {tuple(tp_placed[0].device_mesh.mesh_dim_names or ())}: every parameter must be in the TP "
            "plan (embeddings and norms too: SequenceParallel or a replicated plan), then fully_shard over mesh['dp']"
        )
    layout = mesh.mesh.cpu()
    if layout.numel() != world_size:
        raise UsageError(
            f"the {names} mesh holds {layout.numel()} ranks in a job of {world_size}: it must be the world"
        )
    cuts = []
    for i, p in enumerate(params):
        if p.device_mesh != mesh:
            raise UsageError(f"parameter {i} lives on another mesh: the recorder needs one {names} mesh")
        *replicated, dp, tp = tuple(p.placements)
        cut = getattr(tp, "dim", None)
        # FSDP2's dim-0 shard of TP's slice (_StridedShard(0) where TP cut dim 0 too); HSDP's Replicate
        if (
            getattr(dp, "dim", None) != 0
            or (cut is None and not tp.is_replicate())
            or not all(r.is_replicate() for r in replicated)
        ):
            raise UsageError(
                f"parameter {i} placed as {tuple(p.placements)}: the recorder records FSDP2's dim-0 shard on dp "
                "(HSDP's Replicate on dp_replicate) and TP's Shard(0), Shard(1) or Replicate on tp"
            )
        if cut is not None and p.shape[cut] % layout.shape[-1]:
            raise UsageError(
                f"parameter {i} of shape {tuple(p.shape)} is cut unevenly by TP on dim {cut} ({layout.shape[-1]} "
                "ranks): the recorder records even TP splits"
            )
        cuts.append(-1 if cut is None else int(cut))
    coords: list = [None] * world_size
    for position, index in enumerate(np.ndindex(*layout.shape)):
        # a stage's sub-mesh holds global ranks beyond its size: its own positions then
        coords[position if pipeline else int(layout[index])] = tuple(int(i) for i in index)
    return ShardMesh(
        kind="tp",
        shape=tuple(layout.shape),
        dim_names=names,
        shard_dim=len(names) - 2,
        coords=tuple(coords),
        tp_dim=len(names) - 1,
        tp_shards=tuple(cuts),
    )


def tp_mesh_refusal(params: list[torch.Tensor], world_size: int, pipeline: bool = False) -> str | None:
    """:func:`tp_mesh_of`'s refusal line (None where it records the mesh)."""
    try:
        tp_mesh_of(params, world_size, pipeline)
    except UsageError as exc:
        return str(exc)
    return None


class TpReduceScatterTap(ReduceScatterTap):
    """FSDP's tap, reading each reduce-scatter input as TP's slice of the local gradient: each
    parameter's rows (the whole TP slice) placed by its box runs in the whole parameter."""

    def __init__(self, *, tp_runs: dict[int, list[tuple[int, int, int]]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tp_runs = tp_runs

    def _add_input(self, flat: torch.Tensor, size: int, param_group) -> None:
        runs = []
        for param, whole in self._input_wholes(flat, size, param_group):
            values, offset = whole.reshape(-1), self._offsets[id(param)]
            # shards.box_pieces' pieces, as runs: each box run at its place in the whole parameter
            runs += [
                (values[start : start + length], offset + place) for start, length, place in self._tp_runs[id(param)]
            ]
        self.local_runs.add(runs)


class TpLayout(FsdpLayout):
    """TP x FSDP2 (see the module); built by ``recorder.make_layout`` for a model whose mesh has a ``tp`` dimension."""

    def validate(self, job: Job) -> str | None:
        names = mesh_names(job.params[0].device_mesh) if job.params else ()
        if any(n in _NOT_BUILT for n in names):
            return tp_mesh_refusal(job.params, job.world_size)
        problem = super().validate(job)
        if problem:
            return problem
        options = job.options
        if self._fallback:
            return "this torch's FSDP2 has no set_custom_reduce_scatter: the recorder reads a TP job's local gradient there"
        if options.audit_every or options.audit_steps:
            return (
                "audits recompute a rank's microbatches on a whole model, which does not add TP's partial sums as the "
                "job does: record a tensor-parallel job without audit_every (the replay compares it)"
            )
        if self._mixed() or self._param_dtype is not None:
            return "mixed precision (MixedPrecisionPolicy) with tensor parallelism: not recorded yet"
        return tp_mesh_refusal(job.params, job.world_size)

    def _place(self, job: Job) -> tuple[ShardMesh, list[int]]:
        """The mesh, and each of ``job.params``' index among the trace's parameters (here: its own);
        sets the flat offsets of the gradient and the weights (``_grad_offsets``, ``_weight_offsets``)."""
        mesh = tp_mesh_of(job.params, job.world_size)
        index = {id(p): i for i, p in enumerate(self.grad_params)}
        groups = tuple(
            tuple(index[id(fp.sharded_param)] for fp in g.fsdp_params if id(fp.sharded_param) in index)
            for g in fm.param_groups(self.model)
        )
        # the replay reads the groups only to model gloo's reduce-scatter of whole parameters, which TP's slices are not
        self._groups = tuple(g for g in groups if g)
        self._grad_offsets = flat_offsets(self.grad_params)
        self._weight_offsets = flat_offsets(job.params)
        return mesh, list(range(len(job.params)))

    def install(self, job: Job) -> None:
        self.job = job
        options, model = job.options, self.model
        self.grad_params = [p for p in job.params if p.requires_grad]
        mesh, indices = self._place(job)
        self._mesh = mesh
        # per parameter: this rank's box runs (weights, reduced gradient) and its TP slice's (local gradient)
        self._runs, tp_runs = {}, {}
        for i, p in zip(indices, job.params):
            shape = tuple(p.shape)
            box, at = mesh.rank_box(job.rank, i, shape)
            if tuple(local_tensor(p).shape) != box:
                raise UsageError(
                    f"parameter {i} of shape {shape}: this rank holds {tuple(local_tensor(p).shape)} elements where "
                    f"TP's then FSDP's cut gives {box}: a placement the recorder cannot place"
                )
            self._runs[id(p)] = shards.box_runs(shape, box, at)
            tp_runs[id(p)] = shards.box_runs(shape, *mesh.tp_box(job.rank, i, shape))
        ordered = options.reduction == Reduction.ORDERED
        self.tap = TpReduceScatterTap(
            tp_runs=tp_runs,
            offsets=self._grad_offsets,
            sketch_k=options.sketch_k,
            seed=options.seed,
            start_step=options.start_step,
            # HSDP x TP, ordered: the replicas' all-reduce redone in replica order, as FSDP's HSDP
            ordered_replicas=ordered and len(mesh.replicas()) > 1,
        )
        self.tap.place = rank_place(model)
        specs = list(getattr(job.injector, "specs", ()))
        # all-reduce-output: HSDP's replica all-reduce (none without dp_replicate)
        tp_specs = [
            str(s) for s in specs if s.location in ("local-gradient", "reduce-scatter-output", "all-reduce-output")
        ]
        if tp_specs:
            self.tap._inject = fm.spec_injector(tp_specs, lambda: self.tap.step)
        gathered = [s for s in specs if s.location == "all-gather-output"]
        if gathered:
            self._handles += fsdp_gathered.drill(_fsdp_modules(model), job, gathered)
        self._follow_backward()
        fm.install(model, self.tap, OrderedReduceScatter() if ordered else None)

    @property
    def mesh(self):
        return dataclasses.replace(self._mesh, groups=()) if self._mesh is not None else None

    def _box_fp(self, tensors: list[tuple[torch.Tensor, int]], k: int):
        """The fingerprint of this rank's boxes of ``(tensor, its offset in the flat vector)``."""
        runs = []
        for tensor, param, offset in tensors:
            flat = local_tensor(tensor).detach().reshape(-1)
            runs += [(flat[s : s + n], offset + place) for s, n, place in self._runs[id(param)]]
        return shards.fingerprint_runs(runs, k=k, seed=self.job.options.seed)

    def _reduced_shard(self):
        grads = [(p.grad, p, self._grad_offsets[id(p)]) for p in self.grad_params if p.grad is not None]
        if len(grads) != len(self.grad_params):
            return None
        return self._box_fp(grads, self.job.options.sketch_k)

    def weights(self) -> tuple[int, float, int]:
        with torch.no_grad():
            fp = self._box_fp([(p, p, self._weight_offsets[id(p)]) for p in self.job.params], 1)
        return fp.digest, float(fp.norm), int(fp.nonfinite)

    def words(self, state) -> np.ndarray:
        """``[its box changed at rest (0/1), 0]``: no gathered vote across TP coordinates."""
        words = super().words(state)
        words[1] = 0
        return words

    def saver(self) -> Saver:
        return TpSaver(self._mesh.same_shard())
