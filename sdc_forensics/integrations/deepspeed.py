"""DeepSpeed: a ``DeepSpeedEngine`` under ZeRO stage 1, 2 or 3, recorded in two lines.

::

    from sdc_forensics.integrations import deepspeed as sdc

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rec = sdc.record(engine, "trace", recipe="myjob:recipe")      # every rank
    for step in range(num_steps):
        with rec.step(step, microbatch_ids=ids) as s:
            loss = loss_fn(engine, s.input(batch))
            engine.backward(loss)
            s.loss(loss)
            engine.step()
        if (step + 1) % every == 0:
            sdc.checkpoint(rec, engine, step + 1, f"ckpt/step-{step + 1}.pt")

What it does (``docs/integrations.md``, "DeepSpeed"): the ordinary
:class:`~sdc_forensics.recorder.Recorder` on the engine, with the layout of
``recorder/deepspeed_layout.py`` (the local gradient from a tensor hook before ZeRO's reduction,
the reduced gradient gathered whole, the weights after ``engine.step()`` gathered under ZeRO 3),
and ``engine.step`` made the optimizer step whose pre- and post-hooks run the checks: the
recorder's hooks run around DeepSpeed's whole step (its reduction epilogue, its update and, under
ZeRO 1 and 2, its all-gather of the updated partitions).

:func:`checkpoint` writes what a replay loads, through the recorder (the replicas' vote first):
``{"model", "optimizer", "step"}`` as ``torch.optim`` keeps it, the model whole and the
optimizer's state gathered from ZeRO's partitions per parameter
(``deepspeed.utils.safe_get_full_optimizer_state``); :func:`load_checkpoint` is the recipe's half.
DeepSpeed's own ``engine.save_checkpoint`` folders are verified by ``verify-checkpoint`` (their
optimizer files' three DeepSpeed classes read as inert placeholders: ``checkpoint/deepspeed_files.py``),
not certified: a replay loads :func:`checkpoint`'s files.

Gradient clipping (``"gradient_clipping"``, DeepSpeed's default 1.0) under ZeRO 1 and 2 is
replayed by :func:`clip_grad_norm_`, which the recipe's ``before_step`` calls with the job's
``gradient_clipping`` and data-parallel size: DeepSpeed's own norm, cut as its ranks' partitions.

Refused in one line, before anything is written: what ``deepspeed_layout.engine_refusal`` lists
(fp16/bf16, accumulation under ZeRO 2 and 3, clipping under ZeRO 3, offload, model parallelism,
DeepSpeed's own optimizers). Under ZeRO 1, ``gradient_accumulation_steps`` k > 1 is recorded: one
``rec.step`` names the k microbatches, ``engine.backward`` and ``engine.step()`` run per microbatch,
and the recorder's checks run around the boundary's step only.
Written against DeepSpeed 0.19 (``DS_ACCELERATOR=cpu`` with gloo on CPU).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from sdc_forensics.errors import UsageError
from sdc_forensics.integrations._common import framework_info, refuse


class _EngineStep(torch.optim.Optimizer):
    """``engine.step()`` as a torch optimizer, so that the recorder's step pre- and post-hooks run around it."""

    def __init__(self, engine: Any) -> None:
        self._engine_step = engine.step
        # torch's optimizer wants parameters; the hooks never read them
        super().__init__([torch.zeros(1, requires_grad=True)], {})

    def step(self, *args, **kwargs):  # noqa: D102 - DeepSpeed's step, hooked
        return self._engine_step(*args, **kwargs)


def record(
    engine: Any,
    trace_dir: str | os.PathLike,
    *,
    recipe: str,
    recipe_args: dict[str, Any] | None = None,
    options: Any = None,
    inject=(),
):
    """Records ``engine``'s steps to ``trace_dir``; every rank calls it after ``deepspeed.initialize``.

    Args:
        engine: the ``DeepSpeedEngine``.
        trace_dir: where the trace goes.
        recipe: ``module:attribute`` of the replay recipe (it rebuilds the module and a torch
            optimizer with the engine's settings; :func:`load_checkpoint` loads :func:`checkpoint`'s files).
        recipe_args, options, inject: as :class:`~sdc_forensics.recorder.Recorder`'s (drills:
            ``grad``, ``input``, ``checkpoint-file``).

    Returns:
        The :class:`~sdc_forensics.recorder.Recorder`: wrap each step in ``rec.step(...)``; from now
        on ``engine.step()`` runs the recorder's checks around DeepSpeed's step.

    Raises:
        Refusal: on every rank alike, what the replay cannot reproduce: one line on rank 0, exit 2 (a
            UsageError and a SystemExit, as the other adapters' refusals).
    """
    import deepspeed

    from sdc_forensics.recorder import Recorder
    from sdc_forensics.recorder.deepspeed_layout import DeepSpeedLayout

    proxy = _EngineStep(engine)
    try:
        rec = Recorder(
            trace_dir,
            DeepSpeedLayout(engine),
            proxy,
            recipe=recipe,
            recipe_args=recipe_args,
            options=options,
            inject=inject,
            framework={**framework_info("deepspeed", __name__), "version": deepspeed.__version__},
        )
    # every rank alike: one line on rank 0, exit 2, no traceback (docs/integrations.md, "Refusals")
    except UsageError as exc:
        raise refuse(str(exc)) from None
    own_step = engine.step

    def step(*args, **kwargs):
        # the recorder's checks run around the update, at the accumulation boundary; a microbatch
        # before it only counts in DeepSpeed (ZeRO 1 reduces at the boundary)
        if engine.is_gradient_accumulation_boundary():
            return proxy.step(*args, **kwargs)
        return own_step(*args, **kwargs)

    # the engine's own step, now through the hooked one (an attribute of this engine only)
    engine.step = step
    return rec


def full_state(engine: Any, step: int) -> dict[str, Any]:
    """``{"model", "optimizer", "step"}`` of ``engine``, whole, as a torch module and optimizer hold it.

    A collective (ZeRO's partitions are gathered): every rank calls it. The optimizer state is
    DeepSpeed's torch optimizer's, per parameter, in ``torch.optim.Optimizer.state_dict`` form
    (parameters numbered in model order, one group: the engine's first).
    """
    from deepspeed.utils import safe_get_full_optimizer_state

    from sdc_forensics.recorder.deepspeed_layout import gathered_parameters

    params = list(engine.module.parameters())
    with gathered_parameters(engine):
        model = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    # the flat partition's state: its scalars (AdamW's step) are every parameter's
    flat = next(iter(basic.state.values()), {})
    keys = [k for k, v in flat.items() if torch.is_tensor(v) and v.dim() > 0]
    scalars = {k: v.detach().clone() for k, v in flat.items() if k not in keys}
    state = {}
    if flat:
        for i, p in enumerate(params):
            # a scalar of its own per parameter: AdamW counts each parameter's step in place
            state[i] = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
            state[i].update({k: safe_get_full_optimizer_state(p, k).detach().clone() for k in keys})
    group = {k: v for k, v in basic.param_groups[0].items() if k != "params"}
    optimizer = {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}
    return {"model": model, "optimizer": optimizer, "step": int(step)}


def checkpoint(rec: Any, engine: Any, step: int, path: str | os.PathLike):
    """Checkpoint ``step`` (theta_step) of ``engine`` written to ``path`` through ``rec.checkpoint``
    (the replicas' vote, the note): :func:`full_state`, one ``torch.save`` file. A collective."""
    return rec.checkpoint(int(step), Path(path), state=full_state(engine, step))


@torch.no_grad()
def clip_grad_norm_(optimizer: torch.optim.Optimizer, max_norm: float, world_size: int) -> torch.Tensor:
    """DeepSpeed 0.19's ZeRO 1/2 gradient clipping, on the whole reduced gradients a replay holds.

    The recipe's ``before_step`` calls it with the DeepSpeed config's ``gradient_clipping`` and the
    job's data-parallel size (e.g. through ``recipe_args``). What ``DeepSpeedZeroOptimizer.step``
    does (``runtime/zero/stage_1_and_2.py``, fp32, no offload, default partitioning), per
    parameter group:

    1. the group's trainable parameters, flattened in order and zero-padded to a multiple of
       ``2 * world_size``, are cut into ``world_size`` equal partitions; rank ``r`` holds the
       pieces of the gradients that fall in partition ``r``;
    2. each rank: ``vector_norm`` of each piece in fp64 (``get_norm_dtype``), ``stack``,
       ``pow(2)``, ``sum``, then ``float()`` (``get_grad_norm_direct``);
    3. an fp32 all-reduce ``SUM`` of the ranks' partial sums (here in gloo's ring order,
       ``replay.env.ring_sum``; exact in any order at 2 ranks), then ``pow(0.5)``;
    4. the groups' norms: ``vector_norm`` of their stack (``combine_grad_norm_groups``);
    5. ``clip = clamp((norm + 1e-6) / max_norm, min=1)``, every gradient ``mul_(1. / clip)``
       (``unscale_and_clip_grads``, loss scale 1).

    Returns the total norm (fp32), DeepSpeed's ``engine.get_global_grad_norm()``.
    """
    from sdc_forensics.replay.env import ring_sum

    if world_size < 1 or not max_norm > 0:
        raise ValueError(f"clip_grad_norm_ needs world_size >= 1 and max_norm > 0, got {world_size} and {max_norm}")
    group_norms = []
    grads_of_groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            continue
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        grads_of_groups.append([p.grad for p in params if p.grad is not None])
        total = sum(g.numel() for g in grads)
        alignment = 2 * world_size
        size = math.ceil(total / alignment) * alignment // world_size
        partials = []
        for rank in range(world_size):
            start, stop = rank * size, (rank + 1) * size
            norms, at = [], 0
            for g in grads:
                lo, hi = max(start, at), min(stop, at + g.numel())
                if lo < hi:
                    piece = g.reshape(-1)[lo - at : hi - at]
                    norms.append(torch.linalg.vector_norm(piece.to(torch.float64), ord=2.0))
                at += g.numel()
            partial = torch.stack(norms).pow(2.0).sum().float() if norms else torch.tensor(0.0)
            partials.append(partial.reshape(1))
        norm = ring_sum(partials).reshape(()).pow(1.0 / 2.0)
        # DeepSpeed's inf/NaN sentinel, which then makes the combined norm inf
        group_norms.append(torch.where(norm.isfinite(), norm, torch.tensor(-1.0)))
    if not group_norms:
        return torch.tensor(0.0)
    stacked = torch.stack(group_norms)
    combined = torch.linalg.vector_norm(stacked, ord=2.0)
    combined = torch.where(
        (~torch.isfinite(stacked) | (stacked < 0)).any(), torch.full_like(combined, math.inf), combined
    )
    clip = torch.clamp(((combined / 1.0) + 1e-6) / max_norm, min=1.0)
    scale = 1.0 / (clip * 1.0)
    for grads in grads_of_groups:
        for g in grads:
            g.mul_(scale)
    return combined


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The recipe's ``load_checkpoint`` of a :func:`checkpoint` file (no pickle executed)."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    if state["optimizer"]["state"]:
        optimizer.load_state_dict(state["optimizer"])
