"""The recorder: per-rank, per-step trace and online checks inside a DDP training loop.

Attach it once, then wrap each optimizer step::

    rec = Recorder(trace_dir, ddp_model, optimizer, recipe="mytrain.recipe:recipe")
    for step in range(start, num_steps):
        with rec.step(step, microbatch_ids=ids) as s:
            for i, batch in enumerate(microbatches):
                with ddp_model.no_sync() if i < len(microbatches) - 1 else contextlib.nullcontext():
                    loss = loss_fn(ddp_model, s.input(batch))
                    loss.backward()
                s.loss(loss)
            optimizer.step()
            optimizer.zero_grad()
        if (step + 1) % every == 0:
            rec.checkpoint(step + 1, path, state={"model": model.state_dict(), ...})

Where each thing is measured: the comm hook (``hooks.py``) fingerprints the local and reduced
gradient; the optimizer's step pre-hook runs the NaN/Inf, all-reduce and audit checks before
the update (and reads the step's intra-op CPU thread count, ``threads.py``); the step post-hook
digests the updated weights and compares replicas; leaving the ``with`` block writes the STEP
record. Every check decides on gathered numbers, so all ranks raise (policy ``raise``) or
continue together, and the trace is on disk before anything raises.

Host syncs per step (device-to-host transfers that wait for the device; a model on CPU has
none), on a step without audit or checkpoint:

1. the optimizer pre-hook resolves every bucket's local and reduced fingerprints, and the
   digests of the step's inputs, in one ``resolve`` (the comm hook itself never syncs);
2. the check table's ``all_gather`` comes back to the host (NCCL only: gloo gathers host memory);
3. the post-hook resolves the weights' digest, norm and NaN/Inf count, one pass of the kernel
   per parameter and one ``resolve`` for all of them;
4. the replica vote's ``all_gather`` (NCCL only, on steps that compare weights: every step by
   default);
5. the summed loss, read once when the STEP record is written: the device has drained at 3,
   so it waits for nothing but what the caller queued since.

At most 5 with NCCL, 3 with gloo; none depends on the number of buckets, parameters or
microbatches. An audited step adds the audit's recomputation, a checkpoint its own digests.

Over 400 lines on purpose: one class, ``Recorder``, whose step protocol (enter, hook, exit, checks,
write) shares per-step state; the checks, hooks, records, checkpointing and audits are their own
modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcAlarm, SdcError, UsageError
from sdc_forensics.fingerprint import core as fp_core
from sdc_forensics.fingerprint.core import Fingerprint, PendingFingerprint, combine_digests, digests, warm_up
from sdc_forensics.inject import LOCATIONS, FaultSpec, Injector, parse_spec
from sdc_forensics.recorder import checks, ordered, records
from sdc_forensics.recorder.audit import AuditOutcome, OwnResult, inexact_reason, run_audit
from sdc_forensics.recorder.checkpointing import CheckpointSite, save_checkpoint
from sdc_forensics.recorder.exit import brace_for_alarm_exit
from sdc_forensics.recorder.hooks import LOSSY_HOOKS, BucketTap, compressed_dtype, hook_name
from sdc_forensics.recorder.identity import complete_identities, local_identity, make_attempt, node_map
from sdc_forensics.recorder.options import RecorderOptions
from sdc_forensics.recorder.rng_watch import RngWatch
from sdc_forensics.recorder.threads import ThreadWatch
from sdc_forensics.recipe import check_recipe_args
from sdc_forensics.reduction import ORDERED
from sdc_forensics.statedict import flatten_state
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import read_checkpoint_notes, unreplayable_steps, unreplayable_text
from sdc_forensics.trace.manifest import FingerprintSettings, audit_reach, write_manifest
from sdc_forensics.trace.writer import RankTraceWriter

log = logging.getLogger(__name__)

_HOOK_FIX = ("DDP takes one comm hook per model: do not register yours, pass it as Recorder(..., comm_hook=hook, comm_state=state) "
             "and the recorder wraps it (docs/recorder.md)")


def existing_hook_problem(ddp_model: torch.nn.parallel.DistributedDataParallel) -> str | None:
    """Why the recorder's comm hook cannot be registered on ``ddp_model`` (one line), or None.

    DDP allows one comm hook per model and says so only when the second is registered; by then
    a recorder would have written its manifest. Python hooks are listed in ``_comm_hooks``,
    built-in ones (``_register_builtin_comm_hook``) only in DDP's logging data.
    """
    hooks = list(getattr(ddp_model, "_comm_hooks", None) or ())
    if any(isinstance(getattr(hook, "__self__", None), BucketTap) for hook, _ in hooks):
        return ("this model already carries the comm hook of an earlier sdc-forensics Recorder: one Recorder per DDP model "
                "(keep using it, or wrap the module in a new DistributedDataParallel)")
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


def _is_fully_sharded(model) -> bool:
    """Whether ``model`` is (or holds) an FSDP2 ``fully_shard`` module (by feature: torch without FSDP2 has none)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (a plain tensor as it is)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and hasattr(tensor, "device_mesh") else tensor


def _refuse_together(problems: list) -> None:
    """Raise the first rank's problem on every rank (each has the gathered list)."""
    first = next((p for p in problems if p), None)
    if first is not None:
        raise UsageError(first)


@dataclasses.dataclass(kw_only=True)
class _StepState:
    step: int
    ids: tuple[int, ...] | None
    losses: list = dataclasses.field(default_factory=list)
    input_digests: list[int] = dataclasses.field(default_factory=list)
    input_pending: list[PendingFingerprint] = dataclasses.field(default_factory=list)  # off-CPU inputs, resolved with the hook's
    input_elements: int = 0
    flags: int = 0
    local: Fingerprint | None = None
    reduced: Fingerprint | None = None
    weights: tuple[int, float, int] | None = None  # digest, norm, nonfinite count
    rest_weights: int | None = None  # a sharded job: the rank's weight shard digest when the step began (aux_digest)
    gathered: list[int] = dataclasses.field(default_factory=list)  # a sharded job: digests of the parameters FSDP gathered
    audit: AuditOutcome | None = None
    num_threads: int = 0  # intra-op CPU threads the step ran with (0: not read yet)
    loss_value: float | None = None  # the summed loss, read from the device once
    loss_value_count: int = 0  # losses it sums
    written: bool = False


class StepRecording:
    """Handle of one step inside ``with rec.step(...)``: report inputs and losses through it."""

    def __init__(self, recorder: "Recorder", state: _StepState) -> None:
        self._recorder = recorder
        self._state = state

    @property
    def step(self) -> int:
        return self._state.step

    def input(self, microbatch: Any) -> Any:
        """Digest a microbatch the rank is about to consume (tensors in any nesting); returns it."""
        return self._recorder._on_input(self._state, microbatch)

    def loss(self, loss: torch.Tensor) -> None:
        """Report a microbatch's loss as ``backward()`` saw it (summed over the step in the trace)."""
        self._state.losses.append(loss.detach())

    def add_microbatch_ids(self, ids: Iterable[int]) -> None:
        """Append microbatch IDs learned during the step (a framework's dataloader hands the
        sample indices over with each batch, after the step began); recorded after those given
        to ``rec.step(microbatch_ids=...)``."""
        self._state.ids = (self._state.ids or ()) + tuple(int(i) for i in ids)


class Recorder:
    """Records a DDP job's steps to ``trace_dir`` and runs the online checks.

    Args:
        trace_dir: where the trace goes (shared by all ranks; each rank writes its own file).
        ddp_model: the ``DistributedDataParallel`` model. Its comm hook is registered here: pass a
            custom hook as ``comm_hook`` instead of registering it yourself.
        optimizer: the optimizer whose ``step()`` ends each training step.
        recipe: ``module:attribute`` of the replay recipe (recorded for ``bisect``; audits use it
            to fetch and recompute microbatches).
        recipe_args: the job's settings the recipe needs to rebuild it (``{"width": 256,
            "seed": 3}``): JSON values, written into the manifest and passed to the recipe as
            keyword arguments at replay and in audits (``sdc_forensics.recipe.load_recipe``).
        options: :class:`RecorderOptions`.
        comm_hook, comm_state: the job's own comm hook and state (default: DDP's mean all-reduce).
            The recorder registers its hook on the model and calls yours from it; a model that
            already has a hook is refused.
        inject: fault specs (``sdc_forensics.inject``) for drills and tests.
        framework: the training framework whose adapter built this Recorder (``{"name":
            "transformers", "version": ..., "adapter": "sdc_forensics.integrations.hf"}``),
            written into the manifest for ``inspect``; None for a hand-written loop.

    Every check is made, on every rank, before anything is written: a Recorder that fails to
    attach leaves no manifest and no rank file behind (the next attempt is not renumbered).

    Raises:
        UsageError: not a DDP model, process group not initialised, bad node map, bad
            ``recipe_args``, a comm hook already registered on the model.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "Recorder":
        """A ``fully_shard`` model gets the sharded job's recorder (``recorder/fsdp_recorder.py``)."""
        model = args[1] if len(args) > 1 else kwargs.get("ddp_model")
        if cls is Recorder and _is_fully_sharded(model):
            from sdc_forensics.recorder.fsdp_recorder import FsdpRecorder

            return super().__new__(FsdpRecorder)
        return super().__new__(cls)

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        ddp_model: torch.nn.parallel.DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        *,
        recipe: str | None = None,
        recipe_args: dict[str, Any] | None = None,
        options: RecorderOptions | None = None,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        inject: Iterable[FaultSpec | str] = (),
        framework: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise UsageError("Recorder needs the DistributedDataParallel-wrapped model, or a model sharded by fully_shard "
                             "(got a bare module?)")
        self.ddp = ddp_model
        self._setup(trace_dir, ddp_model.module, optimizer, group=getattr(ddp_model, "process_group", None) or dist.group.WORLD,
                    recipe=recipe, recipe_args=recipe_args, options=options, inject=inject, framework=framework)
        self._gather_identities(existing_hook_problem(ddp_model))
        if comm_hook is not None and hook_name(comm_hook) in LOSSY_HOOKS:  # every rank passes the same hook: all refuse alike
            raise UsageError(f"comm_hook {hook_name(comm_hook)} (PowerSGD) all-reduces a low-rank approximation of the gradient: "
                             "no check can tell its error from a fault, and no replay can reproduce it; record the job with "
                             "DDP's all-reduce or a dtype-compressing hook (fp16_compress_hook, bf16_compress_hook)")
        if comm_hook is not None and self.options.grad_dtype is None and compressed_dtype(comm_hook):
            # the tolerance of the all-reduce checks is that of the dtype it adds in, said without the user having to
            self.options = dataclasses.replace(self.options, grad_dtype=compressed_dtype(comm_hook))
        self._comm_hook_name = "" if comm_hook is None else f"{getattr(comm_hook, '__module__', '?')}.{getattr(comm_hook, '__qualname__', repr(comm_hook))}"
        self.tap = BucketTap(
            param_index={id(p): i for i, p in enumerate(self.params)},
            grad_numel=sum(p.numel() for p in self.params if p.requires_grad),
            sketch_k=self.options.sketch_k, seed=self.options.seed, injector=self.injector,
            inner_hook=_communicating_hook(comm_hook, self.options.reduction),
            inner_state=comm_state if comm_hook is not None else self.group,
        )
        problem = None
        try:  # before anything is written; the tap passes buckets through until the first step
            ddp_model.register_comm_hook(None, self.tap.hook)
        except RuntimeError as exc:
            problem = f"rank {self.rank}: DDP refused the recorder's comm hook ({' '.join(str(exc).split())}); {_HOOK_FIX}"
        problems: list = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        _refuse_together(problems)
        self._open_trace()

    def _setup(self, trace_dir, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, group, recipe, recipe_args,
               options, inject, framework, locations: tuple[str, ...] = LOCATIONS) -> None:
        """What every recorder holds, checked before anything is written (the DDP and the sharded one)."""
        if not dist.is_initialized():
            raise UsageError("torch.distributed is not initialised: call init_process_group before creating the Recorder")
        self.options = options or RecorderOptions()
        self.trace_dir = Path(trace_dir)
        self.module = module
        self.optimizer = optimizer
        self.recipe_ref = recipe
        self.recipe_args = None if recipe_args is None else check_recipe_args(recipe_args)
        self.framework = None if framework is None else {k: str(framework.get(k, "")) for k in ("name", "version", "adapter")}
        self._recipe = None
        if (self.options.audit_every or self.options.audit_steps) and recipe is None:
            raise UsageError("audits recompute microbatches through the replay recipe: pass recipe='module:attribute' to the Recorder")
        if recipe_args is not None and recipe is None:
            raise UsageError("recipe_args are handed to the replay recipe: pass recipe='module:attribute' with them")
        self.group = group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.params = list(self.module.parameters())
        self.device = _local(self.params[0]).device if self.params else torch.device("cpu")
        self._comm_device = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        # compile (or load from numba's disk cache) the fingerprint kernel now, not in step 1's hook
        warm_up(self.device, dtypes=sorted({p.dtype for p in self.params if p.is_floating_point()}, key=str) or (torch.float32,))
        self.injector = Injector([s if isinstance(s, FaultSpec) else parse_spec(s, locations) for s in inject], self.rank)
        self.alarms: list[checks.Finding] = []
        # (step, own weights digest, vote) of the last replica comparison: a checkpoint of
        # theta_{step+1} written right after it reuses the vote instead of voting again
        self.last_weights_vote: tuple[int, int, checks.Majority] | None = None
        self._state: _StepState | None = None
        self._layouts: list[dict] = []
        self.threads = ThreadWatch(self.rank)
        self._first_step: int | None = None  # the first step this attempt began (checkpoint advice)
        self._checkpointed = False  # a checkpoint was saved in this attempt (the first one is checked once)
        self._said_inexact = False  # the audits skipped for non-deterministic GPU kernels were said once
        self._steps_written = 0  # STEP records of this attempt, and the last one's step (END record)
        self._last_step_written = self.options.start_step
        self._comm_hook_name = ""
        self.mesh = None  # a sharded job's mesh (trace/mesh.py), written into the manifest

    def _gather_identities(self, problem: str | None) -> None:
        """Every rank's identity and what it found wrong, in one collective: all ranks refuse together."""
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (local_identity(self.rank, self.device), problem), group=self.group)
        _refuse_together([found for _, found in gathered])
        self.identities = complete_identities([identity for identity, _ in gathered])
        self.nodes = node_map(self.identities, self.options.node_of_rank)
        if len(self.nodes) != self.world_size:
            raise UsageError(f"node_of_rank has {len(self.nodes)} entries for {self.world_size} ranks")
        reach = audit_reach(self.nodes) if (self.options.audit_every or self.options.audit_steps) else None
        if reach is not None and self.rank == 0:  # once per job, at attach: not a silent no-op at every audited step
            log.warning("sdc-forensics: audits are on (audit_every=%d), but %s", self.options.audit_every, reach)

    def _open_trace(self) -> None:
        """Number the attempt, write the manifest, open this rank's file and hook the optimizer."""
        self.attempt = self._start_attempt()
        self.writer = RankTraceWriter(
            self.trace_dir, rank=self.rank, attempt=self.attempt, world_size=self.world_size,
            sketch_k=self.options.sketch_k, seed=self.options.seed, fsync=self.options.fsync,
        )
        self.rng_watch = RngWatch(self.rank, self.device)
        self._handles = [
            self.optimizer.register_step_pre_hook(self.rng_watch.check),  # first: before an audit's recomputation draws
            self.optimizer.register_step_pre_hook(self._before_update),
            self.optimizer.register_step_post_hook(self._after_update),
        ]

    # ---------------------------------------------------------------- attempt and manifest
    def _start_attempt(self) -> int:
        """Rank 0 numbers the attempt and writes the manifest; every rank learns the outcome."""
        outcome: list = [None, None]
        if self.rank == 0:
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                attempt = records.next_attempt(self.trace_dir)
                settings = FingerprintSettings(seed=self.options.seed, sketch_k=self.options.sketch_k, grad_dtype=self.options.grad_dtype or "float32")
                manifest = records.build_manifest(
                    self.trace_dir, world_size=self.world_size, settings=settings, recipe=self.recipe_ref, recipe_args=self.recipe_args,
                    framework=self.framework, checkpoint_every=self.options.checkpoint_every, audit_every=self.options.audit_every or None,
                    weights_every=self.options.weights_every, node_of_rank=self.nodes, parallel=self.mesh,
                    attempt=make_attempt(attempt, self.options.start_step, self.identities, device=self.device,
                                         backend=str(dist.get_backend(self.group)), reduction=self.options.reduction,
                                         comm_hook=self._comm_hook_name),
                )
                write_manifest(self.trace_dir, manifest)
                outcome = [attempt, None]
            except Exception as exc:  # noqa: BLE001 - every rank must learn it, not only rank 0
                outcome = [None, exc if isinstance(exc, UsageError) else UsageError(f"cannot write the trace manifest in {self.trace_dir}: {exc}")]
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(self.group, 0), group=self.group)
        if outcome[1] is not None:
            raise outcome[1]
        return int(outcome[0])

    # ---------------------------------------------------------------- step lifecycle
    @contextlib.contextmanager
    def step(self, step: int, *, microbatch_ids: Iterable[int] | None = None) -> Iterator[StepRecording]:
        """Record optimizer step ``step`` (forward, backward and ``optimizer.step()`` go inside)."""
        handle = self.begin_step(step, microbatch_ids=microbatch_ids)
        try:
            yield handle
        except BaseException:
            self._abandon_step()
            raise
        self.end_step()

    def begin_step(self, step: int, *, microbatch_ids: Iterable[int] | None = None) -> StepRecording:
        """Start step ``step`` (the explicit form of :meth:`step`)."""
        if self._state is not None:
            raise UsageError(f"step {self._state.step} was not ended before step {step} began; call end_step()")
        state = _StepState(step=int(step), ids=tuple(int(i) for i in microbatch_ids) if microbatch_ids is not None else None)
        if self._first_step is None:
            self._first_step = state.step
        self._state = state
        self.rng_watch.begin(state.step)
        self.tap.start(state.step)
        if self.injector:
            with torch.no_grad():
                self.injector.corrupt_tensors("weights", state.step, [_local(p).data for p in self.params])
        return StepRecording(self, state)

    def end_step(self) -> None:
        """Write the STEP record of the current step."""
        state = self._require_state()
        if not state.written:
            self._write_step(state)
        self._state = None
        self.tap.start(None)

    def _abandon_step(self) -> None:
        self._state = None
        self.tap.start(None)

    def _require_state(self) -> _StepState:
        if self._state is None:
            raise UsageError("no step in progress: wrap the step in `with recorder.step(step, ...)`")
        return self._state

    def _on_input(self, state: _StepState, microbatch: Any) -> Any:
        tensors = list(flatten_state(microbatch).values())
        if self.injector:
            state.input_elements += self.injector.corrupt_input(state.step, tensors, state.input_elements)
        if all(t.device.type == "cpu" for t in tensors):
            state.input_digests.extend(digests(tensors, self.options.seed))  # no device: the cheapest pass
        else:  # read now (stream-ordered), pulled to the host with the comm hook's fingerprints: no sync here
            self._resolve_inputs(state)  # keep the order of earlier CPU inputs
            state.input_pending.extend(
                fp_core.fingerprint_async(t, k=1, seed=self.options.seed) for t in tensors
            )
        return microbatch

    def _resolve_inputs(self, state: _StepState, resolved: list[Fingerprint] | None = None) -> None:
        """Move pending input digests into ``state.input_digests`` (``resolved``: already pulled)."""
        if not state.input_pending:
            return
        done = resolved if resolved is not None else fp_core.resolve(state.input_pending)
        state.input_digests.extend(fp.digest for fp in done)
        state.input_pending = []

    # ---------------------------------------------------------------- optimizer hooks
    def _before_update(self, optimizer, args, kwargs) -> None:
        state = self._state
        if state is None:
            return None
        if not state.num_threads:  # backward is done: the count that computed the local gradient
            state.num_threads = ThreadWatch.current()
        failure: BaseException | None = None
        try:
            inputs = state.input_pending
            state.local, state.reduced, done = self.tap.fingerprints(also=inputs)  # the step's one hook sync
            self._resolve_inputs(state, done)
            self._note_layout(state.step)
        except Exception as exc:  # noqa: BLE001 - the other ranks must learn it, or they wait forever
            failure = exc
        k = self.options.sketch_k
        words = np.zeros(2 * k + 6, dtype=np.int64)
        if failure is not None:
            words[2 * k + 5] = -1
        elif state.local is not None and state.reduced is not None:
            state.flags |= int(F.Flag.HAS_GRADS)
            words[:k] = state.local.sketch.astype(np.float64).view(np.int64)
            words[k : 2 * k] = state.reduced.sketch.astype(np.float64).view(np.int64)
            words[2 * k : 2 * k + 2] = np.array([state.local.norm, state.reduced.norm], dtype=np.float64).view(np.int64)
            words[2 * k + 2] = state.local.nonfinite
            words[2 * k + 3] = state.reduced.nonfinite
            words[2 * k + 4] = np.array([state.reduced.digest % (1 << 64)], dtype=np.uint64).view(np.int64)[0]
            words[2 * k + 5] = 1
        table = self._all_gather_words(words)  # (W, 2k + 6)
        if (table[:, 2 * k + 5] < 0).any():
            if failure is not None:
                raise failure
            failed = [int(r) for r in np.flatnonzero(table[:, 2 * k + 5] < 0)]
            raise SdcError(f"the recorder failed on rank(s) {', '.join(map(str, failed))} at step {state.step}; see their logs")
        if not table[:, 2 * k + 5].all():
            return None  # some rank had no gradient this step (no backward): nothing to compare
        findings = []
        nonfinite = checks.check_nonfinite(state.step, table[:, 2 * k + 2], table[:, 2 * k + 3])
        if nonfinite is not None:
            findings.append(nonfinite)
            if self.rank in nonfinite.ranks:
                state.flags |= int(nonfinite.flag)
        elif self.options.check_allreduce:
            as_float = table[:, : 2 * k + 2].copy().view(np.float64)
            finding, bad = checks.check_allreduce(
                state.step, as_float[:, :k], as_float[:, 2 * k], as_float[:, k : 2 * k], as_float[:, 2 * k + 1],
                table[:, 2 * k + 4].view(np.uint64), self.options.grad_dtype or self.tap.grad_dtype or "float32",
            )
            if finding is not None:
                findings.append(finding)
                if bad[self.rank]:
                    state.flags |= int(F.Flag.ALLREDUCE_MISMATCH)
        findings += self._audit_if_due(state)
        self._react(state, findings)
        return None

    def _audit_if_due(self, state: _StepState) -> list[checks.Finding]:
        """The audit of an audited step (a collective), or nothing."""
        if not self.options.audits(state.step):
            return []
        inexact = inexact_reason(self.device)  # the same on every rank: all skip, or none
        if inexact is None:
            return self._audit(state)
        if not self._said_inexact:
            self._said_inexact = True
            if self.rank == 0:
                log.warning("sdc-forensics: audits are on, but %s: they are skipped, not voted; make the run "
                            "replayable (sdc_forensics.recorder.replayable()) for audits that can name a rank", inexact)
        return []

    def _after_update(self, optimizer, args, kwargs) -> None:
        state = self._state
        if state is None:
            return None
        if self.injector:
            with torch.no_grad():
                self.injector.corrupt_tensors("update", state.step, [_local(p).data for p in self.params])
        state.weights = self._weights()
        state.flags |= int(F.Flag.HAS_WEIGHTS)
        self._after_weights(state)
        return None

    def _after_weights(self, state: _StepState) -> None:
        """The replicas' weights vote after the update (a sharded job votes per shard)."""
        if self.options.compares_weights(state.step):
            digests = self._all_gather_words(np.array([state.weights[0]], dtype=np.uint64).view(np.int64))[:, 0]
            finding, vote = checks.check_weights(state.step, digests.view(np.uint64))
            self.last_weights_vote = (state.step, state.weights[0], vote)
            state.flags |= int(F.Flag.WEIGHTS_CHECKED)
            if finding is not None:
                if vote.value is None:
                    state.flags |= int(F.Flag.NO_MAJORITY)
                elif self.rank in vote.diverged:
                    state.flags |= int(F.Flag.WEIGHTS_DIVERGED)
                self._react(state, [finding])
        return None

    # ---------------------------------------------------------------- checks and alarms
    def _audit(self, state: _StepState) -> list[checks.Finding]:
        if self._recipe is None:
            from sdc_forensics.recipe import load_recipe

            self._recipe = load_recipe(self.recipe_ref, args=self.recipe_args)
        own = OwnResult(
            ids=state.ids or (),
            loss=self._loss_value(state),
            digest=state.local.digest if state.local else 0,
            input_digest=combine_digests(state.input_digests) if state.input_digests else 0,
            num_threads=state.num_threads or ThreadWatch.current(),
        )
        with self._audit_module() as (module, layout):
            outcome = run_audit(
                step=state.step, own=own, module=module, recipe=self._recipe, layout=layout,
                nodes=self.nodes, group=self.group, device=self.device, sketch_k=self.options.sketch_k, seed=self.options.seed,
            )
        state.audit = outcome
        if outcome.audited_me:
            state.flags |= int(F.Flag.AUDITED)
        if outcome.disputed_me:
            state.flags |= int(F.Flag.AUDIT_MISMATCH)
        records.append_audits(self.writer, state.step, outcome.recomputations)
        return list(outcome.findings)

    @contextlib.contextmanager
    def _audit_module(self):
        """``(module, bucket layout)`` an audit recomputes with: DDP's own module, at theta_s."""
        yield self.module, self.tap.layout()

    def _react(self, state: _StepState | None, findings: list[checks.Finding]) -> None:
        """Record findings as ALARM records; raise if the policy says so (after writing the step, if any)."""
        if not findings:
            return
        for finding in findings:
            alarm = self.writer.new(F.Kind.ALARM, finding.step)
            alarm["flags"] = int(finding.flag)
            alarm["aux_rank"] = finding.rank
            alarm["aux_value"] = finding.value
            self.writer.append(alarm)
            self.alarms.append(finding)
            if self.rank == 0:
                log.warning("sdc-forensics: %s check fired at step %d: %s", finding.check, finding.step, finding.detail)
        if self.options.policy == "raise":
            if state is not None and not state.written:
                self._write_step(state)
            raise self._alarm(findings[0])

    def _alarm(self, finding: checks.Finding) -> SdcAlarm:
        ident = self.identities[finding.rank] if 0 <= finding.rank < self.world_size else None
        where = f"rank {finding.rank} on host {ident.host} ({ident.gpu})" if ident else "no single rank (see detail)"
        return SdcAlarm(
            f"{finding.check} check fired at step {finding.step}: {finding.detail}. Suspect: {where}. "
            f"The trace is in {self.trace_dir}; next, run: sdc-forensics bisect {self.trace_dir}",
            step=finding.step, rank=finding.rank, host=ident.host if ident else "", check=finding.check,
        )

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, step: int, path: str | os.PathLike, state: Any, *, save: Callable[[Any, Path], None] | None = None):
        """Save checkpoint ``step`` (it holds theta_step) after checking replica consensus.

        A collective: every rank calls it. Replica weight digests are compared first; the state
        is saved by a rank of the strict majority (rank 0 when it is in it), its per-tensor
        digests are noted in ``TRACE_DIR/checkpoints/``, and every rank writes a CHECKPOINT record.
        Without a strict majority the checkpoint is refused: with policy ``raise`` nothing is
        saved and :class:`SdcAlarm` is raised; with ``continue`` it is saved but not blessed.

        Args:
            step: completed steps (checkpoint 0 is the initial state).
            path: file to write.
            state: the payload (e.g. ``{"model": model.state_dict(), "optimizer": ...}``); its
                tensors are digested exactly as saved.
            save: ``save(state, path)``; default ``torch.save``.

        Returns:
            The :class:`~sdc_forensics.trace.checkpoints.CheckpointNote` (on every rank).
        """
        if not self._checkpointed:
            self._checkpointed = True
            self._check_first_checkpoint(int(step))
        site = CheckpointSite(module=self.module, seed=self.options.seed, policy=self.options.policy, rank=self.rank,
                              world_size=self.world_size, group=self.group, attempt=self.attempt, trace_dir=self.trace_dir,
                              writer=self.writer, injector=self.injector, last_weights_vote=self.last_weights_vote,
                              all_gather_words=self._all_gather_words, react=lambda findings: self._react(None, findings))
        return save_checkpoint(site, int(step), Path(path), state, save)

    def _check_first_checkpoint(self, step: int) -> None:
        """Say once, at the attempt's first checkpoint, when the steps before it can never be
        replayed: checkpoint ``N`` holds the state after ``N`` steps, so without a checkpoint of
        the attempt's first step nothing before ``N`` can be re-executed and no checkpoint of the
        run can be certified clean. (The recorder does not save the initial state itself: it
        knows neither where nor how the job saves, and a note without its file certifies nothing.)"""
        first = self._first_step if self._first_step is not None else self.options.start_step
        if step <= first or self.rank != 0:
            return
        try:
            noted = {note.step for note in read_checkpoint_notes(self.trace_dir)}  # a resumed attempt's start, saved earlier
        except SdcError:
            noted = set()
        gap = unreplayable_steps(first, noted | {step})
        if gap is not None:
            log.warning("sdc-forensics: %s", unreplayable_text(gap))

    # ---------------------------------------------------------------- helpers
    def _weights(self) -> tuple[int, float, int]:
        """``(digest, L2 norm, NaN/Inf count)`` of the parameters, from one pass and one host transfer.

        Each parameter's digest, sum of squares and NaN/Inf count come from the one-pass kernel
        (``k=1``: the sketch is not used); the digest equals ``weights_digest(named_parameters)``.
        """
        if not self.params:
            return combine_digests([]), 0.0, 0
        seed = self.options.seed
        with torch.no_grad():
            done = fp_core.resolve([fp_core.fingerprint_async(p, k=1, seed=seed) for p in self.params])
        value = combine_digests([fp.digest for fp in done])
        total = float(np.sqrt(sum(fp.norm * fp.norm for fp in done)))
        return value, total, int(sum(fp.nonfinite for fp in done))

    def _all_gather_words(self, words: np.ndarray) -> np.ndarray:
        """``(W, n)`` int64 table of every rank's ``(n,)`` words."""
        tensor = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64)).to(self._comm_device)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return torch.stack(out).cpu().numpy()

    @staticmethod
    def _loss_value(state: _StepState) -> float:
        """The step's summed loss (float64 sum of the microbatch losses in order): one transfer, kept."""
        if state.loss_value is None or state.loss_value_count != len(state.losses):
            values = torch.stack([loss.reshape(()).to(torch.float64) for loss in state.losses]).tolist() if state.losses else []
            state.loss_value, state.loss_value_count = float(sum(values)), len(state.losses)
        return state.loss_value

    def _note_layout(self, step: int) -> None:
        layout = self.tap.layout()
        if not layout or (self._layouts and self._layouts[-1]["buckets"] == layout):
            return
        self._layouts.append({"from_step": step, "buckets": layout})
        if self.rank == 0:
            records.write_layouts(self.trace_dir, self.attempt, self._layouts)
            if self.options.grad_dtype is None and self.tap.grad_dtype and len(self._layouts) == 1:
                records.update_grad_dtype(self.trace_dir, self.tap.grad_dtype)

    def _write_step(self, state: _StepState) -> None:
        self._resolve_inputs(state)  # no optimizer step ran (no pre-hook): pull them now
        rec = self.writer.new(F.Kind.STEP, state.step)
        rec["loss"] = self._loss_value(state)
        rec["input_digest"] = combine_digests(state.input_digests) % (1 << 64) if state.input_digests else 0
        if state.local is not None:
            records.fill_grads(rec, "local", state.local)
        if state.reduced is not None:
            records.fill_grads(rec, "reduced", state.reduced)
        if state.weights is not None:
            rec["weights_digest"], rec["weights_norm"], rec["nonfinite_weights"] = state.weights[0] % (1 << 64), state.weights[1], state.weights[2]
        if state.rest_weights is not None:
            rec["aux_digest"] = state.rest_weights % (1 << 64)
            rec["flags"] |= int(F.Flag.REST_WEIGHTS)
        rec["flags"] |= state.flags
        rec["aux_value"] = self._note_threads(state)
        records.append_with_ids(self.writer, rec, state.ids, state.step)
        state.written = True
        self._steps_written += 1
        self._last_step_written = state.step

    def _note_threads(self, state: _StepState) -> int:
        """The step's intra-op thread count (warns on a change); rank 0 puts the first into the manifest."""
        if not state.num_threads:  # no optimizer step ran inside this step
            state.num_threads = ThreadWatch.current()
        first = self.threads.first is None
        self.threads.observe(state.step, state.num_threads)
        if first and self.rank == 0:
            try:
                records.update_attempt_threads(self.trace_dir, self.attempt, state.num_threads)
            except (OSError, SdcError) as exc:  # a nicety: the STEP records hold the counts anyway
                log.warning("sdc-forensics: could not update num_threads in the manifest: %s", exc)
        return state.num_threads

    def close(self, *, on_error: bool | None = None) -> None:
        """Remove the optimizer hooks and end the trace file with its END record (the comm hook
        becomes a pass-through). Idempotent.

        Args:
            on_error: the training loop is ending on an exception; None (default): True when
                called while one propagates (from a ``finally`` block or an ``except`` clause).
                The END record says so; readers report the run as stopped early.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.tap.start(None)
        if on_error is None:
            on_error = sys.exc_info()[0] is not None
        try:
            self.writer.finish(last_step=self._last_step_written, num_steps=self._steps_written, on_error=on_error)
        except OSError as exc:  # the disk is gone: nothing more to say, and the caller's exception matters more
            log.warning("sdc-forensics: could not end the trace file %s: %s", self.writer.path, exc)
            self.writer.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, SdcAlarm):
            # on its way to exit_on_alarm (if the job uses it): a peer that exits first must not
            # have the launcher SIGTERM this rank while it closes the trace (every rank exits 18)
            brace_for_alarm_exit()
        self.close(on_error=exc_type is not None)
        if exc_type is None:
            # every rank done with the recorder's collectives before any rank goes on to tear the
            # group down (destroy_process_group, exit)
            dist.barrier(group=self.group)


def _communicating_hook(comm_hook: Callable | None, reduction: str) -> Callable | None:
    """The hook that really communicates: the job's own (None: DDP's mean all-reduce), its
    all-reduce carried out by the ordered reduction when ``reduction == "ordered"``."""
    if reduction != ORDERED:
        return comm_hook
    return ordered.compose(comm_hook) if comm_hook is not None else ordered.ordered_mean_hook
