"""Recording a sharded job: FSDP2's ``fully_shard`` on a 1-D mesh, and HSDP (replicate x shard).

``Recorder(trace_dir, model, optimizer)`` with a ``fully_shard`` model builds this recorder; the
step protocol (``with rec.step(s) as h: ...``), the alarms, the trace files and the commands that
read them are the DDP recorder's. What a STEP record holds differs only where sharding makes it
(``docs/trace-format.md``, "Sharded jobs"): the model's gradient-carrying parameters, in model
order, are one flat vector ``g`` (a DDP trace with one bucket holding all of them), and

* ``local_*`` is this rank's whole local gradient ``g_r``, read from its reduce-scatter inputs
  (the rank's full unsharded gradient, cut into ``S`` chunks) as pieces placed by their index in
  ``g`` (``fingerprint/shards.py``): the same digest as a DDP trace's one-bucket local gradient, and
  what a replay on any number of devices recomputes;
* ``reduced_*`` is this rank's *shard* of the reduced gradient as the reduction wrote it into
  ``.grad`` (read at the end of the backward, before the loop clips it: ``_follow_backward``), and
  ``weights_*`` its shard of the updated weights (the parameters, all of them, as one flat vector
  likewise): ``shards.fingerprint_runs`` of the elements it holds, at their places. The ranks that
  hold the same shard (HSDP's replicas) must agree; a replay recomputes every rank's shard.

Online, per step: the reduce-scatter and replica all-reduce checks and the NaN/Inf checks of
``fsdp_monitor`` (they name the rank and its mesh coordinates), and the weights vote per shard
across replicas (HSDP with 3 or more replicas names the rank; 2 replicas detect without a vote),
the vote of the parameters every rank all-gathered for its forward (the consensus pure FSDP has),
each rank's weight shard at rest (digested when a step begins, against the last update's: FSDP
gathers it for everybody's forward), and audits (``audit_every``) on a whole copy of the model.

``RecorderOptions(reduction="ordered")`` replaces the reduce-scatter by an ordered one (an all-to-all, then ``reduction.ordered_mean`` in rank order) and,
in HSDP, redoes the replicas' all-reduce as the ``ordered_mean`` of their outputs in replica order,
so that a replay reproduces the reduced gradient bit for bit on any device and mesh.

Checkpoints: :meth:`FsdpRecorder.checkpoint` digests the sharded state as if whole
(``fsdp_checks.sharded_state_digests``: the pieces' terms are gathered, not the data), votes the
weight shards, saves with ``torch.distributed.checkpoint`` (every rank its shards) and notes the
digests that ``verify-checkpoint`` measures on the DCP directory, resharded or not.

Mixed precision: ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)`` is recorded (the
local gradient in the reduce dtype, as FSDP2 accumulates and reduces it; the mesh notes
``param_dtype``, ``reduce_dtype`` and each module's input and output casts, which
``replay/mixed.py`` applies to the recipe's model).
Audits (``audit_every``) recompute another rank's microbatches on a whole copy of the model, built
by the recipe and filled by all-gathering the parameters (``_audit_module``), as DDP's do.
A float16 reduction is recorded as FSDP2 runs it (the input divided by a pre-factor, summed, divided
by a post-factor: ``ShardMesh.divide_factors``).
Not yet recorded (refused in one line): a float16 reduction with a custom divide factor, audits of
a mixed-precision job, a
shard placement other than ``Shard(0)``, a mesh that is not the whole world (FSDP with tensor
parallelism), a group reduce-scattered twice in a step, and DDP's fault locations.

Over 400 lines on purpose: the tap that reads the reduce-scatter, the ordered collectives, the
per-step record, the shard vote and the DCP checkpoint are one recorder's view of one mesh and one
flat layout of the parameters; split, the rule placing a piece of a shard in the whole would be
repeated in every part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcError, UsageError
from sdc_forensics.fingerprint import shards
from sdc_forensics.fingerprint.core import Fingerprint, combine_digests
from sdc_forensics.inject import FSDP_LOCATIONS, LOCATIONS, FaultSpec
from sdc_forensics.recorder import checks, records
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checkpointing import path_from_trace
from sdc_forensics.recorder.recorder import Recorder
from sdc_forensics.recorder.threads import ThreadWatch
from sdc_forensics.reduction import ORDERED, ordered_mean, ordered_sum
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, hex64, write_checkpoint_note
from sdc_forensics.trace.mesh import ShardMesh

log = logging.getLogger("sdc_forensics.recorder")

#: DDP's fault locations that have no meaning in a sharded job (the FSDP ones replace them)
_DDP_ONLY = ("grad", "allreduce", "allreduce-all")
#: the online check's names -> the trace flag and the recorder's check name
_FLAGS = {"nonfinite-before": (F.Flag.NONFINITE_LOCAL, "nonfinite"), "nonfinite-after": (F.Flag.NONFINITE_REDUCED, "nonfinite"),
          "reduce-scatter": (F.Flag.ALLREDUCE_MISMATCH, "allreduce"), "all-reduce": (F.Flag.ALLREDUCE_MISMATCH, "allreduce")}


def mesh_of(model: torch.nn.Module, world_size: int) -> ShardMesh:
    """The mesh the model's parameters are sharded on, with every rank's coordinates."""
    sharded = [p for p in model.parameters() if hasattr(p, "device_mesh")]
    if not sharded:
        raise UsageError("no parameter of this model is sharded (no DTensor): call fully_shard on it before the Recorder")
    mesh, placements = sharded[0].device_mesh, tuple(sharded[0].placements)
    layout = mesh.mesh.cpu()
    if layout.numel() != world_size:
        raise UsageError(f"the model is sharded on a mesh of {layout.numel()} ranks in a job of {world_size}: the recorder "
                         "records data parallelism over the whole world (FSDP or HSDP), not FSDP combined with tensor or "
                         "pipeline parallelism")
    shard_dims = [i for i, p in enumerate(placements) if hasattr(p, "dim")]
    if len(shard_dims) != 1 or placements[shard_dims[0]].dim != 0:
        raise UsageError(f"parameters placed as {placements}: the recorder records FSDP2's Shard(0) (and HSDP's Replicate, "
                         "Shard(0)); pass no shard_placement_fn to fully_shard")
    if layout.dim() > 2:
        raise UsageError(f"the model is sharded on a {layout.dim()}-D mesh: the recorder records FSDP (1-D) and HSDP "
                         "(replicate x shard)")
    if layout.shape[shard_dims[0]] == 1:
        raise UsageError("the shard dimension of the mesh has size 1: FSDP2 then reduce-scatters nothing (each rank holds "
                         "whole parameters, replicated); record such a job as DDP")
    coords: list = [None] * world_size
    for index in np.ndindex(*layout.shape):
        coords[int(layout[index])] = tuple(int(i) for i in index)
    names = tuple(mesh.mesh_dim_names or ("",) * layout.dim())
    return ShardMesh(kind="fsdp" if layout.dim() == 1 else "hsdp", shape=tuple(layout.shape), dim_names=names,
                     shard_dim=shard_dims[0], coords=tuple(coords))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _effective(param_dtype: torch.dtype | None, orig: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 computes a floating-point parameter in (``FSDPParam.init_dtype_attrs``)."""
    return orig if param_dtype is None or not orig.is_floating_point else param_dtype


def _casts(model: torch.nn.Module) -> tuple[tuple[str, str, str], ...] | None:
    """``(module name, inputs dtype, outputs dtype)`` for every ``fully_shard`` module whose policy
    casts its forward inputs (``cast_forward_inputs`` with a ``param_dtype``) or outputs
    (``output_dtype``); None where a module's policy cannot be read."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
        if policy is None:
            return None
        inputs = policy.param_dtype if policy.cast_forward_inputs and policy.param_dtype is not None else None
        outputs = policy.output_dtype
        if inputs is not None or outputs is not None:
            out.append((name, _name(inputs) if inputs is not None else "", _name(outputs) if outputs is not None else ""))
    return tuple(out)


def flat_offsets(params: Iterable[torch.Tensor]) -> dict[int, int]:
    """``{id(param): index of its first element}`` in the flat vector of ``params`` (full sizes)."""
    out, offset = {}, 0
    for param in params:
        out[id(param)] = offset
        offset += param.numel()  # a DTensor's numel is its global one
    return out


def rank_runs(tensors: Iterable[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """``(this rank's elements, their index in the flat vector)`` of ``(tensor, its offset)`` pairs
    (a DTensor gives its local shard at its global place, a plain tensor itself)."""
    runs = []
    for tensor, offset in tensors:
        values, first = shards.local_piece(tensor)
        runs.append((values, offset + first))
    return runs


class OrderedReduceScatter:
    """A reduce-scatter any replay reproduces: an all-to-all, then the chunks added in rank order
    (``reduction.ordered_mean`` for ``AVG``, ``ordered_sum`` for ``SUM``), elementwise."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        size = group.size()
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        parts = received.view(size, -1).unbind(0)
        if op == dist.ReduceOp.AVG:
            ordered_mean(parts, out=output_tensor)
        elif op == dist.ReduceOp.SUM:
            ordered_sum(parts, out=output_tensor)
        else:
            raise UsageError("the ordered reduce-scatter adds with AVG or SUM; this job's FSDP2 reduces with a factor "
                             "(set_gradient_divide_factor): record it with reduction='native'")
        return None


class _Tap(fm.FsdpMonitor):
    """The online checks' monitor, which also fingerprints each reduce-scatter input as pieces of
    the rank's whole local gradient (``g``, by element index)."""

    def __init__(self, *, offsets: dict[int, int], ordered_replicas: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._offsets = offsets
        self.recording = False
        self.pieces: list[shards.Piece] = []
        self.error: BaseException | None = None
        # HSDP recorded with the ordered reduction: the replicas' all-reduce is redone in replica order
        self.ordered_replicas = ordered_replicas
        self._outputs: dict[int, torch.Tensor] = {}  # reduce-scatter call -> its output (as the job then held it)
        self._groups_seen: set[int] = set()  # parameter groups that reduce-scattered in this step

    def start(self, step: int | None) -> None:
        self._outputs = {}
        self._groups_seen: set[int] = set()
        self.recording = step is not None
        self.pieces = []
        self.error = None
        if step is not None:
            self.step = step

    def _before(self, input_tensor, group, scales, param_group=None) -> int:
        index = super()._before(input_tensor, group, scales, param_group)  # a drill flips the input first
        if self.recording and self.error is None and id(param_group) in self._groups_seen:
            self.error = UsageError(
                "a parameter group reduce-scattered twice in one step (gradient accumulation that communicates every "
                "microbatch): call model.set_requires_gradient_sync(False) on every microbatch but the last, as "
                "FSDP2 recommends; the recorder records one reduce-scatter of the summed local gradient per step")
        self._groups_seen.add(id(param_group))
        if self.recording and self.error is None:
            try:
                self.pieces += self._input_pieces(input_tensor, group.size(), param_group)
            except Exception as exc:  # noqa: BLE001 - said at the step's end, on every rank, never inside FSDP
                self.error = exc
        return index

    def _after(self, index: int, output_tensor: torch.Tensor) -> None:
        super()._after(index, output_tensor)  # a drill flips the output first
        if self.ordered_replicas:
            self._outputs[index] = output_tensor.detach().clone()

    def _after_all_reduce(self, checked, output: torch.Tensor, group) -> None:
        """HSDP, ordered: the collective's all-reduce of the replicas' reduce-scatter outputs is
        replaced, in place, by their ``ordered_mean`` in replica order (an all-gather of the outputs
        this rank's replicas held): a replay reproduces it bit for bit for any number of replicas."""
        if self.ordered_replicas and checked.pending:
            calls, index = len(checked.pending), checked.pending[-1]
            mine = self._outputs.pop(index, None)
            if calls > 1 or mine is None:
                self.error = self.error or UsageError(
                    "HSDP recorded with reduction='ordered' all-reduces every reduce-scatter on its own: "
                    "set_requires_all_reduce(False) accumulates several first; record it with reduction='native'")
            else:
                parts = [torch.empty_like(mine) for _ in range(group.size())]
                dist.all_gather(parts, mine, group=group)  # group rank order: the replicate coordinate's
                if self._calls[index].ar_scale == 1.0:  # FSDP2 all-reduces with SUM (a float16 reduction divides after)
                    ordered_sum(parts, out=output)
                else:
                    ordered_mean(parts, out=output)
        super()._after_all_reduce(checked, output, group)  # then the all-reduce-output drill, and its check

    def _input_pieces(self, flat: torch.Tensor, size: int, param_group) -> list[shards.Piece]:
        """FSDP2's reduce-scatter input: ``size`` chunks; chunk ``c`` holds, per parameter in
        the group's order, its rows of shard ``c`` padded to ``ceil(rows / size)`` rows."""
        plan, width = [], 0
        for fsdp_param in param_group.fsdp_params:
            param = fsdp_param.sharded_param
            if not param.requires_grad:
                continue
            shape = tuple(fsdp_param._orig_size)
            rows = shape[0] if shape else 1
            per_row = math.prod(shape[1:]) if shape else 1
            chunk = -(-rows // size)
            plan.append((self._offsets[id(param)], rows, per_row))
            width += chunk * per_row
        if width * size != flat.numel():
            raise UsageError(f"a reduce-scatter input of {flat.numel()} elements where the group's parameters fill "
                             f"{width * size}: a parameter without a gradient at this step; the recorder needs every "
                             "trainable parameter to get one (freeze the others: requires_grad_(False))")
        chunks = flat.detach().view(size, width)
        pieces, position = [], 0
        for offset, rows, per_row in plan:
            # the parameter's rows, shard after shard: its padded rows sit at the end, so the first `rows`
            # of its (size x padded rows) block are the whole gradient, in order; one piece per parameter
            # (a copy of its gradient), not one per parameter and shard: the cost does not grow with the shards
            padded = -(-rows // size) * per_row
            whole = chunks[:, position : position + padded].reshape(-1, per_row)[:rows] if padded else chunks[:, :0]
            if whole.numel():
                pieces.append(shards.fingerprint_piece(whole, offset=offset, k=self._k, seed=self._seed))
            position += padded
        return pieces

    @property
    def groups_reduced(self) -> int:
        """Parameter groups that reduce-scattered in this step so far."""
        return len(self._groups_seen)

    def local(self) -> Fingerprint | None:
        """The step's whole local gradient, as a DDP trace's one bucket (``combine`` of one digest)."""
        if self.error is not None:
            raise self.error
        return shards.one_bucket(self.pieces)


class FsdpRecorder(Recorder):
    """Records an FSDP2 or HSDP job (``Recorder(trace_dir, model, optimizer)`` builds it for a
    ``fully_shard`` model; the arguments are the :class:`Recorder`'s, ``comm_hook`` excepted)."""

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        ddp_model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        recipe: str | None = None,
        recipe_args: dict[str, Any] | None = None,
        options=None,
        comm_hook: Callable | None = None,
        comm_state: Any = None,
        inject: Iterable[FaultSpec | str] = (),
        framework: dict[str, str] | None = None,
    ) -> None:
        model = ddp_model
        if comm_hook is not None or comm_state is not None:
            raise UsageError("comm_hook is DDP's: an FSDP2 job keeps its own reduce-scatter (set_custom_reduce_scatter "
                             "before the Recorder), which the recorder wraps")
        from sdc_forensics.recorder import fsdp_fallback

        self._fallback = fsdp_fallback.wanted()  # no custom reduce-scatter to wrap: read the gradients in post_backward
        fm.require_fsdp2(model, "the Recorder", custom_reduce_scatter=False)
        self._setup(trace_dir, model, optimizer, group=dist.group.WORLD, recipe=recipe, recipe_args=recipe_args,
                    options=options, inject=inject, framework=framework, locations=LOCATIONS + FSDP_LOCATIONS)
        specs = [s for s in self.injector.specs] if hasattr(self.injector, "specs") else []
        self._reduce_dtype = self._param_dtype = None
        self._casts: tuple = ()
        problem = self._problem(model, specs)
        self._gather_identities(problem)
        self.mesh = mesh_of(model, self.world_size)
        self.mesh = dataclasses.replace(self.mesh, casts=self._casts)  # what FSDP2 casts, replayed as it did
        if self._reduce_dtype is not None and self.params and (self._reduce_dtype != self.params[0].dtype or self._param_dtype):
            # the local gradient is recorded, and reduced, in this dtype (MixedPrecisionPolicy(reduce_dtype=...)); with a
            # param_dtype, computed in another (the replay casts the parameters and the modules' inputs as FSDP2 did)
            self.mesh = dataclasses.replace(self.mesh, reduce_dtype=_name(self._reduce_dtype),
                                            param_dtype=_name(self._param_dtype) if self._param_dtype else "")
            if self.options.grad_dtype is None:
                self.options = dataclasses.replace(self.options, grad_dtype=self.mesh.reduce_dtype)
        self.grad_params = [p for p in self.params if p.requires_grad]
        index = {id(p): i for i, p in enumerate(self.grad_params)}
        groups = tuple(tuple(index[id(fp.sharded_param)] for fp in g.fsdp_params if id(fp.sharded_param) in index)
                       for g in fm.param_groups(model))
        self.mesh = dataclasses.replace(self.mesh, groups=tuple(g for g in groups if g))  # the reduce-scatters' buffers
        self._last_update: int | None = None  # this rank's weight shard digest after the last update
        self._grad_offsets = flat_offsets(self.grad_params)
        self._weight_offsets = flat_offsets(self.params)
        if self._fallback:
            self.tap = fsdp_fallback.PostBackwardTap(offsets=self._grad_offsets, mesh=self.mesh, sketch_k=self.options.sketch_k,
                                                     seed=self.options.seed, start_step=self.options.start_step)
        else:
            self.tap = _Tap(offsets=self._grad_offsets, sketch_k=self.options.sketch_k, seed=self.options.seed,
                            start_step=self.options.start_step,
                            ordered_replicas=self.options.reduction == ORDERED and len(self.mesh.replicas()) > 1)
        from sdc_forensics.recorder.fsdp_checks import rank_place

        self.tap.place = rank_place(model)
        fsdp_specs = [str(s) for s in specs if s.location in FSDP_LOCATIONS and s.location != "all-gather-output"]
        if fsdp_specs:
            self.tap._inject = fm.spec_injector(fsdp_specs, lambda: self.tap.step)
        self._handles_gathered: list = []  # the all-gather-output drills' forward hooks (removed by close)
        gathered = [s for s in specs if s.location == "all-gather-output"]
        if gathered:
            self._drill_gathered(model, gathered)
        self._watch_gathered(model)  # after the drills: it digests what the forward computes with
        self._reduced_error: BaseException | None = None
        self._follow_backward(model)
        if self._fallback:
            self.tap.install(model)
        else:
            fm.install(model, self.tap, OrderedReduceScatter() if self.options.reduction == ORDERED else None)
        self._comm_hook_name = "sdc_forensics.recorder.fsdp_recorder.OrderedReduceScatter" if self.options.reduction == ORDERED else ""
        self._open_trace()

    def _drill_gathered(self, model: torch.nn.Module, specs: list) -> None:
        """``all-gather-output`` drills: at the first forward of a ``fully_shard`` module in the step,
        after FSDP gathered its parameters, flip a bit of this rank's gathered copy of the group's
        first parameter (the forward computes with it; the backward gathers again)."""
        from torch.distributed.fsdp import FSDPModule

        fired: set = set()

        def hook(module, args, kwargs):
            state = self._state
            if state is None:
                return None
            for spec in specs:
                if spec.step != state.step or spec.rank != self.rank or id(spec) in fired:
                    continue
                group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
                if group is None or not group.fsdp_params:
                    continue
                fired.add(id(spec))
                from sdc_forensics.inject import flip_bit_

                with torch.no_grad():
                    flat = group.fsdp_params[0].unsharded_param.data.reshape(-1)
                    flip_bit_(flat, (spec.element or 0) % flat.numel(), spec.bit)
            return None

        for module in model.modules():
            if isinstance(module, FSDPModule):  # registered after FSDP's own pre-forward: the parameters are gathered
                self._handles_gathered.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _watch_gathered(self, model: torch.nn.Module) -> None:
        """The consensus a sharded job has without replicas: every rank gathers the same whole
        parameters for its forward. At each forward of a ``fully_shard`` module (after FSDP gathered
        its group) this rank's copies are digested, on the steps whose weights are compared
        (``weights_every``); ``_before_update`` votes the ranks' combined digests."""
        from torch.distributed.fsdp import FSDPModule

        from sdc_forensics.fingerprint.core import digests

        def hook(module, args, kwargs):
            state = self._state
            if state is None or not self.options.compares_weights(state.step):
                return None
            for group in fm.groups_of(module):
                params = [fp.unsharded_param.detach().reshape(-1) for fp in group.fsdp_params]
                state.gathered.append(combine_digests(digests(params, self.options.seed)))
            return None

        for module in model.modules():
            if isinstance(module, FSDPModule):  # appended: FSDP's own pre-forward (prepended) has gathered the group
                self._handles_gathered.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _follow_backward(self, model: torch.nn.Module) -> None:
        """The reduced gradient is fingerprinted where the collective left it: right after FSDP2's
        end-of-backward callback (``FSDPState._root_post_backward_final_callback``, which every
        state's pre-backward may queue: each is wrapped), once its reduce-scatters (and HSDP's
        all-reduce) are done and written into ``.grad``, before the job's loop clips or unscales
        them (as DDP's comm hook reads its bucket). A torch without that callback leaves it to the
        optimizer pre-hook, after any clipping."""
        from torch.distributed.fsdp import FSDPModule

        self._wrapped_states: list = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            fsdp_state = module._get_fsdp_state()
            original = getattr(fsdp_state, "_root_post_backward_final_callback", None)
            if original is None or not callable(original) or any(s is fsdp_state for s in self._wrapped_states):
                continue

            def callback(original=original, fsdp_state=fsdp_state) -> None:
                original()
                ctx = getattr(fsdp_state, "_state_ctx", None)
                if getattr(ctx, "is_last_backward", True):  # else FSDP2 has not finalised the gradients yet
                    self._after_backward()

            fsdp_state._root_post_backward_final_callback = callback  # an instance attribute: queue_callback reads it
            self._wrapped_states.append(fsdp_state)

    def _after_backward(self) -> None:
        """This rank's shard of the reduced gradient, as the reduction wrote it (a backward in
        which the tap saw this step's reduce-scatters, every trainable parameter with a gradient)."""
        state = self._state
        if state is None or state.reduced is not None or not self.tap.recording or not self.tap.groups_reduced:
            return
        try:
            grads = [(p.grad, self._grad_offsets[id(p)]) for p in self.grad_params if p.grad is not None]
            if len(grads) == len(self.grad_params):
                state.reduced = shards.fingerprint_runs(rank_runs(grads), k=self.options.sketch_k, seed=self.options.seed)
        except Exception as exc:  # noqa: BLE001 - said at the step's end, on every rank, never inside autograd
            self._reduced_error = exc

    def close(self, *, on_error: bool | None = None) -> None:
        for handle in self._handles_gathered:
            handle.remove()
        self._handles_gathered = []
        for fsdp_state in getattr(self, "_wrapped_states", ()):
            fsdp_state.__dict__.pop("_root_post_backward_final_callback", None)  # the class's method again
        self._wrapped_states = []
        try:  # the job's own reduce-scatter (and post_backward) again: a closed recorder costs nothing more
            if getattr(self, "tap", None) is not None:
                self.tap.uninstall(self.module) if self._fallback else fm.uninstall(self.module)
        except Exception as exc:  # noqa: BLE001 - closing must finish (the trace's END record) whatever FSDP2 holds
            log.warning("sdc-forensics: could not give the model its own reduce-scatter back: %s", exc)
        super().close(on_error=on_error)

    def _problem(self, model: torch.nn.Module, specs: list) -> str | None:
        """What this rank cannot record, in one line (None: nothing)."""
        audits = bool(self.options.audit_every or self.options.audit_steps)
        wrong = sorted({s.location for s in specs if s.location in _DDP_ONLY})
        if wrong:
            return (f"fault location(s) {', '.join(wrong)} are DDP's; a sharded job's are "
                    f"{', '.join(FSDP_LOCATIONS)}, weights, update, input")
        if self._fallback:
            from sdc_forensics.recorder import fsdp_fallback

            lacking = fsdp_fallback.missing(model)
            if lacking:
                return f"{lacking}: the recorder cannot read a sharded job's gradients with this torch (2.8 or later can)"
            if self.options.reduction == ORDERED:
                return ("reduction='ordered' replaces FSDP2's reduce-scatter through set_custom_reduce_scatter, which this "
                        "torch's FSDP2 lacks (2.8 or later has it): record with reduction='native' (on gloo the replay "
                        "reproduces it; elsewhere it compares within tolerance)")
            wrong = sorted({s.location for s in specs if s.location in ("reduce-scatter-output", "all-reduce-output")})
            if wrong:
                return (f"fault location(s) {', '.join(wrong)} need set_custom_reduce_scatter, which this torch's FSDP2 "
                        "lacks; local-gradient, all-gather-output, weights, update and input work")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            return f"parameters of several dtypes ({', '.join(sorted(map(str, dtypes)))}): the recorder needs one"
        orig = next(iter(dtypes))
        computes, reduce = set(), set()
        for group in fm.param_groups(model):
            policy = getattr(group, "mp_policy", None)
            computes.add(_effective(getattr(policy, "param_dtype", None), orig))
            reduce.add(getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None) or orig)
        if len(computes) > 1:
            return f"parameter groups compute in several dtypes ({', '.join(sorted(map(str, computes)))}): the recorder needs one"
        if len(reduce) > 1:
            return f"parameter groups reduce in several dtypes ({', '.join(sorted(map(str, reduce)))}): the recorder needs one"
        if reduce and next(iter(reduce)) not in (torch.float32, torch.bfloat16, torch.float16):
            return f"reduce_dtype {next(iter(reduce))}: the recorder records reductions in float32, bfloat16 or float16"
        if reduce and next(iter(reduce)) == torch.float16 and any(
                getattr(g, "gradient_divide_factor", None) is not None for g in fm.param_groups(model)):
            return ("a float16 reduction with set_gradient_divide_factor: FSDP2 then divides by factors the replay does not "
                    "model; reduce in float32, or keep FSDP2's own factor")
        compute = next(iter(computes)) if computes else orig
        if audits and (compute != orig or (reduce and next(iter(reduce)) != orig)):
            return ("audits recompute a rank's microbatches on a whole copy of the model in the parameters' dtype; this "
                    "job computes or reduces in another (MixedPrecisionPolicy): record without audit_every (the replay "
                    "recomputes every rank as the job did)")
        casts = _casts(model)
        if compute != orig:
            if orig != torch.float32 or compute not in (torch.bfloat16, torch.float16):
                return (f"parameters in {orig} computed in {compute}: the recorder records float32 parameters computed in "
                        "bfloat16 or float16")
            if casts is None:
                return ("this torch's fully_shard keeps each module's MixedPrecisionPolicy where the recorder cannot read it: "
                        "the replay could not cast as the job did; record without param_dtype")
            self._param_dtype = compute
        self._casts = casts or ()
        self._reduce_dtype = next(iter(reduce)) if reduce else None
        return None

    # ---------------------------------------------------------------- per step
    def begin_step(self, step: int, *, microbatch_ids: Iterable[int] | None = None):
        """Start step ``step``; the weight shard is digested now, before FSDP gathers it for the
        forward: a change at rest since the last update (which every rank then computes with) is
        seen on the rank that holds it."""
        self._reduced_error = None
        handle = super().begin_step(step, microbatch_ids=microbatch_ids)  # a "weights" drill flips the shard first
        self._state.rest_weights = self._weights()[0]
        return handle

    def _before_update(self, optimizer, args, kwargs) -> None:
        state = self._state
        if state is None:
            return None
        if not state.num_threads:
            state.num_threads = ThreadWatch.current()
        failure: BaseException | None = None
        try:
            state.local = self.tap.local()
            if self._reduced_error is not None:
                raise self._reduced_error
            if state.local is None:
                state.reduced = None
            elif state.reduced is None:  # no end-of-backward callback was seen: read now (after any clipping)
                grads = [(p.grad, self._grad_offsets[id(p)]) for p in self.grad_params if p.grad is not None]
                if len(grads) == len(self.grad_params):
                    state.reduced = shards.fingerprint_runs(rank_runs(grads), k=self.options.sketch_k, seed=self.options.seed)
            self._resolve_inputs(state)
            self._note_layout(state.step)
        except Exception as exc:  # noqa: BLE001 - the other ranks must learn it, or they wait forever
            failure = exc
        changed = int(self._last_update is not None and state.rest_weights is not None and self._last_update != state.rest_weights)
        gathered = np.array([combine_digests(state.gathered) if state.gathered else 0], dtype=np.uint64).view(np.int64)[0]
        words = self._all_gather_words(np.array([-1 if failure else int(state.reduced is not None), changed, gathered],
                                                dtype=np.int64))
        table = words[:, 0]
        if (table < 0).any():
            if failure is not None:
                raise failure
            failed = ", ".join(str(int(r)) for r in np.flatnonzero(table < 0))
            raise SdcError(f"the recorder failed on rank(s) {failed} at step {state.step}; see their logs")
        result = self.tap.check(state.step, **({"reduced": state.reduced} if self._fallback else {}))
        if table.all():
            state.flags |= int(F.Flag.HAS_GRADS)
        findings = []
        for rank in np.flatnonzero(words[:, 1]).tolist():
            findings.append(checks.Finding(
                check="weights", step=state.step, rank=rank, flag=F.Flag.WEIGHTS_DIVERGED, ranks=(rank,),
                detail=f"rank {rank} ({self.mesh.where(rank)}): its weight shard changed at rest before step {state.step} "
                "began, since the last update (or the checkpoint that saved it); every rank gathered it for this step's forward"))
            if rank == self.rank:
                state.flags |= int(F.Flag.WEIGHTS_DIVERGED)
        findings += self._vote_gathered(state, words[:, 2].view(np.uint64), explained=bool(words[:, 1].any()))
        findings += self._audit_if_due(state)
        for found in result.findings:
            flag, check = _FLAGS.get(found.check, (F.Flag.ALLREDUCE_MISMATCH, "allreduce"))
            where = self.mesh.where(found.rank) if self.mesh is not None else ""
            findings.append(checks.Finding(check=check, step=state.step, rank=found.rank, flag=flag, ranks=(found.rank,),
                                           detail=f"rank {found.rank} ({where}): {found.detail}"))
            if found.rank == self.rank:
                state.flags |= int(flag)
        self._react(state, findings)
        return None

    def _vote_gathered(self, state, table: np.ndarray, *, explained: bool) -> list[checks.Finding]:
        """The ranks' digests of the parameters they gathered this step (0: none taken) voted: a
        strict majority names the ranks that computed with other parameters (``GATHER_DIVERGED``);
        without one (2 ranks, or HSDP's replicas split evenly, as a shard changed at rest makes
        them) the finding names no rank, and the rest check or the replay settles it; ``explained``:
        the rest check named a shard changed at rest this step, which splits the replicas so."""
        if not table.any() or not table.all():
            return []
        vote = checks.strict_majority(table)
        if not vote.diverged or (vote.value is None and explained):
            return []
        if vote.value is None:
            return [checks.Finding(
                check="weights", step=state.step, rank=-1, flag=F.Flag.NO_MAJORITY, ranks=(),
                detail=f"the ranks gathered different parameters for step {state.step}'s forward and no strict majority "
                f"agrees ({', '.join(f'rank {r}: {hex64(int(v))}' for r, v in enumerate(table))})")]
        if self.rank in vote.diverged:
            state.flags |= int(F.Flag.GATHER_DIVERGED)
        return [checks.Finding(
            check="weights", step=state.step, rank=rank, flag=F.Flag.GATHER_DIVERGED, ranks=(rank,),
            detail=f"rank {rank} ({self.mesh.where(rank)}): the parameters it gathered for step {state.step}'s forward differ "
            f"from the {len(vote.agreeing)} ranks' that agree ({hex64(int(table[rank]))}, not {hex64(int(vote.value))})")
            for rank in vote.diverged]

    @contextlib.contextmanager
    def _audit_module(self):
        """A whole copy of the model at theta_s for an audit: the recipe's model with every
        parameter all-gathered (``full_tensor``, in model order on every rank: collectives) and this
        rank's buffers (FSDP2 keeps them per rank). It lives for the audit only: for its length
        every rank holds the whole model once more."""
        model = self._recipe.build(self.device)[0]
        with torch.no_grad():
            gathered = [(name, p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
                        for name, p in self.module.named_parameters()]
            params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
            missing = [name for name, full in gathered if name not in params or params[name].shape != full.shape]
            if missing:
                raise UsageError(f"the recipe's model has no parameter {missing[0]!r} of the job's shape: audits recompute on "
                                 "the recipe's model, which must be the job's, unsharded")
            for name, full in gathered:
                params[name].copy_(full)
            for name, buf in self.module.named_buffers():
                if name in buffers and buffers[name].shape == buf.shape:
                    buffers[name].copy_(buf)
        trainable = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
        try:
            yield model, [trainable]
        finally:
            del model, gathered

    def _after_weights(self, state) -> None:
        self._last_update = state.weights[0]
        if self.options.compares_weights(state.step):
            findings, vote = self._vote_shards(state.step, state.weights[0])
            self.last_weights_vote = (state.step, state.weights[0], vote)
            state.flags |= int(F.Flag.WEIGHTS_CHECKED)
            for finding in findings:
                if finding.flag == F.Flag.NO_MAJORITY and self.rank in finding.ranks:
                    state.flags |= int(F.Flag.NO_MAJORITY)
                elif self.rank in finding.ranks:
                    state.flags |= int(F.Flag.WEIGHTS_DIVERGED)
            self._react(state, findings)
        return None

    def _weights(self) -> tuple[int, float, int]:
        """This rank's shard of the weights: ``(digest, L2 norm, NaN/Inf count)``."""
        with torch.no_grad():
            fp = shards.fingerprint_runs(rank_runs((p, self._weight_offsets[id(p)]) for p in self.params), k=1,
                                         seed=self.options.seed)
        return fp.digest, float(fp.norm), int(fp.nonfinite)

    def _vote_shards(self, step: int, digest: int) -> tuple[list[checks.Finding], checks.Majority]:
        """The weights vote, per shard across the ranks that hold it (a collective)."""
        table = self._all_gather_words(np.array([digest], dtype=np.uint64).view(np.int64))[:, 0].view(np.uint64)
        findings, agreeing, diverged, blessed = [], [], [], True
        for group in self.mesh.same_shard():
            if len(group) < 2:
                agreeing += group
                continue
            vote = checks.strict_majority([table[r] for r in group])
            shard = self.mesh.shard_of(group[0])
            if vote.value is None:
                blessed = False
                diverged += group
                findings.append(checks.Finding(
                    check="weights", step=step, rank=-1, flag=F.Flag.NO_MAJORITY, ranks=group,
                    detail=f"the {len(group)} replicas of shard {shard} (ranks {', '.join(map(str, group))}) hold different "
                    "weights and no strict majority: detected, but no vote can name the rank; a replay can"))
                continue
            agreeing += [group[i] for i in vote.agreeing]
            bad = tuple(group[i] for i in vote.diverged)
            diverged += bad
            if bad:
                findings.append(checks.Finding(
                    check="weights", step=step, rank=bad[0], flag=F.Flag.WEIGHTS_DIVERGED, ranks=bad,
                    detail=f"rank(s) {', '.join(map(str, bad))} ({self.mesh.where(bad[0])}) hold shard {shard} differently "
                    f"from the majority of its {len(group)} replicas"))
        majority = checks.Majority(value=digest if blessed else None, agreeing=tuple(sorted(agreeing)),
                                   diverged=tuple(sorted(diverged)))
        return findings, majority

    def _note_layout(self, step: int) -> None:
        """One bucket holding every gradient-carrying parameter in model order, once per attempt."""
        if self._layouts:
            return
        index = {id(p): i for i, p in enumerate(self.params)}
        self._layouts.append({"from_step": step, "buckets": [[index[id(p)] for p in self.grad_params]]})
        if self.rank == 0:
            records.write_layouts(self.trace_dir, self.attempt, self._layouts)
            if self.options.grad_dtype is None and self.grad_params:  # (a reduce_dtype already set it: the manifest has it)
                records.update_grad_dtype(self.trace_dir, str(self.grad_params[0].dtype).removeprefix("torch."))

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, step: int, path: str | os.PathLike, state: Any, *, save: Callable[[Any, Path], None] | None = None):
        """Save checkpoint ``step`` (it holds theta_step) with ``torch.distributed.checkpoint``:
        every rank calls it with its part of the state (``{"model": model.state_dict(), ...}``).

        The state's tensors are digested as if whole (no all-gather), the weight shards voted
        across replicas, the directory written by every rank (``save(state, path)``; default
        ``torch.distributed.checkpoint.save``), and rank 0 notes it. Returns the note on every rank.
        """
        from sdc_forensics.recorder.fsdp_checks import sharded_state_digests

        step, path = int(step), Path(path)
        if not self._checkpointed:
            self._checkpointed = True
            self._check_first_checkpoint(step)
        last = self.last_weights_vote
        if last is not None and last[0] == step - 1:
            _, my_digest, vote = last
            findings = []
        else:
            my_digest = self._weights()[0]
            findings, vote = self._vote_shards(max(step - 1, 0), my_digest)
        self._last_update = my_digest  # theta_step as saved: a change at rest before step `step` begins shows against it
        blessed = vote.value is not None
        if not blessed and self.options.policy == "raise":
            self._react(None, findings)
        # a collective, before the files exist; an outvoted replica's copies do not count, and
        # without a majority the lowest rank's count (the checkpoint is then not blessed)
        trusted = vote.agreeing if blessed else tuple(g[0] for g in self.mesh.same_shard())
        tensors = sharded_state_digests(state, seed=self.options.seed, trusted=trusted)
        keys = _param_keys([n for n, _ in self.module.named_parameters()], tensors)
        whole = combine_digests(int(tensors[key], 16) for key in keys)
        failure = ""
        try:
            if save is not None:
                save(state, path)
            else:
                import torch.distributed.checkpoint as dcp

                dcp.save(state, checkpoint_id=str(path))
        except Exception as exc:  # noqa: BLE001 - every rank must learn that the save failed
            failure = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        failures: list = [None] * self.world_size
        dist.all_gather_object(failures, failure, group=self.group)
        failed = next((f for f in failures if f), "")
        if self.rank == 0 and not failed:
            try:  # a framework's own file beside the DCP shards (Lightning's meta.pt): noted as written
                tensors = {**_beside(path, tensors, self.options.seed), **tensors}
            except Exception as exc:  # noqa: BLE001 - the note is still right for the state; verify then lists the file
                log.warning("sdc-forensics: checkpoint %s: the files beside its DCP shards were not read back: %s", path, exc)
        note = CheckpointNote(
            step=step, path=str(path), attempt=self.attempt, weights_digest=hex64(whole), param_names=keys, tensors=tensors,
            saved_by_rank=0, agreeing_ranks=vote.agreeing, diverged_ranks=vote.diverged, blessed=blessed,
            saved_ns=time.time_ns(), path_from_trace=path_from_trace(self.trace_dir, path),
        )
        if self.rank == 0 and not failed:
            write_checkpoint_note(self.trace_dir, note)
        record = self.writer.new(F.Kind.CHECKPOINT, step)
        record["weights_digest"] = my_digest % (1 << 64)
        record["aux_digest"] = whole % (1 << 64)
        record["aux_rank"] = 0
        record["flags"] = int(F.Flag.WEIGHTS_CHECKED) | (0 if blessed else int(F.Flag.CHECKPOINT_REFUSED | F.Flag.NO_MAJORITY))
        if self.rank in vote.diverged and blessed:
            record["flags"] |= int(F.Flag.WEIGHTS_DIVERGED)
        self.writer.append(record)
        if failed:
            raise SdcError(f"checkpoint {step} could not be saved to {path}: {failed}")
        if findings:
            self._react(None, findings)
        return note


def _beside(path: Path, tensors: dict[str, str], seed: int) -> dict[str, str]:
    """``{key: hex}`` of the tensors ``verify-checkpoint`` reads in the saved directory that the
    state did not hold: a file a framework writes beside the shards (Lightning's ``meta.pt``, with
    its loops' and callbacks' state), read back by rank 0 right after the save."""
    from sdc_forensics.checkpoint.formats import open_checkpoint
    from sdc_forensics.statedict import state_digests

    if not path.is_dir():
        return {}
    reader = open_checkpoint(path)
    try:
        extra = {key: tensor for key, tensor in reader.tensors() if key not in tensors}
        return state_digests(extra, seed) if extra else {}
    finally:
        reader.close()


def _param_keys(names: list[str], tensors: dict[str, str]) -> tuple[str, ...]:
    """The key of every parameter in the flattened state (``model.0.weight`` for ``0.weight``)."""
    keys = []
    for name in names:
        matches = [k for k in tensors if k == name or k.endswith("." + name)]
        if len(matches) > 1:  # "norm.weight" also ends "model.attn.norm.weight": the one under a top-level key
            matches = [k for k in matches if k == name or "." not in k[: -len(name) - 1]]
        if len(matches) != 1:
            raise UsageError(f"the checkpoint state does not hold parameter {name!r} (or holds it ambiguously); pass a state "
                             "built from model.state_dict() so the recorder can note the weights digest")
        keys.append(matches[0])
    return tuple(keys)
