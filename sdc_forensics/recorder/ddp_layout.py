"""The DDP layout: every rank a whole replica, its gradient read in DDP's comm hook.

What the recorder asks of a layout (``layout.py``), for ``DistributedDataParallel``:

* the gradients: the comm hook (``hooks.BucketTap``, registered here on the model, around the
  job's own hook if it passes one as ``comm_hook``) fingerprints each bucket before its
  all-reduce (``local``) and after (``reduced``); they are resolved with the step's input digests
  in one host transfer;
* the checks before the update: NaN/Inf in any rank's local or reduced gradient, then the
  all-reduce check (each rank's reduced sketch against the mean of every rank's local sketch,
  and the reduced digests' vote): ``checks.check_nonfinite`` and ``checks.check_allreduce`` on
  the gathered words;
* the weights: every parameter's digest, norm and NaN/Inf count in one kernel call over all
  parameters (on CPU; one pass per parameter on a GPU) and one host transfer; every rank votes in one group;
* audits recompute on the module itself; checkpoints are one file written by a rank of the
  majority (``checkpointing.WholeFileSaver``).

Refused in one line on every rank: a model that already carries a comm hook (DDP allows one,
and says so only when the second is registered), and PowerSGD's lossy hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.fingerprint import core as fp_core
from sdc_forensics.recorder import checks, ordered
from sdc_forensics.recorder.checkpointing import Saver, WholeFileSaver
from sdc_forensics.recorder.checks import Finding, GroupVote
from sdc_forensics.recorder.hooks import LOSSY_HOOKS, BucketTap, compressed_dtype, hook_name
from sdc_forensics.recorder.layout import Job, Layout, refuse_together
from sdc_forensics.recorder.options import Reduction
from sdc_forensics.recorder.step import StepState
from sdc_forensics.trace import format as F

_HOOK_FIX = (
    "DDP takes one comm hook per model: do not register yours, pass it as Recorder(..., comm_hook=hook, comm_state=state) "
    "and the recorder wraps it (docs/recorder.md)"
)


def existing_hook_problem(ddp_model: torch.nn.parallel.DistributedDataParallel) -> str | None:
    """Why the recorder's comm hook cannot be registered on ``ddp_model`` (one line), or None.

    DDP allows one comm hook per model and says so only when the second is registered; by then
    a recorder would have written its manifest. Python hooks are listed in ``_comm_hooks``,
    built-in ones (``_register_builtin_comm_hook``) only in DDP's logging data.
    """
    hooks = list(getattr(ddp_model, "_comm_hooks", None) or ())
    if any(isinstance(getattr(hook, "__self__", None), BucketTap) for hook, _ in hooks):
        return (
            "this model already carries the comm hook of an earlier sdc-forensics Recorder: one Recorder per DDP model "
            "(keep using it, or wrap the module in a new DistributedDataParallel)"
        )
    if hooks:
        name = getattr(hooks[0][0], "__qualname__", None) or type(hooks[0][0]).__name__
        return f"the model already has a DDP comm hook ({name}); {_HOOK_FIX}"
    try:
        builtin = ddp_model._get_ddp_logging_data().get("comm_hook", "")
    except Exception:  # noqa: BLE001 - private API; registration still refuses cleanly below
        builtin = ""
    if builtin:
        return f"the model already has a DDP comm hook ({builtin}); {_HOOK_FIX}"
    return None


def communicating_hook(comm_hook: Callable | None, reduction: Reduction) -> Callable | None:
    """The hook that really communicates: the job's own (None: DDP's mean all-reduce), its
    all-reduce carried out by the ordered reduction when ``reduction`` is ``ordered``."""
    if reduction != Reduction.ORDERED:
        return comm_hook
    return ordered.compose(comm_hook) if comm_hook is not None else ordered.ordered_mean_hook


class DdpLayout(Layout):
    """``DistributedDataParallel``: whole replicas, a comm hook per bucket (see the module)."""

    #: its checks may run a step later on what was gathered (``RecorderOptions.deferred_checks``):
    #: they read nothing but the step's state and the tap's dtype, no collective of their own
    deferrable = True

    def __init__(
        self,
        ddp_model: torch.nn.parallel.DistributedDataParallel,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
    ) -> None:
        self.ddp = ddp_model
        self._comm_hook = comm_hook
        self._comm_state = comm_state
        self.tap: BucketTap | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self.ddp.module

    @property
    def group(self) -> Any:
        return getattr(self.ddp, "process_group", None) or dist.group.WORLD

    @property
    def numerics(self) -> dict:
        # whether every rank starts a step from rank 0's buffers: then an exact replay reproduces
        # the buffers a checkpoint saves, and a difference is evidence (replay/buffers.py)
        return {"broadcast_buffers": bool(getattr(self.ddp, "broadcast_buffers", False))}

    @property
    def comm_hook_name(self) -> str:
        hook = self._comm_hook
        return "" if hook is None else f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"

    def validate(self, job: Job) -> str | None:
        problem = existing_hook_problem(self.ddp)
        # every rank passes the same hook: all refuse alike
        if problem is None and self._comm_hook is not None and hook_name(self._comm_hook) in LOSSY_HOOKS:
            problem = (
                f"comm_hook {hook_name(self._comm_hook)} (PowerSGD) all-reduces a low-rank approximation of the "
                "gradient: no check can tell its error from a fault, and no replay can reproduce it; record the "
                "job with DDP's all-reduce or a dtype-compressing hook (fp16_compress_hook, bf16_compress_hook)"
            )
        return problem

    def declared_grad_dtype(self) -> str | None:
        # the tolerance of the all-reduce checks is that of the dtype it adds in, said without the user having to
        return compressed_dtype(self._comm_hook) if self._comm_hook is not None else None

    def install(self, job: Job) -> None:
        self.job = job
        options = job.options
        self.tap = BucketTap(
            param_index={id(p): i for i, p in enumerate(job.params)},
            grad_numel=sum(p.numel() for p in job.params if p.requires_grad),
            sketch_k=options.sketch_k,
            seed=options.seed,
            injector=job.injector,
            inner_hook=communicating_hook(self._comm_hook, options.reduction),
            inner_state=self._comm_state if self._comm_hook is not None else job.group,
        )
        problem = None
        # before anything is written; the tap passes buckets through until the first step
        try:
            self.ddp.register_comm_hook(None, self.tap.hook)
        except RuntimeError as exc:
            problem = (
                f"rank {job.rank}: DDP refused the recorder's comm hook ({' '.join(str(exc).split())}); {_HOOK_FIX}"
            )
        problems: list = [None] * job.world_size
        dist.all_gather_object(problems, problem, group=job.group)
        refuse_together(problems)

    def uninstall(self) -> None:
        # DDP cannot take a comm hook back: the tap passes every bucket through from now on
        if self.tap is not None:
            self.tap.start(None)

    # ---------------------------------------------------------------- per step
    def begin_step(self, state: StepState) -> None:
        self.tap.start(state.step)

    def end_step(self) -> None:
        self.tap.start(None)

    def read_gradients(self, state: StepState) -> None:
        # the step's one hook sync: every bucket's fingerprints and the inputs' digests
        state.local, state.reduced, done = self.tap.fingerprints(also=state.input_pending)
        state.resolve_inputs(done)

    def buckets(self) -> list[list[int]]:
        return self.tap.layout()

    def seen_grad_dtype(self) -> str | None:
        return self.tap.grad_dtype

    def words(self, state: StepState) -> np.ndarray:
        """``[local sketch (k), reduced sketch (k), local and reduced norms, their NaN/Inf counts,
        reduced digest]`` (floats as their bits), zeros without both gradients."""
        k = self.job.options.sketch_k
        words = np.zeros(2 * k + 5, dtype=np.int64)
        if state.local is not None and state.reduced is not None:
            words[:k] = state.local.sketch.astype(np.float64).view(np.int64)
            words[k : 2 * k] = state.reduced.sketch.astype(np.float64).view(np.int64)
            words[2 * k : 2 * k + 2] = np.array([state.local.norm, state.reduced.norm], dtype=np.float64).view(np.int64)
            words[2 * k + 2] = state.local.nonfinite
            words[2 * k + 3] = state.reduced.nonfinite
            words[2 * k + 4] = np.array([state.reduced.digest % (1 << 64)], dtype=np.uint64).view(np.int64)[0]
        return words

    def check(self, state: StepState, table: np.ndarray, has_grads: np.ndarray) -> list[Finding] | None:
        options, rank, k = self.job.options, self.job.rank, self.job.options.sketch_k
        if has_grads[rank]:
            state.flags |= int(F.Flag.HAS_GRADS)
        # some rank had no gradient this step (no backward): nothing to compare
        if not has_grads.all():
            return None
        findings = []
        nonfinite = checks.check_nonfinite(state.step, table[:, 2 * k + 2], table[:, 2 * k + 3])
        if nonfinite is not None:
            findings.append(nonfinite)
            if rank in nonfinite.ranks:
                state.flags |= int(nonfinite.flag)
        elif options.check_allreduce:
            as_float = table[:, : 2 * k + 2].copy().view(np.float64)
            finding, bad = checks.check_allreduce(
                state.step,
                as_float[:, :k],
                as_float[:, 2 * k],
                as_float[:, k : 2 * k],
                as_float[:, 2 * k + 1],
                table[:, 2 * k + 4].view(np.uint64),
                options.grad_dtype or self.tap.grad_dtype or "float32",
            )
            if finding is not None:
                findings.append(finding)
                if bad[rank]:
                    state.flags |= int(F.Flag.ALLREDUCE_MISMATCH)
        return findings

    def weights(self) -> tuple[int, float, int]:
        return _weights(self.job.params, self.job.options.seed)

    def replica_groups(self) -> list[tuple[int, ...]]:
        return [tuple(range(self.job.world_size))]

    def weights_findings(self, step: int, votes: list[GroupVote]) -> list[Finding]:
        found = (checks.replica_weights_finding(step, vote, len(group)) for group, vote in votes)
        return [finding for finding in found if finding is not None]

    # ---------------------------------------------------------------- audits and checkpoints
    @contextlib.contextmanager
    def audit_module(self, recipe: Any):
        """DDP's own module, at theta_s, and this step's buckets."""
        yield self.module, self.tap.layout()

    def saver(self) -> Saver:
        return WholeFileSaver()


def _weights(params: list[torch.nn.Parameter], seed: int) -> tuple[int, float, int]:
    """``(digest, L2 norm, NaN/Inf count)`` of the parameters, from one pass and one host transfer.

    Each parameter's digest, sum of squares and NaN/Inf count come from the one-pass kernel
    (``k=1``: the sketch is not used), every parameter in one call of it on CPU; the digest
    equals ``weights_digest(named_parameters)``.
    """
    with torch.no_grad():
        return fp_core.weights_summary(params, seed)
