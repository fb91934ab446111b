"""The reduce-scatter check and the NaN/Inf checks of an FSDP2 job, online, every step.

FSDP2 reduce-scatters each parameter group's gradients: every rank's input is its whole local
gradient (``W`` chunks, chunk ``r`` destined for rank ``r``), every rank's output is the sum (or
mean) of everybody's chunk for it. :func:`watch` wraps each ``fully_shard`` module's
reduce-scatter (``set_custom_reduce_scatter``, around whatever comm the job set) so that, per call,
every rank sketches the ``W`` chunks of its input and its output (``docs/fingerprints.md``: the
same linear sketch as DDP's all-reduce check, chunk and output at the same block offsets) and
counts their NaN/Inf. :meth:`FsdpMonitor.check`, called by every rank once per step (after
``backward``, before ``optimizer.step()``), gathers those numbers and decides together:

* **NaN/Inf before the reduce-scatter**: a rank whose local gradient holds NaN/Inf is named.
* **NaN/Inf after it** with finite inputs: the rank whose output turned non-finite is named.
* **The reduce-scatter itself**: rank ``r``'s output against the sum of every rank's chunk ``r``,
  by the calibrated all-reduce tolerance (``fingerprint/tolerance.py``, the dtype the collective
  adds in, ``W``, the norms): a rank whose output differs is named.
* **HSDP's replica all-reduce** (``set_all_reduce_hook``, after the job's own hook is kept and
  called): each rank's all-reduce output against the sum of its replicas' reduce-scatter outputs.

A local-gradient fault that is finite is summed consistently and passes: as with DDP, only a
replay or an audit sees it. Gradient accumulation with ``set_requires_gradient_sync(False)``
reduce-scatters once, on the last microbatch: that call is the one checked. Mixed precision
(``MixedPrecisionPolicy(reduce_dtype=...)``): the tolerance is that of the dtype reduced in.

Two lines::

    monitor = watch(model)                      # after fully_shard, before training
    ...
    loss.backward()
    monitor.check(step, policy="raise")         # every rank, every step
    optimizer.step()
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcAlarm, UsageError
from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core, tolerance

#: A fault drill: ``inject(location, call_index, tensor)`` may change ``tensor`` in place;
#: locations ``"local-gradient"`` (the input, before it is read), ``"reduce-scatter-output"``
#: (this rank's output, after the collective) and, HSDP, ``"all-reduce-output"`` (after the replicas' all-reduce).
Injector = Callable[[str, int, torch.Tensor], None]


@dataclasses.dataclass(frozen=True)
class FsdpFinding:
    """One check that fired: which, on which rank, in which reduce-scatter call of the step."""

    check: str  # nonfinite-before | nonfinite-after | reduce-scatter | all-reduce
    rank: int
    call: int
    detail: str

    def line(self, step: int) -> str:
        return f"step {step}, reduce-scatter {self.call}: rank {self.rank}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """What :meth:`FsdpMonitor.check` found at one step (the same on every rank)."""

    step: int
    calls: int
    findings: tuple[FsdpFinding, ...]

    @property
    def clean(self) -> bool:
        return not self.findings

    @property
    def suspects(self) -> tuple[int, ...]:
        return tuple(sorted({f.rank for f in self.findings}))

    def lines(self) -> list[str]:
        return [f.line(self.step) for f in self.findings] or [f"step {self.step}: {self.calls} reduce-scatter(s) checked, clean"]


@dataclasses.dataclass
class _Call:
    group: tuple[int, ...]  # global ranks of the reduce-scatter's group, in group order
    dtype: str
    reduction: str | None  # "sum" | "mean" | None (an op this check cannot model)
    in_sketch: np.ndarray  # (W, k): this rank's chunk r, r < W
    in_norm: np.ndarray  # (W,)
    in_nonfinite: np.ndarray  # (W,)
    out_sketch: np.ndarray | None = None  # (k,)
    out_norm: float = 0.0
    out_nonfinite: int = 0
    ar_group: tuple[int, ...] = ()  # HSDP: global ranks of the replica all-reduce's group
    ar_sketch: np.ndarray | None = None  # (k,) the all-reduce's output
    ar_norm: float = 0.0
    ar_nonfinite: int = 0


def _reduction(op) -> str | None:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "mean"
    return None  # PREMUL_SUM and anything else: the factor is not visible here


class _CheckedReduceScatter:
    """The custom reduce-scatter :func:`watch` installs: sketch the input, reduce, sketch the output."""

    def __init__(self, monitor: "FsdpMonitor", inner) -> None:
        self._monitor = monitor
        self._inner = inner
        self.last = -1  # index of this group's latest call in the step (its all-reduce belongs to it)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        index = self._monitor._before(input_tensor, group, op)
        self.last = index
        work = self._inner(output_tensor, input_tensor, group, op, async_op)
        if work is not None and async_op:
            work.wait()  # the output is read below; on CUDA this orders the current stream, no host sync
        self._monitor._after(index, output_tensor)
        return work


class FsdpMonitor:
    """Per-step numbers of every reduce-scatter on this rank, and the collective check of them."""

    def __init__(self, *, sketch_k: int = C.DEFAULT_SKETCH_K, seed: int = C.DEFAULT_SEED, inject: Injector | None = None):
        self._k = sketch_k
        self._seed = seed
        self._inject = inject
        self._lock = threading.Lock()
        self._calls: list[_Call] = []

    def _sketch(self, x: torch.Tensor) -> core.Fingerprint:
        return core.fingerprint(x, k=self._k, seed=self._seed, with_digest=False)

    def _before(self, input_tensor: torch.Tensor, group, op) -> int:
        with self._lock:
            index = len(self._calls)
        if self._inject is not None:
            self._inject("local-gradient", index, input_tensor)
        ranks = tuple(dist.get_process_group_ranks(group))
        chunks = input_tensor.reshape(-1).chunk(len(ranks))
        prints = [self._sketch(c) for c in chunks]
        call = _Call(
            group=ranks, dtype=str(input_tensor.dtype).removeprefix("torch."), reduction=_reduction(op),
            in_sketch=np.stack([p.sketch for p in prints]), in_norm=np.array([p.norm for p in prints]),
            in_nonfinite=np.array([p.nonfinite for p in prints]),
        )
        with self._lock:
            self._calls.append(call)
        return index

    def _after(self, index: int, output_tensor: torch.Tensor) -> None:
        if self._inject is not None:
            self._inject("reduce-scatter-output", index, output_tensor)
        fp = self._sketch(output_tensor)
        call = self._calls[index]
        call.out_sketch, call.out_norm, call.out_nonfinite = fp.sketch, fp.norm, fp.nonfinite

    def _after_all_reduce(self, index: int, output: torch.Tensor, group) -> None:
        if index < 0:
            return
        if self._inject is not None:
            self._inject("all-reduce-output", index, output)
        fp = self._sketch(output)
        call = self._calls[index]
        call.ar_group = tuple(dist.get_process_group_ranks(group))
        call.ar_sketch, call.ar_norm, call.ar_nonfinite = fp.sketch, fp.norm, fp.nonfinite

    def check(self, step: int, *, policy: str = "return") -> StepCheck:
        """Gathers this step's numbers from every rank and checks every reduce-scatter call.

        Every rank calls it at the same point of every step (it is a collective).

        Args:
            step: the optimizer step (for the findings and the alarm).
            policy: ``"return"`` the result, or ``"raise"`` :class:`~sdc_forensics.errors.SdcAlarm`
                on every rank when a check fires (its rank: the one suspect, else -1).
        """
        if policy not in ("return", "raise"):
            raise UsageError(f"policy must be 'return' or 'raise', not {policy!r}")
        with self._lock:
            mine, self._calls = self._calls, []
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [dataclasses.asdict(c) for c in mine])
        counts = {len(calls) for calls in gathered}
        if len(counts) > 1:
            raise UsageError(f"step {step}: ranks made different numbers of reduce-scatters ({sorted(counts)}): "
                             "call check() at the same point of the step on every rank")
        findings: list[FsdpFinding] = []
        for index in range(counts.pop() if counts else 0):
            findings += _check_call(index, {rank: calls[index] for rank, calls in enumerate(gathered)})
        result = StepCheck(step=step, calls=len(mine), findings=tuple(findings))
        if policy == "raise" and not result.clean:
            rank = result.suspects[0] if len(result.suspects) == 1 else -1
            raise SdcAlarm("; ".join(result.lines()), step=step, rank=rank, check=result.findings[0].check)
        return result


def _check_call(index: int, by_rank: dict[int, dict]) -> list[FsdpFinding]:
    """Every group's reduce-scatter of call ``index``: NaN/Inf before and after, then the sums."""
    found = []
    groups = {tuple(call["group"]) for call in by_rank.values()}
    for group in sorted(groups):
        members = [by_rank[r] for r in group]
        for rank, call in zip(group, members):
            if int(np.sum(call["in_nonfinite"])):
                found.append(FsdpFinding("nonfinite-before", rank, index,
                                         f"{int(np.sum(call['in_nonfinite']))} NaN/Inf in its local gradient before the reduce-scatter"))
        if any(f.check == "nonfinite-before" and f.call == index and f.rank in group for f in found):
            continue  # a NaN/Inf input makes every output non-finite: the input's rank is the finding
        for position, (rank, call) in enumerate(zip(group, members)):
            if call["out_nonfinite"]:
                found.append(FsdpFinding("nonfinite-after", rank, index,
                                         f"{call['out_nonfinite']} NaN/Inf in its reduce-scatter output, from finite inputs"))
                continue
            if call["reduction"] is None:
                continue
            local = np.stack([np.asarray(m["in_sketch"])[position] for m in members])  # (W, k)
            norms = np.array([np.asarray(m["in_norm"])[position] for m in members])  # (W,)
            residual = float(tolerance.allreduce_residual(local, np.asarray(call["out_sketch"]), call["reduction"]))
            allowed = float(tolerance.allreduce_tolerance(call["dtype"], norms, np.float64(call["out_norm"]), call["reduction"]))
            if residual > allowed:
                found.append(FsdpFinding("reduce-scatter", rank, index,
                                         f"its output differs from the {call['reduction']} of the ranks' chunks by {residual:.3g} "
                                         f"(tolerance {allowed:.3g}, {call['dtype']}, W={len(group)})"))
    if not found:
        found += _check_all_reduce(index, by_rank)
    return found


def _check_all_reduce(index: int, by_rank: dict[int, dict]) -> list[FsdpFinding]:
    """HSDP: each replica's all-reduce output against the sum of its replicas' reduce-scatter outputs."""
    found = []
    groups = {tuple(call["ar_group"]) for call in by_rank.values() if call["ar_group"]}
    for group in sorted(groups):
        members = [by_rank[r] for r in group]
        if any(m["ar_sketch"] is None or m["out_sketch"] is None for m in members):
            continue
        local = np.stack([np.asarray(m["out_sketch"]) for m in members])  # (R, k): the replicas' shards
        norms = np.array([m["out_norm"] for m in members])
        # FSDP2 all-reduces with AVG exactly when it reduce-scatters with AVG, else with SUM
        reduction = "mean" if members[0]["reduction"] == "mean" else "sum"
        for rank, call in zip(group, members):
            if call["ar_nonfinite"]:
                found.append(FsdpFinding("nonfinite-after", rank, index,
                                         f"{call['ar_nonfinite']} NaN/Inf in its replica all-reduce output, from finite shards"))
                continue
            residual = float(tolerance.allreduce_residual(local, np.asarray(call["ar_sketch"]), reduction))
            allowed = float(tolerance.allreduce_tolerance(call["dtype"], norms, np.float64(call["ar_norm"]), reduction))
            if residual > allowed:
                found.append(FsdpFinding("all-reduce", rank, index,
                                         f"its replica all-reduce output differs from the {reduction} of the replicas' shards by "
                                         f"{residual:.3g} (tolerance {allowed:.3g}, {call['dtype']}, {len(group)} replicas)"))
    return found


def watch(model: torch.nn.Module, *, sketch_k: int = C.DEFAULT_SKETCH_K, seed: int = C.DEFAULT_SEED,
          inject: Injector | None = None) -> FsdpMonitor:
    """Installs the checked reduce-scatter on every ``fully_shard`` module of ``model``.

    Wraps the comm each module's parameter group already has (the default, or one the job set
    with ``set_custom_reduce_scatter``). Refuses, in one line, a model without ``fully_shard``
    modules and a torch whose FSDP2 has no ``set_custom_reduce_scatter`` (checked by feature).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        raise UsageError("this torch has no FSDP2 (torch.distributed.fsdp.FSDPModule): the FSDP checks need it") from None
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise UsageError("no fully_shard module in this model: call fully_shard on it (and its blocks) before watch()")
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise UsageError("this torch's FSDP2 has no set_custom_reduce_scatter: the reduce-scatter check cannot be installed "
                         "(torch 2.8 or later has it)")
    monitor = FsdpMonitor(sketch_k=sketch_k, seed=seed, inject=inject)
    for module in modules:
        state = module._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            inner = getattr(group, "_reduce_scatter_comm", None)
            if isinstance(inner, _CheckedReduceScatter):
                raise UsageError("this model is already watched: one watch() per model")
            if inner is None:
                from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

                inner = DefaultReduceScatter()
            checked = _CheckedReduceScatter(monitor, inner)
            group._reduce_scatter_comm = checked
            if getattr(group, "_is_hsdp", False):  # the replica all-reduce: checked after it, then the job's hook
                user_hook = getattr(group, "_all_reduce_hook", None)
                group._all_reduce_hook = _all_reduce_hook(monitor, checked, group._all_reduce_process_group, user_hook)
    return monitor


def _all_reduce_hook(monitor: FsdpMonitor, checked: _CheckedReduceScatter, process_group, user_hook):
    def hook(output: torch.Tensor) -> None:
        monitor._after_all_reduce(checked.last, output, process_group)
        if user_hook is not None:
            user_hook(output)
    return hook
