"""The sharded layout: FSDP2's ``fully_shard`` on a 1-D mesh, and HSDP (replicate x shard).

``Recorder(trace_dir, model, optimizer)`` with a ``fully_shard`` model records through this
layout; the step protocol (``with rec.step(s) as h: ...``), the alarms, the trace files and the
commands that read them are the DDP job's. What a STEP record holds differs only where sharding
makes it (``docs/trace-format.md``, "Sharded jobs"; ``fsdp_tap.py`` for the flat vector ``g``):

* ``local_*`` is this rank's whole local gradient ``g_r``, read from its reduce-scatter inputs
  (``fsdp_tap.ReduceScatterTap``; on a torch without ``set_custom_reduce_scatter``, in each
  parameter group's ``post_backward``: ``fsdp_fallback.py``);
* ``reduced_*`` is this rank's *shard* of the reduced gradient as the reduction wrote it into
  ``.grad`` (read at the end of the backward, before the loop clips it: :meth:`_follow_backward`),
  and ``weights_*`` its shard of the updated weights; the ranks that hold the same shard (HSDP's
  replicas) must agree; a replay recomputes every rank's shard;
* ``aux_digest`` (flag ``REST_WEIGHTS``) is its weight shard when the step began.

Online, per step: the reduce-scatter and replica all-reduce checks and the NaN/Inf checks of
``fsdp_monitor`` (they name the rank and its mesh coordinates); the weights vote per shard across
replicas (HSDP with 3 or more replicas names the rank; 2 replicas detect without a vote); the vote
of the parameters every rank all-gathered for its forward (the consensus pure FSDP has); each
rank's weight shard at rest (digested when a step begins, against the last update's: FSDP gathers
it for everybody's forward); and audits (``audit_every``) on a whole copy of the model.

Checkpoints: ``checkpointing.ShardedSaver`` digests the sharded state as if whole, saves with
``torch.distributed.checkpoint`` (every rank its shards) and notes the digests that
``verify-checkpoint`` measures on the DCP directory, resharded or not.

Mixed precision: ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)`` is recorded (the
local gradient in the reduce dtype, as FSDP2 accumulates and reduces it; the mesh notes
``param_dtype``, ``reduce_dtype`` and each module's input and output casts, which
``replay/mixed.py`` applies to the recipe's model).
Not yet recorded (refused in one line): a float16 reduction with a custom divide factor, audits of
a mixed-precision job, a shard placement other than ``Shard(0)``, a mesh that is not the whole
world (FSDP with tensor parallelism: a layout of its own), a group reduce-scattered twice in a
step, and DDP's fault locations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import shards
from sdc_forensics.fingerprint.core import combine_digests
from sdc_forensics.inject import FSDP_LOCATIONS, LOCATIONS
from sdc_forensics.recorder import fsdp_fallback, fsdp_gathered
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checkpointing import Saver, ShardedSaver
from sdc_forensics.recorder.checks import Check, Finding, GroupVote
from sdc_forensics.recorder.fsdp_checks import rank_place
from sdc_forensics.recorder.fsdp_tap import (
    OrderedReduceScatter,
    ReduceScatterTap,
    casts,
    dtype_name,
    effective_dtype,
    flat_offsets,
    mesh_of,
    rank_runs,
)
from sdc_forensics.recorder.layout import Job, Layout
from sdc_forensics.recorder.options import Reduction
from sdc_forensics.recorder.step import StepState
from sdc_forensics.trace import format as F

log = logging.getLogger("sdc_forensics.recorder")

#: DDP's fault locations that have no meaning in a sharded job (the FSDP ones replace them)
_DDP_ONLY = ("grad", "allreduce", "allreduce-all")
#: the ordered reduce-scatter as the manifest has always named it (``fsdp_tap.OrderedReduceScatter``
#: now): the name is kept so that traces stay byte for byte what they were
_ORDERED_NAME = "sdc_forensics.recorder.fsdp_recorder.OrderedReduceScatter"


def is_fully_sharded(model: Any) -> bool:
    """Whether ``model`` is (or holds) an FSDP2 ``fully_shard`` module (by feature: torch without FSDP2 has none)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class FsdpLayout(Layout):
    """FSDP2 or HSDP (see the module); built by ``recorder.make_layout`` for a ``fully_shard`` model."""

    locations = LOCATIONS + FSDP_LOCATIONS

    @property
    def deferrable(self) -> bool:
        """``deferred_checks`` applies: the check's table goes with the words (not on the fallback's torch)."""
        return not self._fallback

    def __init__(self, model: torch.nn.Module, comm_hook: Any = None, comm_state: Any = None) -> None:
        if comm_hook is not None or comm_state is not None:
            raise UsageError(
                "comm_hook is DDP's: an FSDP2 job keeps its own reduce-scatter (set_custom_reduce_scatter "
                "before the Recorder), which the recorder wraps"
            )
        # no custom reduce-scatter to wrap: read the gradients in post_backward
        self._fallback = fsdp_fallback.wanted()
        fm.require_fsdp2(model, "the Recorder", custom_reduce_scatter=False)
        self.model = model
        self._orig_dtype: torch.dtype | None = None
        self._reduce_dtype: torch.dtype | None = None
        self._param_dtype: torch.dtype | None = None
        self._casts: tuple = ()
        self._mesh = None
        self.tap = None
        # the all-gather-output drills' and the gathered watch's forward hooks, the wrapped FSDP states
        self._handles: list = []
        self._wrapped_states: list = []
        # this rank's weight shard digest after the last update (or the checkpoint that saved it)
        self._last_update: int | None = None
        self._reduced_error: BaseException | None = None

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    @property
    def group(self) -> Any:
        return dist.group.WORLD

    @property
    def mesh(self):
        return self._mesh

    @property
    def comm_hook_name(self) -> str:
        return _ORDERED_NAME if self.job.options.reduction == Reduction.ORDERED else ""

    # ---------------------------------------------------------------- attaching
    def validate(self, job: Job) -> str | None:
        """What this rank cannot record (one line); reads the mixed-precision policy on the way."""
        options, model = job.options, self.model
        specs = list(getattr(job.injector, "specs", ()))
        wrong = sorted({s.location for s in specs if s.location in _DDP_ONLY})
        if wrong:
            return (
                f"fault location(s) {', '.join(wrong)} are DDP's; a sharded job's are "
                f"{', '.join(FSDP_LOCATIONS)}, weights, update, input"
            )
        if self._fallback:
            problem = fsdp_fallback.refusal(model, options.reduction == Reduction.ORDERED, specs)
            if problem:
                return problem
        dtypes = {p.dtype for p in job.params}
        if len(dtypes) > 1:
            return f"parameters of several dtypes ({', '.join(sorted(map(str, dtypes)))}): the recorder needs one"
        orig = next(iter(dtypes))
        computes, reduce = set(), set()
        for group in fm.param_groups(model):
            policy = getattr(group, "mp_policy", None)
            computes.add(effective_dtype(getattr(policy, "param_dtype", None), orig))
            reduce.add(getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None) or orig)
        if len(computes) > 1:
            return f"parameter groups compute in several dtypes ({', '.join(sorted(map(str, computes)))}): the recorder needs one"
        if len(reduce) > 1:
            return f"parameter groups reduce in several dtypes ({', '.join(sorted(map(str, reduce)))}): the recorder needs one"
        reduced_in = next(iter(reduce)) if reduce else None
        if reduced_in is not None and reduced_in not in (torch.float32, torch.bfloat16, torch.float16):
            return f"reduce_dtype {reduced_in}: the recorder records reductions in float32, bfloat16 or float16"
        if reduced_in == torch.float16 and any(
            getattr(g, "gradient_divide_factor", None) is not None for g in fm.param_groups(model)
        ):
            return (
                "a float16 reduction with set_gradient_divide_factor: FSDP2 then divides by factors the replay does not "
                "model; reduce in float32, or keep FSDP2's own factor"
            )
        compute = next(iter(computes)) if computes else orig
        if (options.audit_every or options.audit_steps) and (
            compute != orig or (reduced_in is not None and reduced_in != orig)
        ):
            return (
                "audits recompute a rank's microbatches on a whole copy of the model in the parameters' dtype; this "
                "job computes or reduces in another (MixedPrecisionPolicy): record without audit_every (the replay "
                "recomputes every rank as the job did)"
            )
        found = casts(model)
        if compute != orig:
            if orig != torch.float32 or compute not in (torch.bfloat16, torch.float16):
                return (
                    f"parameters in {orig} computed in {compute}: the recorder records float32 parameters computed in "
                    "bfloat16 or float16"
                )
            if found is None:
                return (
                    "this torch's fully_shard keeps each module's MixedPrecisionPolicy where the recorder cannot read it: "
                    "the replay could not cast as the job did; record without param_dtype"
                )
            self._param_dtype = compute
        self._casts = found or ()
        self._reduce_dtype = reduced_in
        self._orig_dtype = orig
        return None

    def _mixed(self) -> bool:
        """The gradient is recorded and reduced in another dtype than the parameters' (or computed in one)."""
        return self._reduce_dtype is not None and (
            self._reduce_dtype != self._orig_dtype or self._param_dtype is not None
        )

    def declared_grad_dtype(self) -> str | None:
        # the local gradient is recorded, and reduced, in this dtype (MixedPrecisionPolicy(reduce_dtype=...))
        return dtype_name(self._reduce_dtype) if self._mixed() else None

    def install(self, job: Job) -> None:
        self.job = job
        options, model = job.options, self.model
        specs = list(getattr(job.injector, "specs", ()))
        # what FSDP2 casts, replayed as it did; with a param_dtype, the replay casts the parameters too
        mesh = dataclasses.replace(mesh_of(model, job.world_size), casts=self._casts)
        if self._mixed():
            mesh = dataclasses.replace(
                mesh,
                reduce_dtype=dtype_name(self._reduce_dtype),
                param_dtype=dtype_name(self._param_dtype) if self._param_dtype else "",
            )
        self.grad_params = [p for p in job.params if p.requires_grad]
        index = {id(p): i for i, p in enumerate(self.grad_params)}
        groups = tuple(
            tuple(index[id(fp.sharded_param)] for fp in g.fsdp_params if id(fp.sharded_param) in index)
            for g in fm.param_groups(model)
        )
        # the reduce-scatters' buffers
        self._mesh = dataclasses.replace(mesh, groups=tuple(g for g in groups if g))
        self._grad_offsets = flat_offsets(self.grad_params)
        self._weight_offsets = flat_offsets(job.params)
        ordered = options.reduction == Reduction.ORDERED
        if self._fallback:
            self.tap = fsdp_fallback.PostBackwardTap(
                offsets=self._grad_offsets,
                mesh=self._mesh,
                sketch_k=options.sketch_k,
                seed=options.seed,
                start_step=options.start_step,
            )
        else:
            self.tap = ReduceScatterTap(
                offsets=self._grad_offsets,
                sketch_k=options.sketch_k,
                seed=options.seed,
                start_step=options.start_step,
                ordered_replicas=ordered and len(self._mesh.replicas()) > 1,
            )
        self.tap.place = rank_place(model)
        fsdp_specs = [str(s) for s in specs if s.location in FSDP_LOCATIONS and s.location != "all-gather-output"]
        if fsdp_specs:
            self.tap._inject = fm.spec_injector(fsdp_specs, lambda: self.tap.step)
        gathered = [s for s in specs if s.location == "all-gather-output"]
        if gathered:
            self._handles += fsdp_gathered.drill(_fsdp_modules(model), job, gathered)
        # after the drills: it digests what the forward computes with
        self._handles += fsdp_gathered.watch(_fsdp_modules(model), job)
        self._follow_backward()
        if self._fallback:
            self.tap.install(model)
        else:
            fm.install(model, self.tap, OrderedReduceScatter() if ordered else None)

    def _follow_backward(self) -> None:
        """The reduced gradient is fingerprinted where the collective left it: right after FSDP2's
        end-of-backward callback (``FSDPState._root_post_backward_final_callback``, which every
        state's pre-backward may queue: each is wrapped), once its reduce-scatters (and HSDP's
        all-reduce) are done and written into ``.grad``, before the job's loop clips or unscales
        them (as DDP's comm hook reads its bucket). A torch without that callback leaves it to the
        optimizer pre-hook, after any clipping."""
        for module in _fsdp_modules(self.model):
            fsdp_state = module._get_fsdp_state()
            original = getattr(fsdp_state, "_root_post_backward_final_callback", None)
            if original is None or not callable(original) or any(s is fsdp_state for s in self._wrapped_states):
                continue

            def callback(original=original, fsdp_state=fsdp_state) -> None:
                original()
                ctx = getattr(fsdp_state, "_state_ctx", None)
                # else FSDP2 has not finalised the gradients yet
                if getattr(ctx, "is_last_backward", True):
                    self._after_backward()

            # an instance attribute: queue_callback reads it
            fsdp_state._root_post_backward_final_callback = callback
            self._wrapped_states.append(fsdp_state)

    def _after_backward(self) -> None:
        """This rank's shard of the reduced gradient, as the reduction wrote it (a backward in
        which the tap saw this step's reduce-scatters, every trainable parameter with a gradient)."""
        state = self.job.current()
        if state is None or state.reduced is not None or not self.tap.recording or not self.tap.groups_reduced:
            return
        try:
            state.reduced = self._reduced_shard()
        except Exception as exc:  # noqa: BLE001 - said at the step's end, on every rank, never inside autograd
            self._reduced_error = exc

    def _reduced_shard(self):
        """This rank's shard of the reduced gradient (None while some trainable parameter has no gradient)."""
        grads = [(p.grad, self._grad_offsets[id(p)]) for p in self.grad_params if p.grad is not None]
        if len(grads) != len(self.grad_params):
            return None
        return shards.fingerprint_runs(rank_runs(grads), k=self.job.options.sketch_k, seed=self.job.options.seed)

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        # the class's method again
        for fsdp_state in self._wrapped_states:
            fsdp_state.__dict__.pop("_root_post_backward_final_callback", None)
        self._wrapped_states = []
        # the job's own reduce-scatter (and post_backward) again: a closed recorder costs nothing more
        try:
            if self.tap is not None:
                self.tap.uninstall(self.model) if self._fallback else fm.uninstall(self.model)
        except Exception as exc:  # noqa: BLE001 - closing must finish (the trace's END record) whatever FSDP2 holds
            log.warning("sdc-forensics: could not give the model its own reduce-scatter back: %s", exc)
        if self.tap is not None:
            self.tap.start(None)

    # ---------------------------------------------------------------- per step
    def begin_step(self, state: StepState) -> None:
        """The weight shard is digested now, before FSDP gathers it for the forward: a change at
        rest since the last update (which every rank then computes with) is seen on the rank that
        holds it."""
        self._reduced_error = None
        self.tap.start(state.step)
        state.rest_weights = self.weights()[0]

    def end_step(self) -> None:
        self.tap.start(None)

    def read_gradients(self, state: StepState) -> None:
        state.local = self.tap.local()
        if self._reduced_error is not None:
            raise self._reduced_error
        if state.local is None:
            state.reduced = None
        # no end-of-backward callback was seen: read now (after any clipping)
        elif state.reduced is None:
            state.reduced = self._reduced_shard()
        state.resolve_inputs()

    def buckets(self) -> list[list[int]]:
        """One bucket holding every gradient-carrying parameter in model order."""
        index = {id(p): i for i, p in enumerate(self.job.params)}
        return [[index[id(p)] for p in self.grad_params]]

    def seen_grad_dtype(self) -> str | None:
        # (a reduce_dtype already set it: the manifest has it)
        return dtype_name(self.grad_params[0].dtype) if self.grad_params else None

    def words(self, state: StepState) -> np.ndarray:
        """``[its shard changed at rest (0/1), digest of the parameters it gathered (0: none)]``,
        then the reduce-scatter check's two words (``FsdpMonitor.step_words``): one gather for both."""
        changed = int(
            self._last_update is not None and state.rest_weights is not None and self._last_update != state.rest_weights
        )
        digest = combine_digests(state.gathered) if state.gathered else 0
        gathered = digest - (1 << 64) if digest >= 1 << 63 else digest  # the uint64 as an int64 word
        if self.deferrable:  # the reduce-scatter check's table, all-reduced in the background from now
            self.tap.launch()
        monitor = [] if self._fallback else self.tap.step_words()
        return np.array([changed, gathered, *monitor], dtype=np.int64)

    def check(self, state: StepState, table: np.ndarray, has_grads: np.ndarray) -> list[Finding] | None:
        rank, mesh = self.job.rank, self._mesh
        result = self.tap.check(
            state.step, **({"reduced": state.reduced} if self._fallback else {"gathered": table[:, 2:4]})
        )
        if has_grads.all():
            state.flags |= int(F.Flag.HAS_GRADS)
        findings = []
        for bad in np.flatnonzero(table[:, 0]).tolist():
            findings.append(
                Finding(
                    check=Check.WEIGHTS,
                    step=state.step,
                    rank=bad,
                    flag=F.Flag.WEIGHTS_DIVERGED,
                    ranks=(bad,),
                    detail=f"rank {bad} ({mesh.where(bad)}): its weight shard changed at rest before step {state.step} "
                    "began, since the last update (or the checkpoint that saved it); every rank gathered it for this step's forward",
                )
            )
            if bad == rank:
                state.flags |= int(F.Flag.WEIGHTS_DIVERGED)
        findings += fsdp_gathered.vote(
            state, table[:, 1].view(np.uint64), rank, mesh, explained=bool(table[:, 0].any())
        )
        # the monitor's finer checks, reported as the recorder's (Check.family) with their flag
        for found in result.findings:
            findings.append(
                Finding(
                    check=found.check.family,
                    step=state.step,
                    rank=found.rank,
                    flag=found.check.flag,
                    ranks=(found.rank,),
                    detail=f"rank {found.rank} ({mesh.where(found.rank)}): {found.detail}",
                )
            )
            if found.rank == rank:
                state.flags |= int(found.check.flag)
        return findings

    def weights(self) -> tuple[int, float, int]:
        """This rank's shard of the weights: ``(digest, L2 norm, NaN/Inf count)``."""
        with torch.no_grad():
            fp = shards.fingerprint_runs(
                rank_runs((p, self._weight_offsets[id(p)]) for p in self.job.params), k=1, seed=self.job.options.seed
            )
        return fp.digest, float(fp.norm), int(fp.nonfinite)

    def settled(self, digest: int) -> None:
        # theta as updated (or saved): a change at rest before the next step begins shows against it
        self._last_update = digest

    def replica_groups(self) -> list[tuple[int, ...]]:
        return self._mesh.same_shard()

    def weights_findings(self, step: int, votes: list[GroupVote]) -> list[Finding]:
        findings = []
        for group, vote in votes:
            if len(group) < 2:
                continue
            shard = self._mesh.shard_of(group[0])
            if vote.value is None:
                findings.append(
                    Finding(
                        check=Check.WEIGHTS,
                        step=step,
                        rank=-1,
                        flag=F.Flag.NO_MAJORITY,
                        ranks=group,
                        detail=f"the {len(group)} replicas of shard {shard} (ranks {', '.join(map(str, group))}) hold different "
                        "weights and no strict majority: detected, but no vote can name the rank; a replay can",
                    )
                )
            elif vote.diverged:
                bad = vote.diverged
                findings.append(
                    Finding(
                        check=Check.WEIGHTS,
                        step=step,
                        rank=bad[0],
                        flag=F.Flag.WEIGHTS_DIVERGED,
                        ranks=bad,
                        detail=f"rank(s) {', '.join(map(str, bad))} ({self._mesh.where(bad[0])}) hold shard {shard} differently "
                        f"from the majority of its {len(group)} replicas",
                    )
                )
        return findings

    # ---------------------------------------------------------------- audits and checkpoints
    @contextlib.contextmanager
    def audit_module(self, recipe: Any):
        """A whole copy of the model at theta_s for an audit: the recipe's model with every
        parameter all-gathered (``full_tensor``, in model order on every rank: collectives) and this
        rank's buffers (FSDP2 keeps them per rank). It lives for the audit only: for its length
        every rank holds the whole model once more."""
        model = recipe.build(self.job.device)[0]
        with torch.no_grad():
            gathered = [
                (name, p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
                for name, p in self.model.named_parameters()
            ]
            params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
            missing = [name for name, full in gathered if name not in params or params[name].shape != full.shape]
            if missing:
                raise UsageError(
                    f"the recipe's model has no parameter {missing[0]!r} of the job's shape: audits recompute on "
                    "the recipe's model, which must be the job's, unsharded"
                )
            for name, full in gathered:
                params[name].copy_(full)
            for name, buf in self.model.named_buffers():
                if name in buffers and buffers[name].shape == buf.shape:
                    buffers[name].copy_(buf)
        trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
        try:
            yield model, [trainable]
        finally:
            del model, gathered

    def saver(self) -> Saver:
        return ShardedSaver(self._mesh.same_shard())
