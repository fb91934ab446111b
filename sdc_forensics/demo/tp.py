"""A tensor-parallel training job and its replay recipe: TP 2 (with sequence parallel) x FSDP2 DP 2.

The model is a one-block causal transformer (two heads, pre-norm, GELU MLP, untied head). The
job parallelises it as torchtitan does, on a ``(dp, tp)`` mesh of 4 gloo processes:
``parallelize_module`` on ``tp`` (the embedding row-parallel with a sequence-sharded output,
each LayerNorm ``SequenceParallel``, the attention's input gathered by ``PrepareModuleInput``,
q/k/v and the MLP's first layer ``ColwiseParallel``, the attention's output projection and the
MLP's second layer ``RowwiseParallel`` back to sequence shards, the head ``ColwiseParallel``
with replicated logits), then ``fully_shard`` over ``dp``. The ranks of one DP coordinate read
the same microbatches. ``sdc-forensics demo --parallel tp`` runs it; the tests run it with faults.

Besides the recorder's drills, the demo has one of its own, ``tp-collective:step=S:rank=R:bit=B
[:element=I]`` (:class:`CollectiveDrill`): a bit of rank R's output of the MLP's row-parallel
reduce-scatter (``down``, sequence parallel) flipped in the forward of step S, as a faulty
collective would hand it over. Element I indexes that local output (this rank's sequence shard,
flattened); element 0 unless given.

``recipe`` replays it: on one process the plain model (same names and order), the DCP checkpoint
loaded into it whole (``sharded.load_dcp``), compared within tolerance; under ``torchrun
--nproc-per-node 2`` its ``parallelize`` hook applies the job's TP plan (:func:`tensor_parallel`)
on the replay's ``tp`` mesh, the checkpoint loaded resharded, and the replay is exact
(``replay/tp_exact.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sdc_forensics.demo.sharded import dcp_state, launch, load_dcp, loss_of
from sdc_forensics.errors import UsageError

VOCAB, DIM, HEADS, CONTEXT, MICROBATCH = 40, 16, 2, 8, 4
TP, DP = 2, 2
REFERENCE = "sdc_forensics.demo.tp:recipe"
SEEDED_REFERENCE = "sdc_forensics.demo.tp:TpRecipe"


class Attention(nn.Module):
    """Causal self-attention whose heads are split across TP ranks (q/k/v column-parallel: each
    rank computes its heads on the whole sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)

    # (B, T, DIM) -> (B, T, DIM)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps = x.shape[0], x.shape[1]
        # (B, heads here, T, head dim): a TP rank's q/k/v hold its heads only
        q, k, v = (t.view(batch, steps, -1, DIM // HEADS).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, steps, -1))


class TinyLM(nn.Module):
    """Embedding, one pre-norm block (attention, MLP), final norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    # (B, T) token ids -> (B, T, VOCAB) logits
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(self.norm1(x))
        x = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return self.head(self.norm(x))


class CollectiveDrill:
    """The ``tp-collective`` drill of one rank: a forward hook on the row-parallel ``down`` that flips
    a bit of its output (the reduce-scatter's, this rank's sequence shard) at the specs' steps.

    Registered after the TP plan, so it runs after TP's own output hook: what it flips is what the
    collective returned, before the residual add reads it (a copy of it: autograd forbids flipping
    TP's output view in place). The gradient flows through unchanged, as it would through a
    collective whose output was corrupted.
    """

    def __init__(self, specs, rank: int) -> None:
        self.specs = [s for s in specs if s.applies_to(rank)]
        self.rank = rank
        self.step = -1
        self.fired: list[dict] = []

    def __call__(self, module, args, output) -> torch.Tensor | None:
        from sdc_forensics.inject import flip_bit_

        due = [s for s in self.specs if s.step == self.step and not any(f["step"] == self.step for f in self.fired)]
        if not due:
            return None
        # TP's output is a view made by a custom Function (to_local): autograd forbids flipping it in place
        output = output.clone()
        for spec in due:
            flat = output.detach().view(-1)
            element = 0 if spec.element is None else spec.element
            if element >= flat.numel():
                raise UsageError(f"fault {spec}: element {element} is out of range (0..{flat.numel() - 1})")
            old, new = flip_bit_(flat, element, spec.bit)
            self.fired.append({"spec": str(spec), "step": self.step, "rank": self.rank, "old": old, "new": new})
        return output


def split_collective_specs(inject: tuple[str, ...], locations: tuple[str, ...] | None = None):
    """``(the recorder's specs, the demo's own ones parsed)`` of a demo's ``--inject`` texts: those at
    ``locations`` (default: ``tp-collective``)."""
    from sdc_forensics.inject import TP_LOCATIONS, parse_spec

    locations = locations or TP_LOCATIONS
    ours = [t for t in inject if t.strip().lower().split(":")[0] in locations]
    return tuple(t for t in inject if t not in ours), [parse_spec(t, locations) for t in ours]


def build_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def microbatch(microbatch_id: int, device: Any = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(40_009 + int(microbatch_id) + 1_000_003 * int(seed))
    ids = torch.randint(VOCAB, (MICROBATCH, CONTEXT + 1), generator=gen)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def parallelize(model: TinyLM, mesh, loss_parallel: bool = False) -> TinyLM:
    """TP (with sequence parallel) on ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]`` (torchtitan's
    order); HSDP over ``mesh["dp_replicate", "dp_shard"]`` on torchtitan's 3-D mesh."""
    from torch.distributed.fsdp import fully_shard

    tensor_parallel(model, mesh["tp"], loss_parallel)
    dp = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in mesh.mesh_dim_names else mesh["dp"]
    fully_shard(model.attn, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def block_plan(prefix: str = "") -> dict:
    """The TP plan (with sequence parallel) of one pre-norm block whose modules are named
    ``{prefix}norm1``, ``attn`` (``q``, ``k``, ``v``, ``proj``), ``norm2``, ``up`` and ``down``: its input
    and output are local sequence shards (``Shard(1)``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        f"{prefix}norm1": SequenceParallel(),
        f"{prefix}attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{prefix}attn.q": ColwiseParallel(),
        f"{prefix}attn.k": ColwiseParallel(),
        f"{prefix}attn.v": ColwiseParallel(),
        f"{prefix}attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}norm2": SequenceParallel(),
        f"{prefix}up": ColwiseParallel(input_layouts=Shard(1)),
        f"{prefix}down": RowwiseParallel(output_layouts=Shard(1)),
    }


def ends_plan(embed: bool = True, head: bool = True, loss_parallel: bool = False) -> dict:
    """The TP plan of the embedding (row-parallel, a sequence-sharded output) and of the final norm
    and head (sequence parallel, then column-parallel with replicated logits; with ``loss_parallel``
    the logits stay sharded on the vocabulary, a DTensor, for torch's ``loss_parallel`` cross
    entropy, as torchtitan's default plan has it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict = {}
    if embed:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if head:
        plan["norm"] = SequenceParallel()
        plan["head"] = (
            ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
            if loss_parallel
            else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        )
    return plan


def tensor_parallel(model: TinyLM, tp_mesh, loss_parallel: bool = False) -> TinyLM:
    """The job's TP plan (with sequence parallel) on a 1-D ``tp`` mesh: the training's and the exact replay's."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, {**ends_plan(loss_parallel=loss_parallel), **block_plan()})
    return model


def quiet_view_warning() -> None:
    """Silence FSDP2's warning that a module returned a view (TP's ``to_local`` outputs are views): the
    demos add residuals out of place, which is what it asks for, and it would fill every demo's output."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def train_context(loss_parallel: bool):
    """What the loss and its backward run under: torch's ``loss_parallel()`` (the cross entropy of
    vocabulary-sharded logits, without gathering them) where the job uses it, else nothing."""
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

    return parallel_loss() if loss_parallel else contextlib.nullcontext()


@dataclasses.dataclass(kw_only=True)
class TpRecipe:
    """The replay recipe of :func:`train` (``sdc_forensics.recipe``'s protocol), with the exact TP replay's hook."""

    seed: int = 0
    # the job computes its loss with torch's loss_parallel on vocabulary-sharded logits
    loss_parallel: bool = False

    def build(self, device: Any = "cpu"):
        model = build_model(self.seed).to(device)
        return model, make_optimizer(model), None

    def parallelize(self, model, tp_mesh):
        """The exact replay's hook (docs/recipes.md): the job's TP plan on the replay's ``tp`` mesh."""
        return tensor_parallel(model, tp_mesh, self.loss_parallel)

    def train_context(self):
        """The replay's optional hook (docs/recipes.md): the context of each microbatch's loss and backward."""
        return train_context(self.loss_parallel)

    def load_checkpoint(self, path: str, model, optimizer, scheduler) -> None:
        # DCP reshards: into the whole model on one process, into its TP slices under torchrun
        load_dcp(path, model, optimizer)

    def fetch_microbatch(self, microbatch_id: int, device: Any = "cpu"):
        return microbatch(microbatch_id, device, self.seed)

    def loss(self, model, batch):
        return loss_of(model, batch)


recipe = TpRecipe()


@dataclasses.dataclass(kw_only=True)
class ClippedTpRecipe(TpRecipe):
    """The recipe of the job that clips (``max_norm``): torch's ``clip_grad_norm_`` in the loop's
    place, which the exact replay runs with the total norm as the job's (dp, tp) shards computed it
    (``replay/clipping.tp_total_norm``)."""

    max_norm: float

    def before_step(self, model, optimizer) -> None:
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
    audit_every: int = 0,
    max_norm: float = 0.0,
    reduction: str = "native",
    replicate: int = 1,
    loss_parallel: bool = False,
) -> dict:
    """One rank of the TP x DP job, recorded; every rank calls it in an initialised process group.
    ``replicate`` > 1: HSDP x TP on torchtitan's ``(dp_replicate, dp_shard, tp)`` mesh.
    ``loss_parallel``: the head's logits stay vocabulary-sharded and the loss and its backward run
    under torch's ``loss_parallel()``, as torchtitan trains.

    Microbatch ``step * DP + dp`` is what the ranks of DP coordinate ``dp`` train on at ``step``
    (HSDP: ``dp = replica * shards + shard``).
    Checkpoints (DCP directories) at step 0 and every ``checkpoint_every``. ``max_norm``: the loop
    clips with torch's ``clip_grad_norm_`` on the (dp, tp) DTensors before each update (the recipe
    :class:`ClippedTpRecipe`); ``reduction``: the recorder's DP reduction (``ordered`` for more than
    two DP ranks replayed exactly). Returns the alarms and, when it clips, each step's total norm."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder import Recorder, RecorderOptions

    if replicate > 1:
        shape, names = (replicate, world // (replicate * TP), TP), ("dp_replicate", "dp_shard", "tp")
    else:
        shape, names = (world // TP, TP), ("dp", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    quiet_view_warning()
    *coord, _ = mesh.get_coordinate()
    dp = coord[0] * shape[1] + coord[1] if replicate > 1 else coord[0]
    model = parallelize(build_model(seed), mesh, loss_parallel)
    optimizer = make_optimizer(model)
    inject, collective_specs = split_collective_specs(inject)
    drill = CollectiveDrill(collective_specs, rank)
    if drill.specs:
        model.down.register_forward_hook(drill)
    options = RecorderOptions(policy=policy, audit_every=audit_every, reduction=reduction)
    settings = {k: v for k, v in (("seed", seed), ("max_norm", max_norm), ("loss_parallel", loss_parallel)) if v}
    reference = "sdc_forensics.demo.tp:ClippedTpRecipe" if max_norm else SEEDED_REFERENCE
    recorded = {"recipe": REFERENCE} if not settings else {"recipe": reference, "recipe_args": settings}
    norms: list = []
    alarms: list = []
    with Recorder(trace_dir, model, optimizer, options=options, inject=inject, **recorded) as rec:
        for step in range(steps):
            if step % checkpoint_every == 0:
                rec.checkpoint(step, Path(checkpoint_dir) / f"step-{step:08d}", dcp_state(model, optimizer))
            mb = step * (world // TP) + dp
            drill.step = step
            try:
                with rec.step(step, microbatch_ids=[mb]) as h:
                    batch = h.input(microbatch(mb, seed=seed))
                    with train_context(loss_parallel):
                        loss = loss_of(model, batch)
                        h.loss(loss)
                        loss.backward()
                    if max_norm:
                        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()))
                    optimizer.step()
                    optimizer.zero_grad()
            except SdcAlarm as alarm:
                alarms.append({"step": alarm.step, "rank": alarm.rank, "check": alarm.check})
                break
        alarms += [{"step": a.step, "rank": a.rank, "check": a.check} for a in rec.alarms if a.check]
    dist.barrier()
    return {"alarms": alarms, "fired": drill.fired, "grad_norms": norms}


def run_demo(
    out_dir: str | Path,
    injections: tuple[str, ...],
    *,
    steps: int = 12,
    checkpoint_every: int = 4,
    policy: str = "continue",
    seed: int = 0,
    max_norm: float = 0.0,
    dp: int = DP,
    reduction: str = "native",
    replicate: int = 1,
    loss_parallel: bool = False,
) -> dict:
    """``sdc-forensics demo --parallel tp``: the job on ``replicate * dp * 2`` gloo processes (DP 2 x
    TP 2 unless ``dp`` says otherwise; HSDP's ``replicate`` x ``dp`` x TP 2 where ``replicate`` > 1);
    returns rank 0's findings. The trace is ``OUT/trace``, checkpoint ``N``
    ``OUT/checkpoints/step-N`` (8 digits)."""
    kwargs = {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "policy": policy,
        "inject": tuple(injections),
        "seed": seed,
        "max_norm": max_norm,
        "reduction": reduction,
        "replicate": replicate,
        "loss_parallel": loss_parallel,
    }
    return launch(out_dir, replicate * dp * TP, kwargs, "sdc_forensics.demo.tp:train")
