"""A pipeline-parallel training job and its replay recipe: PP 2 x FSDP2 DP 2, torchtitan's composition.

The model is a small causal transformer (embedding, four pre-norm blocks of attention and a GELU
MLP, final norm, untied head). The job cuts it into two stages as torchtitan does (a copy of the
whole model with the other stage's blocks deleted, so every parameter keeps its whole-model name:
stage 0 holds the embedding and blocks 0-1, stage 1 blocks 2-3, the norm and the head), on a
``(pp, dp)`` mesh of 4 gloo processes; each stage is ``fully_shard``-ed over ``dp`` (each block,
then the stage), and a schedule (``Schedule1F1B`` by default, ``ScheduleGPipe``) runs
:data:`MICROBATCHES` microbatches per step through them, scaling the gradients by their count
(the schedule's default); with ``schedule="interleaved-1f1b", virtual_stages=2`` it cuts the model
into four one-block stages, two per rank (stages ``pp`` and ``pp + 2``), run by
``ScheduleInterleaved1F1B``. The ranks of one DP coordinate read the same microbatches. With
``max_norm`` the job clips as torchtitan does, with the total norm across the stages
(:func:`clip_pipeline`), and the recipe's ``before_step`` clips the whole model likewise.
``sdc-forensics demo --parallel pp`` runs it; the tests run it with faults.

Besides the recorder's drills, the demo has one of its own, ``pp-activation:step=S:rank=R:bit=B
[:element=I]``: a bit of the activation that rank R (a stage before the last) hands to the next
stage flipped in the forward of step S (its first microbatch), as a faulty transfer would deliver
it: on the receiving rank (``tp.CollectiveDrill`` in a forward pre-hook of its stage), so the
sender's output, its digest and its own backward are untouched, as a transfer fault leaves them,
and the receiver hands back the gradient of what it received. With ``tp=2`` (the 3-D job) the TP demo's ``tp-collective``
drill is there too: a bit of rank R's output of its stage's first block's row-parallel MLP (the
reduce-scatter over ``tp``, sequence parallel) flipped in the forward of step S.

``recipe`` replays it on one process: the whole model (same names and order), the DCP checkpoint
loaded into it whole (``sharded.load_dcp``), each rank's microbatches recomputed through it in
order. The pipeline hands activations between stages as they are (a copy, no arithmetic), so the
whole model's gradient is each stage's, bit for bit, and the replay certifies
(``replay/pp.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdc_forensics.demo.sharded import dcp_state, launch, load_dcp
from sdc_forensics.errors import UsageError
from sdc_forensics.demo.tp import (
    Attention,
    CollectiveDrill,
    block_plan,
    ends_plan,
    quiet_view_warning,
    split_collective_specs,
)

VOCAB, DIM, CONTEXT, MICROBATCH, BLOCKS = 40, 16, 8, 2, 4
PP, DP, MICROBATCHES = 2, 2, 4
REFERENCE = "sdc_forensics.demo.pp:recipe"
SEEDED_REFERENCE = "sdc_forensics.demo.pp:PpRecipe"
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class PipelinedLM(nn.Module):
    """Embedding, blocks, final norm, head; a stage is a copy with some of them deleted (None, or
    removed from ``layers``): it then takes the previous stage's activations, or returns its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(BLOCKS)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.head: nn.Module | None = nn.Linear(DIM, VOCAB, bias=False)

    # (B, T) token ids, or (B, T, DIM) activations -> (B, T, VOCAB) logits, or activations
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            h = block(h)
        return self.head(self.norm(h)) if self.head is not None else h


def build_model(seed: int = 0) -> PipelinedLM:
    torch.manual_seed(seed)
    return PipelinedLM()


def stage_module(model: PipelinedLM, stage: int, stages: int = PP) -> PipelinedLM:
    """Stage ``stage``'s module: a copy of the whole model holding its blocks only (torchtitan's
    cut: the parameters keep their whole-model names), the embedding on the first, the norm and
    head on the last."""
    part = copy.deepcopy(model)
    per = BLOCKS // stages
    for key in list(part.layers.keys()):
        if not stage * per <= int(key) < (stage + 1) * per:
            del part.layers[key]
    if stage != 0:
        part.embed = None
    if stage != stages - 1:
        part.norm = part.head = None
    return part


def _rank_module(parts: list[PipelinedLM]) -> PipelinedLM:
    """The stages a rank holds as one module under whole-model names (what its optimizer and its DCP
    checkpoints hold): their embedding, blocks, norm and head, the stages' own modules (shared, not
    copied). The schedule runs each stage's module; this one is never called."""
    held = PipelinedLM.__new__(PipelinedLM)
    nn.Module.__init__(held)
    held.embed = parts[0].embed
    held.layers = nn.ModuleDict({key: block for part in parts for key, block in part.layers.items()})
    held.norm, held.head = parts[-1].norm, parts[-1].head
    return held


def tensor_parallel(model: PipelinedLM, tp_mesh) -> PipelinedLM:
    """The 3-D job's TP plan (with sequence parallel) on a 1-D ``tp`` mesh, for whatever part of the
    model ``model`` holds (a stage, or the whole model in the exact replay): the TP demo's plan
    (``demo/tp.py``) for each block; the blocks hand each other, and the stages each other, their
    local sequence shards."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = ends_plan(embed=model.embed is not None, head=model.head is not None)
    for key in model.layers.keys():
        plan |= block_plan(f"layers.{key}.")
    parallelize_module(model, tp_mesh, plan)
    return model


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def microbatch(microbatch_id: int, device: Any = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(70_001 + int(microbatch_id) + 1_000_003 * int(seed))
    ids = torch.randint(VOCAB, (MICROBATCH, CONTEXT + 1), generator=gen)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One microbatch's loss (the schedule's ``loss_fn``; it divides the gradients by the count)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def clip_pipeline(part: nn.Module, max_norm: float, pp_group) -> torch.Tensor:
    """torchtitan's clipping of a pipeline job (``dist_utils.clip_grad_norm_`` with a ``pp`` mesh):
    this stage's total norm over its FSDP2 gradients, ``** 2`` summed over the stages, ``** 0.5``,
    then every gradient scaled by it; returns the total norm."""
    import torch.distributed as dist

    grads = [p.grad for p in part.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm **= 2.0
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
    norm **= 1.0 / 2.0
    torch.nn.utils.clip_grads_with_norm_(part.parameters(), max_norm, norm, None)
    return norm


def microbatch_ids(step: int, dp: int, dp_size: int = DP) -> list[int]:
    """The microbatches the ranks of DP coordinate ``dp`` (of ``dp_size``) train on at ``step``, in schedule order."""
    first = (step * dp_size + dp) * MICROBATCHES
    return list(range(first, first + MICROBATCHES))


@dataclasses.dataclass(kw_only=True)
class PpRecipe:
    """The replay recipe of :func:`train` (``sdc_forensics.recipe``'s protocol): the whole model."""

    seed: int = 0

    def build(self, device: Any = "cpu"):
        model = build_model(self.seed).to(device)
        return model, make_optimizer(model), None

    def parallelize(self, model, tp_mesh):
        """The job's TP plan on the whole model (``replay/tp_exact.py``) or a stage (``replay/pp_exact.py``)."""
        return tensor_parallel(model, tp_mesh)

    def pipeline_stage(self, model, stage: int, stages: int):
        """Stage ``stage`` of ``stages`` as the job cut it (the replay at the job's layout, ``replay/pp_exact.py``)."""
        return stage_module(model, stage, stages)

    def pipeline_loss(self, output, batch):
        """The schedule's ``loss_fn`` on the last stage's output (the first stage takes ``batch[0]``)."""
        return loss_fn(output, batch[1])

    def load_checkpoint(self, path: str, model, optimizer, scheduler) -> None:
        load_dcp(path, model, optimizer)

    def fetch_microbatch(self, microbatch_id: int, device: Any = "cpu"):
        return microbatch(microbatch_id, device, self.seed)

    def loss(self, model, batch):
        inputs, labels = batch
        return loss_fn(model(inputs), labels)


recipe = PpRecipe()


@dataclasses.dataclass(kw_only=True)
class ClippedPpRecipe(PpRecipe):
    """The recipe of the job that clips (``max_norm``: torchtitan's norm over the stages, :func:`clip_pipeline`)."""

    max_norm: float

    def before_step(self, model, optimizer) -> None:
        # the replay computes torch's total norm as the job's stages did (replay/clipping.pipeline_total_norm)
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)


def train(
    rank: int,
    world: int,
    trace_dir: str,
    checkpoint_dir: str,
    *,
    steps: int = 6,
    inject: tuple[str, ...] = (),
    checkpoint_every: int = 3,
    policy: str = "continue",
    seed: int = 0,
    schedule: str = "1f1b",
    reduction: str = "native",
    max_norm: float = 0.0,
    tp: int = 1,
    virtual_stages: int = 1,
    replicate: int = 1,
) -> dict:
    """One rank of the PP x DP job (``world // PP`` data-parallel ranks), recorded; every rank calls it in an initialised process group.
    Checkpoints (DCP directories) at step 0 and every ``checkpoint_every``. Returns the alarms.
    ``schedule="interleaved-1f1b"`` with ``virtual_stages=2``: the model cut into ``PP * 2`` stages of one
    block, rank coordinate ``pp`` holding stages ``pp`` and ``pp + PP`` (torchtitan's "loop" placement),
    each ``fully_shard``-ed, run by ``ScheduleInterleaved1F1B``. ``replicate`` > 1: PP x HSDP on
    torchtitan's ``(pp, dp_replicate, dp_shard)`` mesh, each stage ``fully_shard``-ed over
    ``mesh["dp_replicate", "dp_shard"]`` (data-parallel coordinate ``replica * shards + shard``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder import Recorder, RecorderOptions

    if replicate > 1:
        # HSDP: torchtitan's order of dimensions, (pp, dp_replicate, dp_shard[, tp])
        shape = (PP, replicate, world // (PP * replicate * tp), *((tp,) if tp > 1 else ()))
        names = ("pp", "dp_replicate", "dp_shard", *(("tp",) if tp > 1 else ()))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    elif tp > 1:
        # 3-D: pipeline x data x tensor parallel, torchtitan's order of dimensions
        mesh = init_device_mesh("cpu", (PP, world // (PP * tp), tp), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (PP, world // PP), mesh_dim_names=("pp", "dp"))
    quiet_view_warning()
    pp, dp = mesh.get_coordinate()[:2]
    if replicate > 1:
        dp = dp * shape[2] + mesh.get_coordinate()[2]
    dp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp"]
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule {schedule!r}: the PP demo runs {', '.join(SCHEDULES)}")
    if (
        virtual_stages < 1
        or BLOCKS % (PP * virtual_stages)
        or (virtual_stages > 1 and (schedule != "interleaved-1f1b" or tp > 1))
    ):
        raise UsageError(
            f"virtual_stages={virtual_stages}: the PP demo cuts its {BLOCKS} blocks into {PP} x 1 or {PP} x 2 stages, "
            "several per rank under schedule='interleaved-1f1b' only, without TP"
        )
    # this rank's stages, in stage order ("loop" placement); `part` holds them all under whole-model names
    stage_ids = [pp + PP * v for v in range(virtual_stages)]
    whole = build_model(seed)
    parts = [stage_module(whole, i, PP * virtual_stages) for i in stage_ids]
    part = parts[0] if len(parts) == 1 else _rank_module(parts)
    if tp > 1:
        tensor_parallel(part, mesh["tp"])
    from sdc_forensics.inject import PP_LOCATIONS, TP_LOCATIONS

    inject, drill_specs = split_collective_specs(tuple(inject), PP_LOCATIONS)
    inject, tp_specs = split_collective_specs(inject, TP_LOCATIONS)
    # pp-activation: flipped where the next stage receives it (rank R's activation arrives on the rank one
    # pipeline coordinate on, same data-parallel and TP coordinates), the sender's own numbers untouched
    stride = world // PP
    if any(s.rank == rank for s in drill_specs) and stage_ids[0] == PP * virtual_stages - 1:
        raise UsageError(f"pp-activation on rank {rank}: the last stage hands no activation on")
    received = [dataclasses.replace(s, rank=s.rank + stride) for s in drill_specs]
    drill, tp_drill = CollectiveDrill(received, rank), CollectiveDrill(tp_specs, rank)
    built: list = []  # the PipelineStage objects, once built below (the drills skip their shape inference)
    if drill.specs:
        # the receiving stage's input, before its first block reads it
        parts[0].register_forward_pre_hook(lambda module, args: _flipped_input(drill, module, args, built))
    if tp_drill.specs:
        if tp == 1:
            raise UsageError(f"tp-collective on rank {rank}: the job has no tensor parallelism (tp=1)")
        # the stage's first block's row-parallel MLP output: its reduce-scatter over tp (sequence parallel)
        list(parts[0].layers.values())[0].down.register_forward_hook(
            lambda module, args, output: None if _inferring(built) else tp_drill(module, args, output)
        )
    for stage_part in parts:
        for block in stage_part.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(stage_part, mesh=dp_mesh)
    stages = [
        PipelineStage(m, i, PP * virtual_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        for i, m in zip(stage_ids, parts)
    ]
    built += stages
    if schedule == "interleaved-1f1b":
        pipeline = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss_fn)
    else:
        pipeline = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](stages[0], MICROBATCHES, loss_fn=loss_fn)
    optimizer = make_optimizer(part)
    options = RecorderOptions(policy=policy, reduction=reduction)
    settings = {k: v for k, v in (("seed", seed), ("max_norm", max_norm)) if v}
    reference = "sdc_forensics.demo.pp:ClippedPpRecipe" if max_norm else SEEDED_REFERENCE
    recorded = {"recipe": REFERENCE} if not settings else {"recipe": reference, "recipe_args": settings}
    norms: list = []
    alarms: list = []
    with Recorder(trace_dir, pipeline, optimizer, options=options, inject=inject, **recorded) as rec:
        for step in range(steps):
            if step % checkpoint_every == 0:
                rec.checkpoint(step, Path(checkpoint_dir) / f"step-{step:08d}", dcp_state(part, optimizer))
            ids = microbatch_ids(step, dp, world // (PP * tp))
            drill.step = tp_drill.step = step
            try:
                with rec.step(step, microbatch_ids=ids) as h:
                    batches = [h.input(microbatch(i, seed=seed)) for i in ids]
                    inputs = torch.cat([b[0] for b in batches])
                    labels = torch.cat([b[1] for b in batches])
                    # loop placement: coordinate 0 holds the first stage, coordinate PP - 1 the last
                    if pp == 0:
                        pipeline.step(inputs)
                    elif pp == PP - 1:
                        losses: list = []
                        pipeline.step(target=labels, losses=losses)
                        for loss in losses:
                            h.loss(loss)
                    else:
                        pipeline.step()
                    if max_norm:
                        norms.append(float(clip_pipeline(part, max_norm, mesh["pp"].get_group())))
                    optimizer.step()
                    optimizer.zero_grad()
            except SdcAlarm as alarm:
                alarms.append({"step": alarm.step, "rank": alarm.rank, "check": alarm.check})
                break
        alarms += [{"step": a.step, "rank": a.rank, "check": a.check} for a in rec.alarms if a.check]
    dist.barrier()
    return {"alarms": alarms, "fired": drill.fired + tp_drill.fired, "grad_norms": norms}


def _inferring(stages: list) -> bool:
    """Whether the stage runs the forward a schedule's first step runs on placeholders to infer the
    stages' shapes (torch 2.13's stage has no output metadata until it ends): a drill skips it."""
    meta = getattr(stages[0], "_stage_meta", None) if stages else None
    return meta is not None and getattr(meta, "outputs", ()) is None


def _flipped_input(drill: CollectiveDrill, module, args, stages: list):
    """A forward pre-hook: the stage's received activation with ``drill``'s bit flipped (a copy: the
    gradient the stage hands back flows to the buffer it received), else None. Not in the forward a
    schedule's first step runs on placeholders to infer the stages' shapes (torch 2.13's stage has
    no output metadata yet then), which trains nothing."""
    if _inferring(stages):
        return None
    flipped = drill(module, args, args[0])
    return None if flipped is None else (flipped, *args[1:])


def run_demo(
    out_dir: str | Path,
    injections: tuple[str, ...],
    *,
    steps: int = 12,
    checkpoint_every: int = 4,
    policy: str = "continue",
    seed: int = 0,
    schedule: str = "1f1b",
    tp: int = 1,
    virtual_stages: int = 1,
    replicate: int = 1,
) -> dict:
    """``sdc-forensics demo --parallel pp`` (``3d``): the job on 4 gloo processes, PP 2 x DP 2 (8:
    PP 2 x DP 2 x TP 2 with ``tp=2``, or PP 2 x 2 replicas x 2 shards with ``replicate=2``); returns rank 0's findings. The trace is ``OUT/trace``, checkpoint ``N`` ``OUT/checkpoints/step-N`` (8 digits)."""
    kwargs = {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "policy": policy,
        "inject": tuple(injections),
        "seed": seed,
        "schedule": schedule,
        "tp": tp,
        "virtual_stages": virtual_stages,
        "replicate": replicate,
    }
    return launch(out_dir, DP * PP * tp * replicate, kwargs, "sdc_forensics.demo.pp:train")
