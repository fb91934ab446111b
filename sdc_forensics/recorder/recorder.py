"""The recorder: per-rank, per-step trace and online checks inside a data-parallel training loop.

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

This module is the step protocol, written once: begin and end a step, digest its inputs, the
failure exchange in the optimizer's step pre-hook (every rank learns whether any rank failed to
read its gradients, with the numbers the checks compare), the audits, the alarms and the policy,
the weights vote in the step post-hook, the STEP record, checkpoints (``checkpointing.py``) and
close. What depends on how the model is spread over the ranks it asks its *layout* for
(``layout.py``, the contract): ``ddp_layout.py`` for ``DistributedDataParallel``,
``fsdp_layout.py`` for ``fully_shard`` (FSDP2, HSDP), chosen from the model by
:func:`make_layout`. Every check decides on gathered numbers, so all ranks raise (policy
``raise``) or continue together, and the trace is on disk before anything raises.

The host synchronisations a step costs (at most 5 with NCCL, 3 with gloo, none depending on the
number of buckets, parameters or microbatches) are listed in docs/recorder.md, "Host syncs per step".
Its own two gathers (``exchange.py``) block the step unless ``deferred_checks`` launches them in
the background and settles the step (checks, alarms, STEP record) when the next one begins.
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

from sdc_forensics.errors import SdcAlarm, UsageError
from sdc_forensics.fingerprint.core import warm_up
from sdc_forensics.inject import FaultSpec, Injector, parse_spec
from sdc_forensics.recipe import check_recipe_args
from sdc_forensics.recorder import checks, records
from sdc_forensics.recorder.audit import Auditor
from sdc_forensics.recorder.checkpointing import save_checkpoint, site_of, warn_unreplayable
from sdc_forensics.recorder.ddp_layout import DdpLayout
from sdc_forensics.recorder.exchange import Pending, WordExchange, digests_of, raise_if_failed
from sdc_forensics.recorder.exit import brace_for_alarm_exit
from sdc_forensics.recorder.fsdp_layout import FsdpLayout, is_fully_sharded
from sdc_forensics.recorder.identity import gather_identities
from sdc_forensics.recorder.layout import Job, Layout, local_tensor
from sdc_forensics.recorder.pp_layout import PpLayout, is_pipeline
from sdc_forensics.recorder.options import Policy, RecorderOptions
from sdc_forensics.recorder.rng_watch import RngWatch
from sdc_forensics.recorder.step import StepRecording, StepState, UnrecordedUpdates
from sdc_forensics.recorder.threads import ThreadWatch
from sdc_forensics.recorder.tp_layout import TpLayout, is_tensor_parallel, not_recorded
from sdc_forensics.trace import format as F
from sdc_forensics.trace.writer import RankTraceWriter

log = logging.getLogger(__name__)

#: the step state's old name (``tests/recorder/test_host_syncs.py`` builds one)
_StepState = StepState


def make_layout(model: Any, comm_hook: Callable | None = None, comm_state: Any = None) -> Layout:
    """The layout of ``model``: a Layout as is (DeepSpeed's), FSDP2/HSDP/TP for ``fully_shard``, or DDP."""
    if isinstance(model, Layout):
        return model
    if is_pipeline(model):
        return PpLayout(model, comm_hook, comm_state)
    if is_fully_sharded(model):
        return (TpLayout if is_tensor_parallel(model) else FsdpLayout)(model, comm_hook, comm_state)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DdpLayout(model, comm_hook, comm_state)
    raise UsageError(not_recorded(model))


class Recorder:
    """Records a data-parallel job's steps to ``trace_dir`` and runs the online checks.

    Args:
        trace_dir: where the trace goes (shared by all ranks; each rank writes its own file).
        ddp_model: the ``DistributedDataParallel`` model, a model sharded by ``fully_shard``
            (FSDP2, HSDP, with TP), or a pipeline schedule whose stage is (``pp_layout.py``). A DDP model's comm hook is registered here: pass a custom hook as
            ``comm_hook`` instead of registering it yourself.
        optimizer: the optimizer whose ``step()`` ends each training step.
        recipe: ``module:attribute`` of the replay recipe (recorded for ``bisect``; audits use it
            to fetch and recompute microbatches).
        recipe_args: the job's settings the recipe needs to rebuild it (``{"width": 256,
            "seed": 3}``): JSON values, written into the manifest and passed to the recipe as
            keyword arguments at replay and in audits (``sdc_forensics.recipe.load_recipe``).
        options: :class:`RecorderOptions`.
        comm_hook, comm_state: a DDP job's own comm hook and state (default: DDP's mean
            all-reduce). The recorder registers its hook on the model and calls yours from it; a
            model that already has a hook is refused.
        inject: fault specs (``sdc_forensics.inject``) for drills and tests.
        framework: the training framework whose adapter built this Recorder (``{"name":
            "transformers", "version": ..., "adapter": "sdc_forensics.integrations.hf"}``),
            written into the manifest for ``inspect``; None for a hand-written loop.

    Every check is made, on every rank, before anything is written: a Recorder that fails to
    attach leaves no manifest and no rank file behind (the next attempt is not renumbered).

    Raises:
        UsageError: neither a DDP nor a ``fully_shard`` model, process group not initialised, bad
            node map, bad ``recipe_args``, a comm hook already registered on the model, or what
            the model's layout cannot record.
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        ddp_model: torch.nn.Module,
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
        self.layout = make_layout(ddp_model, comm_hook, comm_state)
        if isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            self.ddp = ddp_model
        self._setup(
            trace_dir,
            optimizer,
            recipe=recipe,
            recipe_args=recipe_args,
            options=options,
            inject=inject,
            framework=framework,
        )
        # every rank's identity and what it found wrong, in one collective: all ranks refuse together
        problem = self.layout.validate(self._job()) or Auditor.refusal(self)
        self.identities, self.nodes = gather_identities(
            self.rank, self.device, self.group, problem, self.options.node_of_rank
        )
        declared = self.layout.declared_grad_dtype()
        if self.options.grad_dtype is None and declared:
            self.options = dataclasses.replace(self.options, grad_dtype=declared)
        self.layout.install(self._job())
        # the manifest's notes of the layout: its mesh, the collective its gradients go through
        self.mesh = self.layout.mesh
        self._comm_hook_name = self.layout.comm_hook_name
        self._open_trace()

    def _setup(
        self, trace_dir, optimizer: torch.optim.Optimizer, *, recipe, recipe_args, options, inject, framework
    ) -> None:
        """What the recorder holds, checked before anything is written."""
        if not dist.is_initialized():
            raise UsageError(
                "torch.distributed is not initialised: call init_process_group before creating the Recorder"
            )
        self.options = options or RecorderOptions()
        self.trace_dir = Path(trace_dir)
        self.module = self.layout.module
        self.optimizer = optimizer
        self.recipe_ref = recipe
        self.recipe_args = None if recipe_args is None else check_recipe_args(recipe_args)
        self.framework = (
            None if framework is None else {k: str(framework.get(k, "")) for k in ("name", "version", "adapter")}
        )
        if (self.options.audit_every or self.options.audit_steps) and recipe is None:
            raise UsageError(
                "audits recompute microbatches through the replay recipe: pass recipe='module:attribute' to the Recorder"
            )
        if recipe_args is not None and recipe is None:
            raise UsageError("recipe_args are handed to the replay recipe: pass recipe='module:attribute' with them")
        self.group = self.layout.group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.params = list(self.module.parameters())
        self.device = local_tensor(self.params[0]).device if self.params else torch.device("cpu")
        self.exchange = WordExchange(self.group, self.world_size, self.device)
        # a step whose exchanges were launched in the background (deferred_checks), not yet resolved
        self._unsettled: StepState | None = None
        # compile (or load from numba's disk cache) the fingerprint kernel now, not in step 1's hook
        warm_up(
            self.device,
            dtypes=sorted({p.dtype for p in self.params if p.is_floating_point()}, key=str) or (torch.float32,),
        )
        self.injector = Injector(
            [s if isinstance(s, FaultSpec) else parse_spec(s, self.layout.locations) for s in inject or ()], self.rank
        )
        self.alarms: list[checks.Finding] = []
        # (step, own weights digest, vote) of the last replica comparison: a checkpoint of
        # theta_{step+1} written right after it reuses the vote instead of voting again
        self.last_weights_vote: tuple[int, int, checks.Majority] | None = None
        self._state: StepState | None = None
        self._layouts: list[dict] = []
        self.threads, self.unrecorded = ThreadWatch(self.rank, self.module), UnrecordedUpdates(self.rank)
        # the first step this attempt began (checkpoint advice); whether it saved a checkpoint yet
        self._first_step: int | None = None
        self._checkpointed = False
        # STEP records of this attempt, and the last one's step (END record)
        self._steps_written = 0
        self._last_step_written = self.options.start_step

    def _job(self) -> Job:
        return Job(
            options=self.options,
            rank=self.rank,
            world_size=self.world_size,
            group=self.group,
            params=self.params,
            device=self.device,
            injector=self.injector,
            current=lambda: self._state,
        )

    def _open_trace(self) -> None:
        """Number the attempt, write the manifest, open this rank's file and hook the optimizer."""
        self.attempt = records.start_attempt(
            self.trace_dir, self.rank, self.group, lambda attempt: records.manifest_of(self, attempt)
        )
        self.writer = RankTraceWriter(
            self.trace_dir,
            rank=self.rank,
            attempt=self.attempt,
            world_size=self.world_size,
            sketch_k=self.options.sketch_k,
            seed=self.options.seed,
            fsync=self.options.fsync,
        )
        self.rng_watch = RngWatch(self.rank, self.device)
        self.auditor = Auditor(
            recipe=self.recipe_ref,
            recipe_args=self.recipe_args,
            options=self.options,
            rank=self.rank,
            nodes=self.nodes,
            group=self.group,
            device=self.device,
        )
        self._handles = [
            # first: before an audit's recomputation draws
            self.optimizer.register_step_pre_hook(self.rng_watch.check),
            self.optimizer.register_step_pre_hook(self._before_update),
            self.optimizer.register_step_post_hook(self._after_update),
            self.threads.autocast.handle,
        ]

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
        self._settle()
        state = StepState(
            step=int(step), ids=tuple(int(i) for i in microbatch_ids) if microbatch_ids is not None else None
        )
        if self._first_step is None:
            self._first_step = state.step
        self._state = state
        self.rng_watch.begin(state.step)
        if self.injector:
            with torch.no_grad():
                self.injector.corrupt_tensors("weights", state.step, [local_tensor(p).data for p in self.params])
        self.layout.begin_step(state)
        return StepRecording(state, self.injector, self.options.seed)

    def end_step(self) -> None:
        """Write the STEP record of the current step."""
        state = self._require_state()
        if not state.written and state.pending is None:
            self._write_step(state)
        self._abandon_step()

    def _abandon_step(self) -> None:
        if self._state is not None and self._state.pending is not None:
            self._unsettled = self._state
        self._state = None
        self.layout.end_step()

    def _require_state(self) -> StepState:
        if self._state is None:
            raise UsageError("no step in progress: wrap the step in `with recorder.step(step, ...)`")
        return self._state

    # ---------------------------------------------------------------- optimizer hooks
    def _before_update(self, optimizer, args, kwargs) -> None:
        """The gradients read, exchanged with every rank's (the failure exchange), checked, audited."""
        state = self._state
        if state is None:
            return self.unrecorded()
        # backward is done: the count that computed the local gradient
        if not state.num_threads:
            state.num_threads = ThreadWatch.current()
        failure: BaseException | None = None
        try:
            self.layout.read_gradients(state)
            records.note_layout(self._layouts, state.step, self)
        except Exception as exc:  # noqa: BLE001 - the other ranks must learn it, or they wait forever
            failure = exc
        status = -1 if failure is not None else int(state.local is not None and state.reduced is not None)
        words = np.append(np.asarray(self.layout.words(state), dtype=np.int64), np.int64(status))
        # resolved when the next step begins (an audited step cannot wait: it is checked now)
        if self._defers(state):
            state.pending = Pending(words=self.exchange.launch(words), failure=failure)
            return None
        table = self.exchange.gather(words)
        raise_if_failed(table, failure, state.step)
        findings = self.layout.check(state, table[:, :-1], table[:, -1] > 0)
        if findings is not None:
            findings += self.auditor.audit_step(state, state.summed_loss, self.layout.audit_module, self.writer)
            self._react(state, findings)
        return None

    def _defers(self, state: StepState) -> bool:
        deferrable = getattr(self.layout, "deferrable", False)
        return self.options.deferred_checks and deferrable and not self.auditor.due(state.step)

    def _after_update(self, optimizer, args, kwargs) -> None:
        """The updated weights digested and, on the steps that compare them, voted."""
        state = self._state
        if state is None:
            return None
        if self.injector:
            with torch.no_grad():
                self.injector.corrupt_tensors("update", state.step, [local_tensor(p).data for p in self.params])
        state.weights = self.layout.weights()
        state.flags |= int(F.Flag.HAS_WEIGHTS)
        self.layout.settled(state.weights[0])
        if self.options.compares_weights(state.step) and state.pending is not None:
            state.pending.vote = self.exchange.launch_vote(state.weights[0], self.layout.replica_groups())
        elif self.options.compares_weights(state.step):
            findings, votes = self._vote_weights(state.step, state.weights[0])
            self._note_vote(state, votes)
            self._react(state, findings)
        return None

    def _note_vote(self, state: StepState, votes: list[checks.GroupVote]) -> None:
        self.last_weights_vote = (state.step, state.weights[0], checks.overall(votes, self.rank))
        state.flags |= int(F.Flag.WEIGHTS_CHECKED) | checks.own_weights_flag(votes, self.rank)

    def _settle(self, *, act: bool = True) -> None:
        """A deferred step's checks on what its background exchanges gathered: the same flags,
        alarms and STEP record as at once, a step later; the policy acts now (``act``: raise)."""
        state, self._unsettled = self._unsettled, None
        if state is None:
            return
        pending, state.pending = state.pending, None
        table, vote = pending.words.table(), pending.vote.table() if pending.vote is not None else None
        raise_if_failed(table, pending.failure, state.step)
        findings = self.layout.check(state, table[:, :-1], table[:, -1] > 0) or []
        if vote is not None:
            votes = checks.vote_within(digests_of(vote), self.layout.replica_groups())
            findings += self.layout.weights_findings(state.step, votes)
            self._note_vote(state, votes)
        self._react(state, findings, act=act)
        if not state.written:
            self._write_step(state)

    def _vote_weights(self, step: int, digest: int) -> tuple[list[checks.Finding], list[checks.GroupVote]]:
        """The weights vote after ``step`` within the layout's replica groups (a collective where they have replicas)."""
        votes = checks.vote_within(self.exchange.vote_digests(digest, groups := self.layout.replica_groups()), groups)
        return self.layout.weights_findings(step, votes), votes

    # ---------------------------------------------------------------- checks and alarms
    def _react(self, state: StepState | None, findings: list[checks.Finding], *, act: bool = True) -> None:
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
        if self.options.policy == Policy.RAISE and act:
            if state is not None and not state.written:
                self._write_step(state)
            raise checks.alarm_of(findings[0], self.identities, self.trace_dir)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(
        self, step: int, path: str | os.PathLike, state: Any, *, save: Callable[[Any, Path], None] | None = None
    ):
        """Save checkpoint ``step`` (it holds theta_step) after checking replica consensus.

        A collective: every rank calls it. Replica weight digests are compared first (the vote
        after step ``step - 1`` is reused); then the layout's saver writes the state: DDP's from
        a rank of the strict majority (rank 0 when it is in it), one file; a sharded job's from
        every rank, with ``torch.distributed.checkpoint`` (every rank passes its part of
        ``{"model": model.state_dict(), ...}``), its tensors digested as if whole. The digests
        are noted in ``TRACE_DIR/checkpoints/`` and every rank writes a CHECKPOINT record.
        Without a strict majority the checkpoint is refused: with policy ``raise`` nothing is
        saved and :class:`SdcAlarm` is raised; with ``continue`` it is saved but not blessed.

        Args:
            step: completed steps (checkpoint 0 is the initial state).
            path: file (DDP) or directory (a sharded job) to write.
            state: the payload; its tensors are digested exactly as saved.
            save: ``save(state, path)``; default ``torch.save`` (DDP) or
                ``torch.distributed.checkpoint.save`` (a sharded job).

        Returns:
            The :class:`~sdc_forensics.trace.checkpoints.CheckpointNote` (on every rank).
        """
        # the last step's vote, resolved: the checkpoint reuses it
        self._settle()
        if not self._checkpointed and self.rank == 0:
            first = self._first_step if self._first_step is not None else self.options.start_step
            warn_unreplayable(self.trace_dir, first, int(step))
        self._checkpointed = True
        site = site_of(self, vote=self._checkpoint_vote, react=lambda findings: self._react(None, findings))
        return save_checkpoint(site, int(step), Path(path), state, save)

    def _checkpoint_vote(self, step: int, digest: int) -> tuple[list[checks.Finding], checks.Majority]:
        findings, votes = self._vote_weights(step, digest)
        return findings, checks.overall(votes, self.rank)

    # ---------------------------------------------------------------- helpers
    #: the step's summed loss, read from the device once (:meth:`StepState.summed_loss`)
    _loss_value = staticmethod(StepState.summed_loss)

    def _write_step(self, state: StepState) -> None:
        # no optimizer step ran (no pre-hook): pull the inputs' digests, read its thread count now
        state.resolve_inputs()
        state.num_threads = state.num_threads or ThreadWatch.current()
        rec = records.step_record(self.writer, state)
        rec["aux_value"] = self.threads.note(state.step, state.num_threads, self.trace_dir, self.attempt)
        records.append_step(self.writer, rec, state)
        state.written = True
        self._steps_written += 1
        self._last_step_written = state.step

    def close(self, *, on_error: bool | None = None) -> None:
        """Remove the optimizer hooks and the layout's (DDP's comm hook becomes a pass-through)
        and end the trace file with its END record. Idempotent.

        Args:
            on_error: the training loop is ending on an exception; None (default): True when
                called while one propagates (from a ``finally`` block or an ``except`` clause).
                The END record says so; readers report the run as stopped early.
        """
        if on_error is None:
            on_error = sys.exc_info()[0] is not None
        deferred: BaseException | None = None
        # the last deferred step's checks and STEP record (its alarm raised after the trace ends)
        try:
            self._settle(act=not on_error)
        except Exception as exc:  # noqa: BLE001 - raised below, once the trace file is ended
            deferred, on_error = exc, True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.layout.uninstall()
        try:
            self.writer.finish(last_step=self._last_step_written, num_steps=self._steps_written, on_error=on_error)
        # the disk is gone: nothing more to say, and the caller's exception matters more
        except OSError as exc:
            log.warning("sdc-forensics: could not end the trace file %s: %s", self.writer.path, exc)
            self.writer.close()
        if deferred is not None:
            raise deferred

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
