"""The pipeline-parallel layout: ``PipelineStage`` x FSDP2 on a 2-D ``(pp, dp)`` mesh.

torchtitan's composition: the whole model is cut into stages (each a copy of the model with the
other stages' layers deleted, so every parameter keeps its name in the whole model), each rank
runs one stage, ``fully_shard(..., mesh=mesh["dp"])`` shards it over the data-parallel dimension,
and a schedule (``ScheduleGPipe``, ``Schedule1F1B``) runs the step's microbatches through the
stages. ``Recorder(trace_dir, schedule, optimizer)`` (the schedule, not the stage's module: it
holds the microbatch count and whether it scales the gradients) records it through this layout,
which is :class:`~sdc_forensics.recorder.tp_layout.TpLayout` (FSDP's reduce-scatter tap, its
checks, the rest check, the failure exchange, checkpoints by DCP, the rank's part of every
parameter placed by global element index) with what the pipeline changes:

* **The trace's parameters are the whole model's.** At attach every rank learns every stage's
  parameters (names, shapes; one gather); the whole model's order is stage 0's, then stage 1's,
  and so on, which is the order of the model the stages were cut from (the replay's recipe builds
  that whole model and checks the names). A rank's local gradient, reduced gradient and weights
  are its stage's parameters (its FSDP2 rows of them) placed at their index in the whole model's
  flat vector, so the ranks' pieces combine to the whole model's digests.
* **What the schedule does.** The stage's gradient accumulates over the step's microbatches (the
  schedule's backwards, in microbatch order, with FSDP2's gradient sync off), is reduce-scattered
  once over the stage's data-parallel ranks, then divided by the microbatch count
  (``PipelineStage.scale_grads``; ``grad_divisor`` in the mesh). The recorder reads the local
  gradient at the reduce-scatter and the reduced one right after it, before that division, as for
  FSDP; the replay divides as the schedule did.
* **Who is compared with whom.** The reduce-scatter is checked within each stage's
  data-parallel group; no two ranks hold the same part (a pure FSDP stage), so no weights vote;
  the gathered-parameters vote is not run (the stages gather different parameters); a suspect is
  named with its mesh coordinates (``pp=1, dp=0``).
* **Refused, in one line, before anything is written**: a ``PipelineStage`` or a module of one
  handed alone (the schedule is needed), a schedule with several stages per rank
  (``ScheduleInterleaved1F1B``) or one the recorder does not know, a stage not sharded by
  ``fully_shard`` over the mesh's ``dp`` dimension, a mesh other than ``(pp, dp)`` over the world
  (tensor, context or expert parallelism with PP, HSDP with PP), a parameter name held by two
  stages (tied across stages), a 0-d parameter, audits, mixed precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checkpointing import Saver
from sdc_forensics.recorder.fsdp_layout import FsdpLayout, is_fully_sharded
from sdc_forensics.recorder.layout import Job
from sdc_forensics.recorder.tp_checkpoint import TpSaver
from sdc_forensics.recorder.tp_layout import TpLayout, mesh_names, tp_mesh_of, tp_mesh_refusal
from sdc_forensics.trace.mesh import ShardMesh

#: the schedules whose backwards run each stage's microbatches in order, one stage per rank
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
PP_NAMES = (("pp", "dp"), ("pp", "dp_shard"), ("pp", "dp", "tp"), ("pp", "dp_shard", "tp"))


def is_pipeline(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.pipelining`` object (a schedule or a stage)."""
    return any(c.__module__.startswith("torch.distributed.pipelining") for c in type(obj).__mro__)


def stage_of(schedule: Any) -> tuple[Any, int]:
    """``(stage, what the schedule divides the reduced gradient by)`` of a one-stage schedule;
    raises ``UsageError`` (one line) for what is not recorded."""
    name = type(schedule).__name__
    if hasattr(schedule, "submod") and not hasattr(schedule, "_n_microbatches"):
        raise UsageError(
            f"a {name} alone: pass the pipeline schedule (ScheduleGPipe or Schedule1F1B) to the Recorder, which "
            "holds the stage, the microbatch count and whether it scales the gradients"
        )
    if hasattr(schedule, "_stages") and not hasattr(schedule, "_stage"):
        raise UsageError(
            f"{name} runs several stages per rank: not recorded yet; the recorder records one stage per rank "
            f"({', '.join(SCHEDULES)})"
        )
    if name not in SCHEDULES:
        raise UsageError(
            f"the pipeline schedule {name} is not recorded; the recorder records {', '.join(SCHEDULES)}, whose "
            "backwards accumulate each stage's microbatches in order"
        )
    stage = schedule._stage
    microbatches = int(schedule._n_microbatches)
    if not is_fully_sharded(stage.submod):
        raise UsageError(
            "the pipeline stage's module is not sharded by fully_shard: the recorder records each stage "
            "fully_shard-ed over the mesh's dp dimension (fully_shard(stage_module, mesh=mesh['dp']))"
        )
    return stage, (microbatches if getattr(schedule, "scale_grads", True) else 1)


def pp_mesh_refusal(params: list[torch.Tensor], world_size: int) -> str | None:
    """What is wrong with the mesh a stage's parameters lie on (None: a ``(pp, dp)`` mesh over the world)."""
    placed = [p for p in params if hasattr(p, "device_mesh")]
    if not placed or len(placed) != len(params):
        return "some of the stage's parameters are not DTensors: fully_shard the stage's module over mesh['dp']"
    names = mesh_names(placed[0].device_mesh)
    if names not in PP_NAMES:
        return (
            f"a pipeline job on a mesh of dimensions {names or 'without names'}: the recorder records pipeline "
            "parallelism on a mesh named (pp, dp) or (pp, dp, tp), each stage fully_shard-ed over mesh['dp'] "
            "(after TP on mesh['tp']); context or expert parallelism, and HSDP, with PP are not recorded yet"
        )
    root = placed[0].device_mesh._get_root_mesh()
    if root.mesh.numel() != world_size:
        return f"the (pp, dp) mesh holds {root.mesh.numel()} ranks in a job of {world_size}: it must be the world"
    if any(p.dim() == 0 for p in params):
        return "a 0-d parameter in a pipeline stage: not recorded yet"
    if "tp" in names:
        # the TP layout's own checks of the placements, on the stage's (dp, tp) sub-mesh
        return tp_mesh_refusal(params, params[0].device_mesh.mesh.numel(), pipeline=True)
    return None


class PpLayout(TpLayout):
    """PipelineStage x FSDP2 (see the module); built by ``recorder.make_layout`` for a pipeline schedule."""

    def __init__(self, schedule: Any, comm_hook: Any = None, comm_state: Any = None) -> None:
        stage, self._divisor = stage_of(schedule)
        super().__init__(stage.submod, comm_hook, comm_state)
        self.schedule = schedule
        self._whole_buckets: list[list[int]] = []
        self._stage_ranks: tuple[int, ...] = ()

    def validate(self, job: Job) -> str | None:
        problem = pp_mesh_refusal(job.params, job.world_size)
        if problem:
            return problem
        problem = FsdpLayout.validate(self, job)
        if problem:
            return problem
        if self._fallback:
            return (
                "this torch's FSDP2 has no set_custom_reduce_scatter: the recorder reads a stage's local gradient there"
            )
        if job.options.audit_every or job.options.audit_steps:
            return (
                "audits recompute a rank's microbatches on a whole model, which a pipeline stage is not: record a "
                "pipeline job without audit_every (the replay recomputes every rank)"
            )
        if self._mixed() or self._param_dtype is not None:
            return "mixed precision (MixedPrecisionPolicy) with pipeline parallelism: not recorded yet"
        return None

    def _place(self, job: Job) -> tuple[ShardMesh, list[int]]:
        """Every stage's parameters, gathered once: the whole model's order, this stage's place in it."""
        device_mesh = job.params[0].device_mesh._get_root_mesh()
        names = tuple(device_mesh.mesh_dim_names)
        layout = device_mesh.mesh.cpu()
        coords: list = [None] * job.world_size
        for index in np.ndindex(*layout.shape):
            coords[int(layout[index])] = tuple(int(i) for i in index)
        # with TP: the dimension TP cuts each of this stage's parameters on (-1: replicated)
        cuts = (
            tp_mesh_of(job.params, job.params[0].device_mesh.mesh.numel(), pipeline=True).tp_shards
            if "tp" in names
            else (-1,) * len(job.params)
        )
        mine = [
            (name, tuple(p.shape), bool(p.requires_grad), cut)
            for (name, p), cut in zip(self.model.named_parameters(), cuts)
        ]
        trainable = {id(p): i for i, p in enumerate(self.grad_params)}
        groups = [
            [trainable[id(fp.sharded_param)] for fp in g.fsdp_params if id(fp.sharded_param) in trainable]
            for g in fm.param_groups(self.model)
        ]
        everyone: list = [None] * job.world_size
        dist.all_gather_object(everyone, (mine, groups))
        # one rank per stage (its data-parallel coordinate 0), in stage order
        stages, shard = names.index("pp"), 1
        tp = names.index("tp") if "tp" in names else -1
        first = {
            coords[r][stages]: r
            for r in range(job.world_size)
            if coords[r][shard] == 0 and (tp < 0 or coords[r][tp] == 0)
        }
        self._stage_ranks = tuple(first[s] for s in sorted(first))
        for r in range(job.world_size):
            if everyone[r][0] != everyone[first[coords[r][stages]]][0]:
                raise UsageError(
                    f"rank {r} holds other parameters than the other ranks of pipeline stage {coords[r][stages]}: "
                    "every rank of a stage must hold the same stage"
                )
        whole, stage_of_param, whole_groups, seen = [], [], [], set()
        index_base, grad_base = {}, {}
        for s, rank in enumerate(self._stage_ranks):
            params, stage_groups = everyone[rank]
            index_base[s], grad_base[s] = len(whole), sum(1 for _, _, g, _ in whole if g)
            for name, *_ in params:
                if name in seen:
                    raise UsageError(
                        f"parameter {name!r} is held by two pipeline stages (tied across stages): not recorded yet"
                    )
                seen.add(name)
            whole += params
            stage_of_param += [s] * len(params)
            whole_groups += [tuple(grad_base[s] + i for i in g) for g in stage_groups if g]
        me = coords[job.rank][stages]

        def offsets(params, base_params, selected):
            before = sum(int(np.prod(shape)) for _, shape, grad, _ in base_params if selected(grad))
            out, at = {}, before
            for p in params:
                out[id(p)] = at
                at += p.numel()
            return out

        earlier = whole[: index_base[me]]
        self._grad_offsets = offsets(self.grad_params, earlier, bool)
        self._weight_offsets = offsets(job.params, earlier, lambda grad: True)
        self._whole_buckets = [[i for i, (_, _, grad, _) in enumerate(whole) if grad]]
        mesh = ShardMesh(
            kind="pp",
            shape=tuple(layout.shape),
            dim_names=names,
            shard_dim=shard,
            coords=tuple(coords),
            groups=tuple(whole_groups),
            pp_dim=stages,
            stages=tuple(stage_of_param),
            grad_divisor=self._divisor,
            tp_dim=tp,
            tp_shards=tuple(cut for *_, cut in whole) if tp >= 0 else (),
        )
        return mesh, [index_base[me] + i for i in range(len(job.params))]

    @property
    def mesh(self):
        return self._mesh

    def buckets(self) -> list[list[int]]:
        """One bucket: every trainable parameter of the whole model (the trace's indices), in order."""
        return self._whole_buckets

    def saver(self) -> Saver:
        return TpSaver(self._mesh.same_shard(), stage_ranks=self._stage_ranks)
