"""The pipeline-parallel layout: ``PipelineStage`` x FSDP2 on a 2-D ``(pp, dp)`` mesh.

torchtitan's composition: the whole model is cut into stages (each a copy of the model with the
other stages' layers deleted, so every parameter keeps its name in the whole model), each rank
runs one stage (or several: ``ScheduleInterleaved1F1B``, below), ``fully_shard(...,
mesh=mesh["dp"])`` shards each over the data-parallel dimension, and a schedule
(``ScheduleGPipe``, ``Schedule1F1B``) runs the step's microbatches through the stages.
``Recorder(trace_dir, schedule, optimizer)`` (the schedule, not the stage's module: it holds the
stages, the microbatch count and whether it scales the gradients) records it through this layout,
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
  data-parallel group; no two ranks hold the same part of a pure FSDP stage, so no weights vote
  there (PP x HSDP: the replicas of a (stage, shard) vote, and HSDP's all-reduce is checked);
  the gathered-parameters vote is not run (the stages gather different parameters); a suspect is
  named with its mesh coordinates (``pp=1, dp=0``).
* **Several stages per rank** (``ScheduleInterleaved1F1B``; stage ``s`` on pipeline coordinate
  ``s % pp``): the rank's stage modules are read as one (:class:`RankStages`), each stage's
  parameters placed at its own offset in the whole model; each stage's backwards still run its
  microbatches in order, its groups reduce-scatter once, right after its last backward, and the
  schedule then divides that stage's gradient (torch 2.13, ``docs/recorder.md``): so each stage's
  reduced gradient is read at its own end-of-backward callback (:meth:`PpLayout._after_backward`),
  before its division, and the replay is the one-stage replay. The mesh's ``stages`` notes each
  parameter's pipeline coordinate.
* **Refused, in one line, before anything is written**: a ``PipelineStage`` or a module of one
  handed alone (the schedule is needed), ``ScheduleLoopedBFS`` (its backwards run the microbatches
  last to first), the zero-bubble schedules (split weight gradients, not verified bit for bit) or a
  schedule the recorder does not know, several stages per rank with TP, a stage not sharded by
  ``fully_shard`` over the mesh's ``dp`` dimension, a mesh other than ``(pp, dp)``, ``(pp, dp, tp)``
  or HSDP's ``(pp, dp_replicate, dp_shard[, tp])`` over the world (context or expert parallelism
  with PP), a parameter name held by two
  stages (tied across stages), a 0-d parameter, audits, mixed precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import shards
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checkpointing import Saver
from sdc_forensics.recorder.fsdp_layout import FsdpLayout, is_fully_sharded
from sdc_forensics.recorder.layout import Job, local_tensor
from sdc_forensics.recorder.tp_checkpoint import TpSaver
from sdc_forensics.recorder.tp_layout import TpLayout, mesh_names, tp_mesh_of, tp_mesh_refusal
from sdc_forensics.trace.mesh import ShardMesh

#: the schedules whose backwards run each stage's microbatches in order, one stage per rank
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
#: ... and several stages per rank (torchtitan's "loop" placement: rank r holds stages r, r + pp, ...)
MULTI_SCHEDULES = ("ScheduleInterleaved1F1B",)
#: what the recorder says of the schedules it does not record (torch 2.13's order of their backwards)
_NOT_RECORDED = {
    "ScheduleLoopedBFS": "runs each stage's backwards from the last microbatch to the first, so its gradient "
    "accumulates in reverse microbatch order",
    "ScheduleInterleavedZeroBubble": "splits each microbatch's backward into input and weight gradients (zero bubble)",
    "ScheduleZBVZeroBubble": "splits each microbatch's backward into input and weight gradients (zero bubble)",
    "ScheduleDualPipeV": "splits each microbatch's backward into input and weight gradients and overlaps them",
}
PP_NAMES = (
    ("pp", "dp"),
    ("pp", "dp_shard"),
    ("pp", "dp_replicate", "dp_shard"),
    ("pp", "dp", "tp"),
    ("pp", "dp_shard", "tp"),
    ("pp", "dp_replicate", "dp_shard", "tp"),
)


def is_pipeline(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.pipelining`` object (a schedule or a stage)."""
    return any(c.__module__.startswith("torch.distributed.pipelining") for c in type(obj).__mro__)


def stages_of(schedule: Any) -> tuple[list[Any], int]:
    """``(this rank's stages in stage order, what the schedule divides each reduced gradient by)``;
    raises ``UsageError`` (one line) for what is not recorded."""
    name = type(schedule).__name__
    known = ", ".join(SCHEDULES + MULTI_SCHEDULES)
    if hasattr(schedule, "submod") and not hasattr(schedule, "_n_microbatches"):
        raise UsageError(
            f"a {name} alone: pass the pipeline schedule (ScheduleGPipe or Schedule1F1B) to the Recorder "
            "(ScheduleInterleaved1F1B for several stages per rank), which holds the stages, the microbatch count and "
            "whether it scales the gradients"
        )
    if name in _NOT_RECORDED:
        raise UsageError(
            f"{name} {_NOT_RECORDED[name]}: not recorded yet; the recorder records {known}, whose backwards "
            "accumulate each stage's microbatches in order"
        )
    if name not in SCHEDULES + MULTI_SCHEDULES:
        raise UsageError(
            f"the pipeline schedule {name} is not recorded; the recorder records {known}, whose backwards "
            "accumulate each stage's microbatches in order"
        )
    stages = [schedule._stage] if name in SCHEDULES else sorted(schedule._stages, key=lambda s: int(s.stage_index))
    microbatches = int(schedule._n_microbatches)
    if not all(is_fully_sharded(stage.submod) for stage in stages):
        raise UsageError(
            "the pipeline stage's module is not sharded by fully_shard: the recorder records each stage "
            "fully_shard-ed over the mesh's dp dimension (fully_shard(stage_module, mesh=mesh['dp']))"
        )
    return stages, (microbatches if getattr(schedule, "scale_grads", True) else 1)


class RankStages(torch.nn.Module):
    """A rank's stage modules (several under an interleaved schedule) as the one module the recorder
    reads: their parameters in stage order under their whole-model names (a stage keeps them), their
    FSDP2 modules. It holds them for the recorder only; the schedule runs each on its own."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_buffers(prefix, recurse, remove_duplicate)


def pp_mesh_refusal(params: list[torch.Tensor], world_size: int) -> str | None:
    """What is wrong with the mesh a stage's parameters lie on (None: a ``(pp, dp)`` mesh over the world)."""
    placed = [p for p in params if hasattr(p, "device_mesh")]
    if not placed or len(placed) != len(params):
        return "some of the stage's parameters are not DTensors: fully_shard the stage's module over mesh['dp']"
    names = mesh_names(placed[0].device_mesh)
    if names not in PP_NAMES:
        return (
            f"a pipeline job on a mesh of dimensions {names or 'without names'}: the recorder records pipeline "
            "parallelism on a mesh named (pp, dp) or (pp, dp, tp), or HSDP's (pp, dp_replicate, dp_shard[, tp]), "
            "each stage fully_shard-ed over mesh['dp'] (HSDP: mesh['dp_replicate', 'dp_shard']; after TP on "
            "mesh['tp']); context or expert parallelism with PP are not recorded yet"
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
        stages, self._divisor = stages_of(schedule)
        self._parts = [stage.submod for stage in stages]
        self._stage_indices = tuple(int(stage.stage_index) for stage in stages)
        super().__init__(self._parts[0] if len(self._parts) == 1 else RankStages(self._parts), comm_hook, comm_state)
        self.schedule = schedule
        self._whole_buckets: list[list[int]] = []
        # per stage of the whole model, in order: (the first rank holding it, its parameters' span there)
        self._stage_parts: tuple[tuple[int, int, int], ...] = ()
        # several stages per rank: each one's shard of the reduced gradient, read when it is reduced
        self._part_groups: list[list[Any]] = []
        self._part_pieces: dict[int, list] = {}

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
        if len(self._parts) > 1 and "tp" in mesh_names(job.params[0].device_mesh):
            return (
                "several pipeline stages per rank with tensor parallelism: not recorded yet; the recorder records "
                "an interleaved schedule on a (pp, dp) mesh, or one stage per rank on (pp, dp, tp)"
            )
        return None

    def _place(self, job: Job) -> tuple[ShardMesh, list[int]]:
        """Every stage's parameters, gathered once: the whole model's order (stage 0's, stage 1's, ...),
        and this rank's stages' places in it."""
        device_mesh = job.params[0].device_mesh._get_root_mesh()
        names = tuple(device_mesh.mesh_dim_names)
        layout = device_mesh.mesh.cpu()
        coords: list = [None] * job.world_size
        for index in np.ndindex(*layout.shape):
            coords[int(layout[index])] = tuple(int(i) for i in index)
        # with TP: the dimension TP cuts each of this rank's parameters on (-1: replicated)
        cuts = iter(
            tp_mesh_of(job.params, job.params[0].device_mesh.mesh.numel(), pipeline=True).tp_shards
            if "tp" in names
            else (-1,) * len(job.params)
        )
        trainable = {id(p): i for i, p in enumerate(self.grad_params)}
        mine = []
        for stage_index, part in zip(self._stage_indices, self._parts):
            params = [(name, tuple(p.shape), bool(p.requires_grad), next(cuts)) for name, p in part.named_parameters()]
            first = min((trainable[id(p)] for p in part.parameters() if id(p) in trainable), default=0)
            groups = [
                [trainable[id(fp.sharded_param)] - first for fp in g.fsdp_params if id(fp.sharded_param) in trainable]
                for g in fm.param_groups(part)
            ]
            mine.append((stage_index, params, groups))
        everyone: list = [None] * job.world_size
        dist.all_gather_object(everyone, mine)
        stages = names.index("pp")
        # HSDP's (pp, dp_replicate, dp_shard): the shard dimension is the last data-parallel one
        shard = names.index("dp_shard") if "dp_replicate" in names else 1
        tp = names.index("tp") if "tp" in names else -1
        # one rank per pipeline coordinate (its data-parallel, replica and TP coordinates 0)
        first = {
            coords[r][stages]: r
            for r in range(job.world_size)
            if all(c == 0 for d, c in enumerate(coords[r]) if d != stages)
        }
        for r in range(job.world_size):
            if everyone[r] != everyone[first[coords[r][stages]]]:
                raise UsageError(
                    f"rank {r} holds other parameters than the other ranks of pipeline coordinate "
                    f"{coords[r][stages]}: every rank of a stage must hold the same stages"
                )
        # stage index -> (pipeline coordinate, its first rank, parameters, groups, its span in that rank's parameters)
        held: dict[int, tuple] = {}
        for coordinate, rank in sorted(first.items()):
            at = 0
            for stage_index, params, groups in everyone[rank]:
                if stage_index in held:
                    raise UsageError(
                        f"pipeline stage {stage_index} is held by pipeline coordinates {held[stage_index][0]} and "
                        f"{coordinate}: each stage must be held by one"
                    )
                held[stage_index] = (coordinate, rank, params, groups, at, at + len(params))
                at += len(params)
        if sorted(held) != list(range(len(held))):
            raise UsageError(
                f"the pipeline's ranks hold stages {sorted(held)}: the recorder needs stages 0 to {len(held) - 1}, "
                "each on one pipeline coordinate"
            )
        whole, stage_of_param, whole_groups, seen = [], [], [], set()
        index_base = {}
        for stage_index in sorted(held):
            coordinate, _, params, groups, *_ = held[stage_index]
            index_base[stage_index] = len(whole)
            grad_base = sum(1 for _, _, g, _ in whole if g)
            for name, *_ in params:
                if name in seen:
                    raise UsageError(
                        f"parameter {name!r} is held by two pipeline stages (tied across stages): not recorded yet"
                    )
                seen.add(name)
            whole += params
            stage_of_param += [coordinate] * len(params)
            whole_groups += [tuple(grad_base + i for i in g) for g in groups if g]
        self._stage_parts = tuple((rank, start, stop) for _, rank, _, _, start, stop in (held[s] for s in sorted(held)))
        # each of this rank's parameters at its place in the whole model's flat vector
        self._grad_offsets, self._weight_offsets, indices = {}, {}, []
        for stage_index, part in zip(self._stage_indices, self._parts):
            earlier = whole[: index_base[stage_index]]
            weight_at = sum(int(np.prod(shape)) for _, shape, _, _ in earlier)
            grad_at = sum(int(np.prod(shape)) for _, shape, grad, _ in earlier if grad)
            for i, p in enumerate(part.parameters()):
                indices.append(index_base[stage_index] + i)
                self._weight_offsets[id(p)] = weight_at
                weight_at += p.numel()
                if p.requires_grad:
                    self._grad_offsets[id(p)] = grad_at
                    grad_at += p.numel()
        self._whole_buckets = [[i for i, (_, _, grad, _) in enumerate(whole) if grad]]
        # the groups that reduce-scatter: those holding a trainable parameter
        self._part_groups = [
            [g for g in fm.param_groups(part) if any(fp.sharded_param.requires_grad for fp in g.fsdp_params)]
            for part in self._parts
        ]
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
        return mesh, indices

    @property
    def mesh(self):
        return self._mesh

    def install(self, job: Job) -> None:
        super().install(job)
        # stages may hold different numbers of parameter groups (an uneven cut; a middle stage's
        # root without parameters): the reduce-scatter check's table has the most any rank makes
        mine = sum(len(groups) for groups in self._part_groups)
        most = torch.tensor([mine], dtype=torch.int64, device=fm.collective_device())
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        self.tap.slots = int(most.item())
        stages = self._mesh.shape[self._mesh.pp_dim]
        if len(self._parts) == 1 and self._stage_indices[0] < stages - 1:
            # one stage per rank, not the last: what it hands on, and the gradients handed back for it
            self._handles.append(self._parts[0].register_forward_hook(self._hand_off))

    def _hand_off(self, module, args, output) -> None:
        """Digest the output this stage sends to the next (after every hook inside it ran: what was
        sent) and, in the backward, the gradient the next stage hands back for it (a HANDOFF record
        per step: the replay at the job's layout tells from them which stage a wrong forward began in)."""
        state = self.job.current()
        if state is None or not isinstance(output, torch.Tensor):
            return
        seed, keep = self.job.options.seed, int(self.schedule._n_microbatches)
        state.add_handoff("out", local_tensor(output), seed, keep)
        if output.requires_grad:
            output.register_hook(lambda grad: state.add_handoff("back", local_tensor(grad), seed, keep))

    def buckets(self) -> list[list[int]]:
        """One bucket: every trainable parameter of the whole model (the trace's indices), in order."""
        return self._whole_buckets

    def begin_step(self, state) -> None:
        self._part_pieces = {}
        super().begin_step(state)

    def _after_backward(self) -> None:
        """Several stages per rank: each stage's shard of the reduced gradient is read right after its
        own reduce-scatter (its root's end-of-backward callback), before the schedule divides it by the
        microbatch count, which it does stage by stage; the rank's reduced gradient is all of them."""
        if len(self._parts) == 1:
            return super()._after_backward()
        state = self.job.current()
        if state is None or state.reduced is not None or not self.tap.recording:
            return
        # the parameter groups that reduce-scattered in this step (the tap's)
        reduced = self.tap._groups_seen
        try:
            for i, (part, groups) in enumerate(zip(self._parts, self._part_groups)):
                if i not in self._part_pieces and all(id(g) in reduced for g in groups):
                    self._part_pieces[i] = self._part_reduced(part)
            if len(self._part_pieces) == len(self._parts) and all(p is not None for p in self._part_pieces.values()):
                state.reduced = shards.combine_pieces(
                    [p for i in sorted(self._part_pieces) for p in self._part_pieces[i]]
                )
        except Exception as exc:  # noqa: BLE001 - said at the step's end, on every rank, never inside autograd
            self._reduced_error = exc

    def _part_reduced(self, part: torch.nn.Module) -> list | None:
        """The fingerprint pieces of this rank's boxes of one stage's reduced gradient (None: a
        trainable parameter without a gradient)."""
        trainable = [p for p in part.parameters() if p.requires_grad]
        if any(p.grad is None for p in trainable):
            return None
        runs = []
        for p in trainable:
            flat = local_tensor(p.grad).detach().reshape(-1)
            offset = self._grad_offsets[id(p)]
            runs += [(flat[s : s + n], offset + place) for s, n, place in self._runs[id(p)]]
        options = self.job.options
        return shards.fingerprint_pieces(((v, at, 0, 0) for v, at in runs), k=options.sketch_k, seed=options.seed)

    def _reduced_shard(self):
        if len(self._parts) == 1:
            return super()._reduced_shard()
        # read as each stage was reduced (``_after_backward``): later, some are divided already
        return None

    def saver(self) -> Saver:
        return TpSaver(self._mesh.same_shard(), stage_parts=self._stage_parts)
