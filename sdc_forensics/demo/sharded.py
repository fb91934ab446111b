"""A sharded training job and its replay recipe: FSDP2 ``fully_shard`` on a 1-D mesh, or HSDP.

The model (a small MLP with BatchNorm-free normalisation: Linear, ReLU, LayerNorm, Linear, each
block its own ``fully_shard`` group; or ``model="tied-lm"``, a one-block causal transformer whose
head is tied to its embedding, as nanoGPT's), the data (microbatch ``i`` is generated from ``i``)
and the optimizer (SGD with momentum, or ``optimizer="adamw"`` with nanoGPT's two parameter
groups) are what a user's job would have, with ``clip_grad_norm_`` on the DTensor parameters
inside the step when ``max_norm`` is set; the recorder is the two lines every job adds.
``sdc-forensics demo --parallel fsdp|hsdp`` runs it on gloo processes, and the tests run it with
faults at every sharded location.

``recipe`` replays it on one process: the plain model (the same parameter names and order), the
DCP checkpoint loaded into it whole (``load_dcp``: torch.distributed.checkpoint reshards on load).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN_FEATURES, HIDDEN, CLASSES, MICROBATCH = 24, 96, 5, 6
# the tied-head transformer's
VOCAB, DIM, CONTEXT = 40, 16, 8
MODELS = ("mlp", "tied-lm")
OPTIMIZERS = ("sgd", "adamw")
REFERENCE = "sdc_forensics.demo.sharded:recipe"
#: the recipe as a class: a job with a seed of its own records it with ``recipe_args={"seed": s}``
SEEDED_REFERENCE = "sdc_forensics.demo.sharded:ShardedRecipe"


class CausalAttention(nn.Module):
    """Single-head causal self-attention, pre-norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    # (B, T, DIM) -> (B, T, DIM)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).split(DIM, dim=-1)
        # (B, T, T)
        scores = (q @ k.transpose(-2, -1)) / DIM**0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
        return self.proj(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v)


class TiedLM(nn.Module):
    """A one-block causal transformer (single-head attention, MLP, pre-norm residuals) whose head
    shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = CausalAttention()
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    # (B, T) -> (B, T, VOCAB)
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.attn(x)
        x = x + self.mlp(x)
        return self.head(self.norm(x))


def build_model(seed: int = 0, model: str = "mlp") -> nn.Module:
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, not {model!r}")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    if model == "tied-lm":
        built: nn.Module = TiedLM()
    else:
        built = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, CLASSES)
        )
    torch.random.set_rng_state(state)
    return built


def make_optimizer(model: nn.Module, optimizer: str = "sgd") -> torch.optim.Optimizer:
    # nanoGPT's groups: weight decay on matrices (and the tied embedding), none on the rest
    if optimizer == "adamw":
        params = list(model.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    if optimizer != "sgd":
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, not {optimizer!r}")
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def microbatch(microbatch_id: int, device: Any = "cpu", seed: int = 0, model: str = "mlp") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(20_011 + int(microbatch_id) + 1_000_003 * int(seed))
    if model == "tied-lm":
        ids = torch.randint(VOCAB, (MICROBATCH, CONTEXT + 1), generator=gen)
        return ids[:, :-1].to(device), ids[:, 1:].to(device)
    inputs = torch.randn(MICROBATCH, IN_FEATURES, generator=gen)
    labels = (inputs[:, :CLASSES].argmax(dim=1) + (inputs[:, -1] > 0).long()) % CLASSES
    return inputs.to(device), labels.to(device)


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    inputs, labels = batch
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def clip(model: nn.Module, max_norm: float) -> torch.Tensor | None:
    """The job's clipping (and the recipe's ``before_step``): torch's ``clip_grad_norm_``, on the
    DTensor parameters in the job; returns the total norm it clipped with (None for ``max_norm`` 0:
    no clipping)."""
    if not max_norm:
        return None
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _flat(flatten: bool = True):
    """The optimizer's state keyed by parameter name, hyperparameters included (torchtitan's
    ``flatten_optimizer_state_dict=True``). Unflattened, every pipeline stage saves its group as
    ``param_groups.0`` with its own parameter list, DCP keeps one stage's, and the other stages load
    their groups without their learning rate and betas."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def _saved_flat(path: str | Path) -> bool:
    """Whether the DCP directory holds the optimizer state flattened (:func:`_flat`), as this module
    saves it; a directory another tool saved unflattened holds ``optim.param_groups.0.lr`` and the
    like (a group's index where a flattened one holds a parameter's name)."""
    import re

    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return not any(re.fullmatch(r"optim\.param_groups\.\d+\.(lr|params)(\..*)?", key) for key in keys)


def load_dcp(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a DCP directory saved as ``{"model": ..., "optim": ...}`` (``get_model_state_dict``,
    ``get_optimizer_state_dict``) into a model and optimizer of any sharding, a plain one included."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # flattened as this module saves; unflattened as another tool may have (a torchtitan loop's checkpoint)
    options = _flat(_saved_flat(path)) if optimizer is not None else _flat()
    model_state, optim_state = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    state = {"model": model_state}
    if optimizer is not None:
        state["optim"] = optim_state
    with warnings.catch_warnings():
        # loading in one process (the replay of a sharded job) is the intent: DCP's warning says so to every user
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=options,
    )


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What the job saves: the model's and the optimizer's state, sharded as they are."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_flat())
    return {"model": model_state, "optim": optim_state}


@dataclasses.dataclass(kw_only=True)
class ShardedRecipe:
    """The replay recipe of :func:`train` (``sdc_forensics.recipe``'s protocol)."""

    seed: int = 0
    model: str = "mlp"
    optimizer: str = "sgd"
    max_norm: float = 0.0

    def build(self, device: Any = "cpu"):
        model = build_model(self.seed, self.model).to(device)
        return model, make_optimizer(model, self.optimizer), None

    def load_checkpoint(self, path: str, model, optimizer, scheduler) -> None:
        load_dcp(path, model, optimizer)

    def fetch_microbatch(self, microbatch_id: int, device: Any = "cpu"):
        return microbatch(microbatch_id, device, self.seed, self.model)

    def loss(self, model, batch):
        return loss_of(model, batch)

    def before_step(self, model, optimizer) -> None:
        clip(model, self.max_norm)


recipe = ShardedRecipe()


def shard(
    model: nn.Module, mesh=None, reduce_dtype: torch.dtype | None = None, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """``fully_shard`` each block, then the whole model (the usual FSDP2 wrapping); ``param_dtype``:
    compute in it, ``reduce_dtype``: reduce gradients in it (``MixedPrecisionPolicy``; torchtitan's
    default is bfloat16 and float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": mesh} | ({"mp_policy": policy} if reduce_dtype or param_dtype else {})
    # the tied embedding and head stay in the root's group: one parameter, one shard
    for layer in (model.attn, model.mlp) if isinstance(model, TiedLM) else (model[0], model[3]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train(
    rank: int,
    world: int,
    trace_dir: str,
    checkpoint_dir: str,
    *,
    steps: int = 6,
    hsdp: tuple[int, int] | None = None,
    inject: tuple[str, ...] = (),
    reduction: str = "ordered",
    checkpoint_every: int = 3,
    accumulate: int = 2,
    policy: str = "continue",
    seed: int = 0,
    reduce_dtype: str = "",
    param_dtype: str = "",
    audit_every: int = 0,
    model: str = "mlp",
    optimizer: str = "sgd",
    max_norm: float = 0.0,
) -> dict:
    """One rank of the sharded job, recorded; every rank calls it inside an initialised process group.

    Microbatch ``step * world * accumulate + rank * accumulate + m`` is rank ``rank``'s ``m``-th of
    ``step``. Checkpoints (DCP directories) are written at step 0 and every ``checkpoint_every``.
    ``seed`` draws the model's initial weights and the data (a variant of the job; recorded as
    ``recipe_args``). ``reduce_dtype`` ("bfloat16"): FSDP2 reduces gradients in it; ``param_dtype`` ("bfloat16"):
    it computes in it. ``audit_every``: audit every this many steps, each rank its own node (one
    host pretends to be several, so that every rank has an auditor). ``model``, ``optimizer``:
    the variants above; ``max_norm``: clip the gradients to it inside the step (0: no clipping).
    Returns what the recorder raised or found and the norms clipping saw, for tests.
    """
    import torch.distributed as dist

    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder import Recorder, RecorderOptions

    from torch.distributed.device_mesh import init_device_mesh

    if hsdp is not None:
        mesh = init_device_mesh("cpu", hsdp, mesh_dim_names=("replicate", "shard"))
    # fully_shard's default mesh, named: a suspect is then "shard=2", not "dim0=2"
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    kind, chosen, max_norm = model, optimizer, float(max_norm)
    model = shard(
        build_model(seed, kind),
        mesh,
        getattr(torch, reduce_dtype) if reduce_dtype else None,
        getattr(torch, param_dtype) if param_dtype else None,
    )
    optimizer = make_optimizer(model, chosen)
    options = RecorderOptions(
        policy=policy,
        reduction=reduction,
        audit_every=audit_every,
        node_of_rank=tuple(range(world)) if audit_every else None,
    )
    alarms: list = []
    # the total gradient norm clipping saw, per step
    norms: list[float] = []
    defaults = ShardedRecipe()
    args = {
        name: value
        for name, value in (("seed", seed), ("model", kind), ("optimizer", chosen), ("max_norm", max_norm))
        if value != getattr(defaults, name)
    }
    recorded = {"recipe": REFERENCE} if not args else {"recipe": SEEDED_REFERENCE, "recipe_args": args}
    with Recorder(trace_dir, model, optimizer, options=options, inject=inject, **recorded) as rec:
        for step in range(steps):
            if step % checkpoint_every == 0:
                rec.checkpoint(step, Path(checkpoint_dir) / f"step-{step:08d}", dcp_state(model, optimizer))
            first = (step * world + rank) * accumulate
            ids = list(range(first, first + accumulate))
            try:
                with rec.step(step, microbatch_ids=ids) as h:
                    for m, mb in enumerate(ids):
                        model.set_requires_gradient_sync(m == accumulate - 1)
                        batch = h.input(microbatch(mb, seed=seed, model=kind))
                        loss = loss_of(model, batch)
                        h.loss(loss)
                        loss.backward()
                    norm = clip(model, max_norm)
                    # the tests check that clipping engaged (a host sync the demo can afford)
                    if norm is not None:
                        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
                    optimizer.step()
                    optimizer.zero_grad()
            except SdcAlarm as alarm:
                alarms.append({"step": alarm.step, "rank": alarm.rank, "check": alarm.check})
                break
        alarms += [{"step": a.step, "rank": a.rank, "check": a.check} for a in rec.alarms if a.check]
    dist.barrier()
    return {"alarms": alarms, "grad_norms": norms}


def default_injection(steps: int, checkpoint_every: int) -> str:
    """The tour's fault: a finite flip in rank 2's local gradient, which every online check passes
    (it is summed consistently) and only the replay names, at the step the DDP demo uses."""
    from sdc_forensics.demo.run import default_injection as ddp_default

    return ddp_default(steps, checkpoint_every).replace("grad:", "local-gradient:", 1)


def _demo_rank(rank: int, world: int, port: int, out_dir: str, kwargs: dict, trainer: str) -> None:
    """One rank of a demo job: gloo, then ``trainer`` (``module:function``, the ``train`` of this module
    or of ``demo/tp.py``), its findings written to ``OUT/demo/rank-R.json``."""
    import datetime
    import importlib
    import json
    import logging

    import torch.distributed as dist

    from sdc_forensics.newfile import write_atomic

    torch.set_num_threads(1)
    # the demo says what fired itself
    logging.getLogger("sdc_forensics.recorder").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    module, name = trainer.split(":")
    train_job = getattr(importlib.import_module(module), name)
    try:
        found = train_job(rank, world, str(Path(out_dir, "trace")), str(Path(out_dir, "checkpoints")), **kwargs)
    finally:
        dist.destroy_process_group()
    write_atomic(Path(out_dir, "demo", f"rank-{rank}.json"), json.dumps(found))


def launch(out_dir: str | Path, world: int, kwargs: dict, trainer: str = "sdc_forensics.demo.sharded:train") -> dict:
    """Run a demo job on ``world`` forked gloo processes into ``out_dir`` (refused if it holds a
    trace already); rank 0's findings. ``trainer``: the ``module:function`` each rank trains with."""
    import json

    from sdc_forensics.demo import forked
    from sdc_forensics.demo.ports import free_port
    from sdc_forensics.errors import UsageError

    out = Path(out_dir)
    if (out / "trace" / "manifest.json").exists():
        raise UsageError(f"{out} already holds a demo trace: pass another --out, or remove it")
    (out / "demo").mkdir(parents=True, exist_ok=True)
    forked.start(_demo_rank, (world, free_port(), str(out), kwargs, trainer), world)
    return json.loads((out / "demo" / "rank-0.json").read_text())


def run_demo(
    out_dir: str | Path,
    parallel: str,
    injections: tuple[str, ...],
    *,
    steps: int = 40,
    checkpoint_every: int = 10,
    policy: str = "continue",
    seed: int = 0,
    reduce_dtype: str = "",
    param_dtype: str = "",
    model: str = "mlp",
    optimizer: str = "sgd",
    max_norm: float = 0.0,
) -> dict:
    """``sdc-forensics demo --parallel fsdp|hsdp``: the sharded job on 4 gloo processes (FSDP over 4
    ranks, or HSDP 2 replicas x 2 shards), recorded with the ordered reduce-scatter; returns rank 0's
    findings (the online alarms). The trace is ``OUT/trace``, checkpoint ``N`` ``OUT/checkpoints/step-N``
    (8 digits); ``benchmarks/campaign.py --parallel`` runs it with ``seed`` as the variant, and ``model``,
    ``optimizer`` and ``max_norm`` as :func:`train` takes them (the clipped tied-head AdamW job: ``--job clipped-lm``)."""
    from sdc_forensics.errors import UsageError

    if parallel not in ("fsdp", "hsdp"):
        raise UsageError(f"--parallel must be ddp, fsdp or hsdp, not {parallel!r}")
    kwargs = {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "policy": policy,
        "inject": tuple(injections),
        "hsdp": (2, 2) if parallel == "hsdp" else None,
        "seed": seed,
        "reduce_dtype": reduce_dtype,
        "param_dtype": param_dtype,
        "model": model,
        "optimizer": optimizer,
        "max_norm": max_norm,
    }
    return launch(out_dir, 4, kwargs)
