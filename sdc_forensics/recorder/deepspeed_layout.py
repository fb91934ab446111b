"""The DeepSpeed layout: a ``DeepSpeedEngine`` under ZeRO stage 1, 2 or 3, recorded as whole replicas.

What the recorder asks of a layout (``layout.py``), for DeepSpeed's engine:

* the local gradient: a tensor hook on every parameter (it runs before autograd accumulates the
  gradient, so before any of ZeRO's own hooks copy it into a reduction bucket) keeps this rank's
  gradient and applies the ``grad`` drill to the gradient DeepSpeed goes on to reduce;
* the reduced gradient: ``deepspeed.utils.safe_get_full_grad`` of every parameter once the
  backward is over (in the optimizer pre-hook, which :mod:`sdc_forensics.integrations.deepspeed`
  runs at the start of ``engine.step()``): ZeRO holds the reduced gradient partitioned, and this
  gathers it whole, on every rank (a collective per parameter: a correctness-first read, not a
  cheap one);
* both are fingerprinted as one bucket holding every parameter that requires grad, in model order
  (the trace's layouts file says so), and checked with DDP's words and rules (``ddp_layout.py``):
  NaN/Inf, then the all-reduce check of the linear sketches and the reduced digests' vote;
* the weights after ``engine.step()``: the module's parameters, whole on every rank under ZeRO 1
  and 2, gathered (``deepspeed.zero.GatheredParameters``) under ZeRO 3; every rank votes.

Measured (``tests/integrations/test_deepspeed.py``, 2 ranks, fp32, torch's AdamW, no clipping):
under each of ZeRO 1, 2 and 3 the reduced gradient is bitwise ``g_0/2 + g_1/2`` and the update is
bitwise ``torch.optim.AdamW``'s on whole parameters, so the trace is a DDP trace that the ordinary
replay reproduces exactly.

Refused in one line, before anything is written (what the replay cannot reproduce):
fp16 or bf16 (ZeRO keeps fp32 master partitions the module does not hold), gradient accumulation
under ZeRO 2 and 3 (they reduce every micro-step, an order the replay does not model; ZeRO 1 reduces
the accumulated gradient once, at the boundary, and is recorded), unmanaged accumulation, gradient clipping
under ZeRO 3 (DeepSpeed's default 1.0: its norm is summed over partitions; set
``"gradient_clipping": 0.0``; under ZeRO 1 and 2 the recipe reproduces it with
``integrations.deepspeed.clip_grad_norm_``),
model or pipeline parallelism, and CPU or NVMe offload.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import core as fp_core
from sdc_forensics.fingerprint.core import combine
from sdc_forensics.recorder.checkpointing import Saver, WholeFileSaver
from sdc_forensics.recorder.ddp_layout import DdpLayout, _weights
from sdc_forensics.recorder.layout import Job, Layout
from sdc_forensics.recorder.step import StepState

#: where a drill may flip under DeepSpeed: the local gradient (in the tensor hook), a microbatch, a checkpoint file
DEEPSPEED_LOCATIONS = ("grad", "input", "checkpoint-file")


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (without importing DeepSpeed)."""
    return any(
        cls.__name__ == "DeepSpeedEngine" and cls.__module__.startswith("deepspeed") for cls in type(model).__mro__
    )


def engine_refusal(engine: Any) -> str | None:
    """What of ``engine``'s configuration the replay cannot reproduce, in one line (None: nothing)."""
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        return (
            "DeepSpeed fp16/bf16 training is not recorded: ZeRO updates fp32 master partitions the module does not "
            'hold; record an fp32 run (no "fp16"/"bf16" section)'
        )
    if not getattr(engine, "managed_gradient_accumulation", lambda: True)():
        return (
            '"managed_gradient_accumulation": false is not recorded: the recorder finds the update by DeepSpeed\'s '
            "micro-step counter; leave it at its default (true)"
        )
    if engine.gradient_accumulation_steps() != 1 and int(engine.zero_optimization_stage()) != 1:
        return (
            f"gradient_accumulation_steps={engine.gradient_accumulation_steps()} under ZeRO stage "
            f"{engine.zero_optimization_stage()} is not recorded: ZeRO 2 and 3 reduce every micro-step, an order the "
            "replay does not model; record with gradient_accumulation_steps 1, or under ZeRO 1 (it reduces at the boundary)"
        )
    if engine.gradient_clipping() > 0 and int(engine.zero_optimization_stage()) not in (1, 2):
        return (
            f"gradient_clipping={engine.gradient_clipping()} (DeepSpeed's default is 1.0) under ZeRO stage "
            f'{engine.zero_optimization_stage()} is not replayed (ZeRO 1 and 2 are); set "gradient_clipping": 0.0 '
            "in the DeepSpeed config to record this job"
        )
    zero = engine.optimizer
    if engine.gradient_clipping() > 0 and (
        getattr(zero, "round_robin_gradients", False) or getattr(zero, "parameter_alignment", False)
    ):
        return (
            f"gradient_clipping={engine.gradient_clipping()} with round_robin_gradients or parameter_alignment is not "
            "replayed: the norm's partitions would not be the flat ones integrations.deepspeed.clip_grad_norm_ cuts"
        )
    if engine.zero_optimization_stage() not in (0, 1, 2, 3):
        return f"ZeRO stage {engine.zero_optimization_stage()} is unknown here"
    if engine.zero_cpu_offload() or getattr(engine, "zero_nvme_offload_optimizer", lambda: False)():
        return (
            "ZeRO offload is not recorded: the update runs on the host's copy (DeepSpeed's CPU Adam); disable offload"
        )
    if dist.get_world_size() != engine.dp_world_size:
        return (
            f"the engine's data-parallel size {engine.dp_world_size} is not the world size {dist.get_world_size()}: "
            "model or pipeline parallelism under DeepSpeed is not recorded"
        )
    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if len(getattr(basic, "param_groups", ())) > 1:
        # full_state gathers one group; a second (the usual no-decay group) crashed the first checkpoint
        # under ZeRO 1 and 2 and was dropped from it under ZeRO 3 (a trial user's GPT)
        return (
            f"{len(basic.param_groups)} optimizer parameter groups under DeepSpeed are not recorded yet: the checkpoint "
            "would not hold each group's settings; record with one group (weight decay on every parameter)"
        )
    if not isinstance(basic, torch.optim.Optimizer) or type(basic).__module__.startswith("deepspeed"):
        return (
            f"DeepSpeed's {type(basic).__name__} is not replayed: use torch's optimizer "
            '("optimizer": {"type": "AdamW", "params": {"torch_adam": true, ...}}), or pass your torch optimizer'
        )
    return None


def gathered_parameters(engine: Any) -> contextlib.AbstractContextManager:
    """``engine``'s module parameters whole inside (ZeRO 3 gathers them: a collective, every rank alike)."""
    if int(engine.zero_optimization_stage()) < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


class _GradTap:
    """This rank's local gradient of one step, kept by a tensor hook per parameter."""

    def __init__(self, params: list[torch.nn.Parameter], job: Job) -> None:
        self.params = params
        self.job = job
        self.numels = [_numel(p) for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.total = sum(self.numels)
        self.step: int | None = None
        self.local: dict[int, torch.Tensor] = {}
        self.grad_dtype: str | None = None
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(params)]

    def _hook(self, i: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            step = self.step
            if step is None:
                return grad
            if self.job.injector:
                grad = grad.clone()
                self.job.injector.corrupt_segment("grad", step, grad.view(-1), self.offsets[i], self.total)
            kept = grad.detach().clone()
            # the step's next microbatch (gradient accumulation): its gradient adds, as autograd's does
            self.local[i] = kept if i not in self.local else self.local[i] + kept
            return grad

        return hook

    def start(self, step: int | None) -> None:
        self.step = step
        self.local = {}


def _numel(param: torch.nn.Parameter) -> int:
    # ZeRO 3 empties a partitioned parameter's data: its whole size is ds_numel
    return int(getattr(param, "ds_numel", param.numel()))


class DeepSpeedLayout(Layout):
    """A ``DeepSpeedEngine`` under ZeRO 1, 2 or 3 (see the module)."""

    locations = DEEPSPEED_LOCATIONS

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.tap: _GradTap | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def group(self) -> Any:
        return dist.group.WORLD

    @property
    def comm_hook_name(self) -> str:
        return f"deepspeed.zero.stage{self.stage}"

    def validate(self, job: Job) -> str | None:
        if str(getattr(job.options.reduction, "value", job.options.reduction)) == "ordered":
            # ZeRO reduces in its own buckets through its own collectives: the ordered reduction is
            # never applied, and a manifest saying "ordered" made the replay sum in that order (a
            # trial user's clean 4-rank ZeRO 2 job: "corruption in the collective" at step 0)
            return (
                "RecorderOptions(reduction='ordered') is not applied to DeepSpeed's reductions (ZeRO reduces in "
                "its own buckets); record with the default reduction"
            )
        return engine_refusal(self.engine)

    def install(self, job: Job) -> None:
        self.job = job
        self.trained = [p for p in job.params if p.requires_grad]
        self.index = [i for i, p in enumerate(job.params) if p.requires_grad]
        self.tap = _GradTap(self.trained, job)

    def uninstall(self) -> None:
        if self.tap is not None:
            for handle in self.tap.handles:
                handle.remove()
            self.tap.start(None)

    # ---------------------------------------------------------------- per step
    def begin_step(self, state: StepState) -> None:
        self.tap.start(state.step)

    def end_step(self) -> None:
        self.tap.start(None)

    def read_gradients(self, state: StepState) -> None:
        from deepspeed.utils import safe_get_full_grad

        tap, k, seed = self.tap, self.job.options.sketch_k, self.job.options.seed
        # every rank gathers every parameter (a collective each), whatever it saw in its own backward
        reduced = [safe_get_full_grad(p) for p in self.trained]
        missing = [self.index[i] for i, g in enumerate(reduced) if g is None or i not in tap.local]
        if missing:
            raise UsageError(
                f"rank {self.job.rank}: no gradient for parameter {missing[0]} at step {state.step}: "
                "call engine.backward(loss) inside rec.step(...), then engine.step()"
            )
        local_flat = torch.cat([tap.local[i].reshape(-1) for i in range(len(self.trained))])
        reduced_flat = torch.cat([g.detach().reshape(-1) for g in reduced])
        if tap.grad_dtype is None:
            tap.grad_dtype = str(reduced_flat.dtype).removeprefix("torch.")
        pending = [
            fp_core.fingerprint_async(local_flat, k=k, seed=seed, block_offset=0),
            fp_core.fingerprint_async(reduced_flat, k=k, seed=seed, block_offset=0),
        ]
        done = fp_core.resolve(pending + list(state.input_pending))
        state.local, state.reduced = combine(done[:1]), combine(done[1:2])
        state.resolve_inputs(done[2:])

    def buckets(self) -> list[list[int]]:
        return [list(self.index)] if self.tap is not None and self.tap.grad_dtype is not None else []

    def seen_grad_dtype(self) -> str | None:
        return self.tap.grad_dtype

    # DDP's words and checks, the one copy (they read self.job, self.tap.grad_dtype and the step's fingerprints)
    words = DdpLayout.words
    check = DdpLayout.check
    replica_groups = DdpLayout.replica_groups
    weights_findings = DdpLayout.weights_findings

    def weights(self) -> tuple[int, float, int]:
        with gathered_parameters(self.engine):
            return _weights(self.job.params, self.job.options.seed)

    # ---------------------------------------------------------------- audits and checkpoints
    @contextlib.contextmanager
    def audit_module(self, recipe: Any):
        """The engine's module at theta_s (gathered under ZeRO 3), one bucket of every trained parameter."""
        with gathered_parameters(self.engine):
            yield self.module, [list(self.index)]

    def saver(self) -> Saver:
        return WholeFileSaver()
