"""Reading a sharded job's collectives: its mesh, its flat layout, its reduce-scatter.

What the FSDP layout (``fsdp_layout.py``) builds on, for FSDP2's ``fully_shard`` on a 1-D mesh
and HSDP (replicate x shard). The model's gradient-carrying parameters, in model order, are one
flat vector ``g`` (a DDP trace with one bucket holding all of them), and

* :class:`ReduceScatterTap` reads this rank's whole local gradient ``g_r`` from its
  reduce-scatter inputs (the rank's full unsharded gradient, cut into ``S`` chunks) as pieces
  placed by their index in ``g`` (``fingerprint/shards.py``): the same digest as a DDP trace's
  one-bucket local gradient, and what a replay on any number of devices recomputes; it is the
  online checks' monitor too (``fsdp_monitor.FsdpMonitor``: the reduce-scatter and replica
  all-reduce checks);
* :func:`rank_runs` places a rank's shard of the reduced gradient or of the weights in ``g``
  (``shards.fingerprint_runs`` of the elements it holds, at their places);
* :class:`OrderedReduceScatter` (``RecorderOptions(reduction="ordered")``) replaces the
  reduce-scatter by an all-to-all, then ``reduction.ordered_mean`` in rank order; in HSDP the
  tap redoes the replicas' all-reduce as the ``ordered_mean`` of their outputs in replica order,
  so that a replay reproduces the reduced gradient bit for bit on any device and mesh;
* :func:`mesh_of` and :func:`casts` read the mesh and the mixed-precision casts the manifest notes.

A float16 reduction is recorded as FSDP2 runs it (the input divided by a pre-factor, summed,
divided by a post-factor: ``ShardMesh.divide_factors``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import shards
from sdc_forensics.fingerprint.core import Fingerprint
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.reduction import ordered_mean, ordered_sum
from sdc_forensics.trace.mesh import ShardMesh


def mesh_of(model: torch.nn.Module, world_size: int) -> ShardMesh:
    """The mesh the model's parameters are sharded on, with every rank's coordinates."""
    sharded = [p for p in model.parameters() if hasattr(p, "device_mesh")]
    if not sharded:
        raise UsageError(
            "no parameter of this model is sharded (no DTensor): call fully_shard on it before the Recorder"
        )
    mesh, placements = sharded[0].device_mesh, tuple(sharded[0].placements)
    layout = mesh.mesh.cpu()
    if layout.numel() != world_size:
        raise UsageError(
            f"the model is sharded on a mesh of {layout.numel()} ranks in a job of {world_size}: the recorder "
            "records data parallelism over the whole world (FSDP or HSDP), not FSDP combined with tensor or "
            "pipeline parallelism"
        )
    shard_dims = [i for i, p in enumerate(placements) if hasattr(p, "dim")]
    if len(shard_dims) != 1 or placements[shard_dims[0]].dim != 0:
        raise UsageError(
            f"parameters placed as {placements}: the recorder records FSDP2's Shard(0) (and HSDP's Replicate, "
            "Shard(0)); pass no shard_placement_fn to fully_shard"
        )
    if layout.dim() > 2:
        raise UsageError(
            f"the model is sharded on a {layout.dim()}-D mesh: the recorder records FSDP (1-D) and HSDP "
            "(replicate x shard)"
        )
    if layout.shape[shard_dims[0]] == 1:
        raise UsageError(
            "the shard dimension of the mesh has size 1: FSDP2 then reduce-scatters nothing (each rank holds "
            "whole parameters, replicated); record such a job as DDP"
        )
    coords: list = [None] * world_size
    for index in np.ndindex(*layout.shape):
        coords[int(layout[index])] = tuple(int(i) for i in index)
    names = tuple(mesh.mesh_dim_names or ("",) * layout.dim())
    return ShardMesh(
        kind="fsdp" if layout.dim() == 1 else "hsdp",
        shape=tuple(layout.shape),
        dim_names=names,
        shard_dim=shard_dims[0],
        coords=tuple(coords),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def effective_dtype(param_dtype: torch.dtype | None, orig: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 computes a floating-point parameter in (``FSDPParam.init_dtype_attrs``)."""
    return orig if param_dtype is None or not orig.is_floating_point else param_dtype


def casts(model: torch.nn.Module) -> tuple[tuple[str, str, str], ...] | None:
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
            out.append(
                (
                    name,
                    dtype_name(inputs) if inputs is not None else "",
                    dtype_name(outputs) if outputs is not None else "",
                )
            )
    return tuple(out)


def flat_offsets(params: Iterable[torch.Tensor]) -> dict[int, int]:
    """``{id(param): index of its first element}`` in the flat vector of ``params`` (full sizes)."""
    out, offset = {}, 0
    for param in params:
        out[id(param)] = offset
        # a DTensor's numel is its global one
        offset += param.numel()
    return out


def rank_runs(tensors: Iterable[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """``(this rank's elements, their index in the flat vector)`` of ``(tensor, its offset)`` pairs
    (a DTensor gives its local shard at its global place, a plain tensor itself)."""
    runs = []
    for tensor, offset in tensors:
        values, first = _local_piece(tensor)
        runs.append((values, offset + first))
    return runs


#: (global shape, mesh shape, this rank's coordinates, placements) -> index of its first element
_FIRSTS: dict[tuple, int] = {}


def _local_piece(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`shards.local_piece`, its shard's place computed once per shape and placement (the
    rank's piece of each parameter, gradient and weights, is read every step)."""
    mesh, placements = getattr(tensor, "device_mesh", None), getattr(tensor, "placements", None)
    if mesh is None or placements is None or not hasattr(tensor, "to_local"):
        return shards.local_piece(tensor)
    # everything the place is a function of (compute_local_shape_and_global_offset's arguments)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return shards.local_piece(tensor)
    # DeviceMesh.shape, not mesh.mesh.shape: the latter rebuilds the rank tensor on every read
    # (tens of microseconds in torch 2.13, read for every parameter three times a step)
    shape = mesh.shape if hasattr(mesh, "shape") else mesh.mesh.shape
    key = (tuple(tensor.shape), tuple(shape), tuple(coordinate), tuple(placements))
    first = _FIRSTS.get(key)
    if first is None:
        values, first = shards.local_piece(tensor)
        _FIRSTS[key] = first
        return values, first
    return tensor.to_local().detach(), first


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
            raise UsageError(
                "the ordered reduce-scatter adds with AVG or SUM; this job's FSDP2 reduces with a factor "
                "(set_gradient_divide_factor): record it with reduction='native'"
            )
        return None


class ReduceScatterTap(fm.FsdpMonitor):
    """The online checks' monitor, which also fingerprints each reduce-scatter input as pieces of
    the rank's whole local gradient (``g``, by element index)."""

    def __init__(self, *, offsets: dict[int, int], ordered_replicas: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._offsets = offsets
        self.recording = False
        # the step's whole local gradient, added one reduce-scatter input at a time
        self.local_runs = shards.RunsFingerprint(self._k, self._seed)
        self.error: BaseException | None = None
        # HSDP recorded with the ordered reduction: the replicas' all-reduce is redone in replica order
        self.ordered_replicas = ordered_replicas
        # reduce-scatter call -> its output (as the job then held it)
        self._outputs: dict[int, torch.Tensor] = {}
        # parameter groups that reduce-scattered in this step
        self._groups_seen: set[int] = set()

    def start(self, step: int | None) -> None:
        self._outputs = {}
        self._groups_seen: set[int] = set()
        self.recording = step is not None
        self.local_runs = shards.RunsFingerprint(self._k, self._seed)
        self.error = None
        if step is not None:
            self.step = step

    def _before(self, input_tensor, group, scales, param_group=None) -> int:
        # a drill flips the input first
        index = super()._before(input_tensor, group, scales, param_group)
        if self.recording and self.error is None and id(param_group) in self._groups_seen:
            self.error = UsageError(
                "a parameter group reduce-scattered twice in one step (gradient accumulation that communicates every "
                "microbatch): call model.set_requires_gradient_sync(False) on every microbatch but the last, as "
                "FSDP2 recommends; the recorder records one reduce-scatter of the summed local gradient per step"
            )
        self._groups_seen.add(id(param_group))
        if self.recording and self.error is None:
            try:
                self._add_input(input_tensor, group.size(), param_group)
            except Exception as exc:  # noqa: BLE001 - said at the step's end, on every rank, never inside FSDP
                self.error = exc
        return index

    def _after(self, index: int, output_tensor: torch.Tensor) -> None:
        # a drill flips the output first
        super()._after(index, output_tensor)
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
                    "set_requires_all_reduce(False) accumulates several first; record it with reduction='native'"
                )
            else:
                parts = [torch.empty_like(mine) for _ in range(group.size())]
                # group rank order: the replicate coordinate's
                dist.all_gather(parts, mine, group=group)
                # FSDP2 all-reduces with SUM (a float16 reduction divides after)
                if self._calls[index].ar_scale == 1.0:
                    ordered_sum(parts, out=output)
                else:
                    ordered_mean(parts, out=output)
        # then the all-reduce-output drill, and its check
        super()._after_all_reduce(checked, output, group)

    def _input_wholes(self, flat: torch.Tensor, size: int, param_group) -> list[tuple[Any, torch.Tensor]]:
        """FSDP2's reduce-scatter input cut back into each trainable parameter's whole local gradient:
        ``size`` chunks; chunk ``c`` holds, per parameter in the group's order, its rows of shard ``c``
        padded to ``ceil(rows / size)`` rows. ``(sharded parameter, its gradient as rows)`` each."""
        plan, width = [], 0
        for fsdp_param in param_group.fsdp_params:
            param = fsdp_param.sharded_param
            if not param.requires_grad:
                continue
            shape = tuple(fsdp_param._orig_size)
            rows = shape[0] if shape else 1
            per_row = math.prod(shape[1:]) if shape else 1
            plan.append((param, rows, per_row))
            width += -(-rows // size) * per_row
        if width * size != flat.numel():
            raise UsageError(
                f"a reduce-scatter input of {flat.numel()} elements where the group's parameters fill "
                f"{width * size}: a parameter without a gradient at this step; the recorder needs every "
                "trainable parameter to get one (freeze the others: requires_grad_(False))"
            )
        chunks = flat.detach().view(size, width)
        wholes, position = [], 0
        for param, rows, per_row in plan:
            # the parameter's rows, shard after shard: its padded rows sit at the end, so the first `rows`
            # of its (size x padded rows) block are the whole gradient, in order (a view, no copy)
            padded = -(-rows // size) * per_row
            whole = chunks[:, position : position + padded].reshape(-1, per_row)[:rows] if padded else chunks[:, :0]
            wholes.append((param, whole))
            position += padded
        return wholes

    def _add_input(self, flat: torch.Tensor, size: int, param_group) -> None:
        """One run per parameter (its whole local gradient), not one per parameter and shard: the cost
        does not grow with the shards; the group's runs in one kernel call (``shards.RunsFingerprint``)."""
        self.local_runs.add(
            (whole, self._offsets[id(param)])
            for param, whole in self._input_wholes(flat, size, param_group)
            if whole.numel()
        )

    @property
    def groups_reduced(self) -> int:
        """Parameter groups that reduce-scattered in this step so far."""
        return len(self._groups_seen)

    def local(self) -> Fingerprint | None:
        """The step's whole local gradient, as a DDP trace's one bucket (``combine`` of one digest)."""
        if self.error is not None:
            raise self.error
        return shards.one_bucket(self.local_runs.pieces())
