"""The reduce-scatter check and the NaN/Inf checks of an FSDP2 job, online, every step.

FSDP2 reduce-scatters each parameter group's gradients: every rank's input is its whole local
gradient (``W`` chunks, chunk ``r`` destined for rank ``r``), every rank's output is the sum (or
mean) of everybody's chunk for it. :func:`watch` wraps each ``fully_shard`` module's
reduce-scatter (``set_custom_reduce_scatter``, around whatever comm the job set) so that, per call,
every rank sketches the ``W`` chunks of its input and its output (``docs/fingerprints.md``: the
same linear sketch as DDP's all-reduce check, chunk and output at the same block offsets) and
counts their NaN/Inf. :meth:`FsdpMonitor.check`, called by every rank once per step (after
``backward``, before ``optimizer.step()``), sums each chunk's numbers over the group (one
all-reduce of ``W x (k + 3)`` numbers per call: linear in ``W``), lets each rank judge its own
output, and gathers the verdicts:

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

Over 400 lines on purpose: the wrapped reduce-scatter, the HSDP all-reduce hook and the check
share one record of each call (the scales read from the op, the pending sketches) and one
decision; split, the rule pairing an all-reduce with the reduce-scatters it sums would be in two
places.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcAlarm, UsageError
from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core, tolerance
from sdc_forensics.inject import FSDP_LOCATIONS
from sdc_forensics.recorder.checks import Check, Finding

#: The locations a fault drill can hit (``watch(model, inject=["reduce-scatter-output:step=2:rank=1:bit=29"])``).
LOCATIONS = FSDP_LOCATIONS

#: A fault drill: ``inject(location, call_index, tensor)`` may change ``tensor`` in place;
#: locations ``"local-gradient"`` (the input, before it is read), ``"reduce-scatter-output"``
#: (this rank's output, after the collective) and, HSDP, ``"all-reduce-output"`` (after the replicas' all-reduce).
Injector = Callable[[str, int, torch.Tensor], None]


#: The monitor's findings are the recorder's one finding type, with the finer checks
#: (``Check.NONFINITE_BEFORE``, ``NONFINITE_AFTER``, ``REDUCE_SCATTER``, ``REPLICA_ALL_REDUCE``), the
#: reduce-scatter ``call`` of the step and the rank's ``where``; the old name stays importable.
FsdpFinding = Finding


def _line(finding: Finding, step: int) -> str:
    """One finding of the monitor as a line: which step, which reduce-scatter call, which rank."""
    where = f" ({finding.where})" if finding.where else ""
    return f"step {step}, reduce-scatter {finding.call}: rank {finding.rank}{where}: {finding.detail}"


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """What :meth:`FsdpMonitor.check` found at one step (the same on every rank)."""

    step: int
    calls: int
    findings: tuple[Finding, ...]
    # a line when nothing could be checked although something should have been
    note: str = ""

    @property
    def clean(self) -> bool:
        return not self.findings

    @property
    def suspects(self) -> tuple[int, ...]:
        return tuple(sorted({f.rank for f in self.findings}))

    def lines(self) -> list[str]:
        return [_line(f, self.step) for f in self.findings] or [
            self.note or f"step {self.step}: {self.calls} reduce-scatter(s) checked, clean"
        ]


@dataclasses.dataclass
class _Call:
    """One reduce-scatter on this rank; the sketches stay pending (on the device) until ``check``."""

    # global ranks of the reduce-scatter's group, in group order
    group: tuple[int, ...]
    dtype: str
    # output = scale * sum of the chunks (None: an op this check cannot model)
    scale: float | None
    # HSDP: all-reduce output = ar_scale * sum of its inputs
    ar_scale: float
    # W pending fingerprints: this rank's chunk r, r < W
    inputs: list
    # pending fingerprint of the output
    output: object = None
    # HSDP: global ranks of the replica all-reduce's group
    ar_group: tuple[int, ...] = ()
    # pending fingerprint of the all-reduce's output
    ar_output: object = None
    # the calls whose outputs this all-reduce sums (accumulation adds earlier ones)
    ar_inputs: tuple[int, ...] = ()
    # the reduce-scatter's process group (the check all-reduces the chunks' numbers over it)
    pg: object = None
    # HSDP: the replica all-reduce's
    ar_pg: object = None
    # where the collective ran (the check's numbers travel there: gloo on CPU, NCCL on CUDA)
    device: object = None


def _row(fp: core.Fingerprint) -> list[float]:
    return [*map(float, fp.sketch), float(fp.norm), float(fp.nonfinite)]


def _scales(op, group_size: int, param_group) -> tuple[float | None, float]:
    """``(reduce-scatter scale, all-reduce scale)``: the output is ``scale * sum``.

    FSDP2 (torch's ``_get_gradient_divide_factors``) reduce-scatters with ``AVG``, ``SUM`` (after a
    pre-division the input already carries) or ``PREMUL_SUM(1 / factor)``, and all-reduces HSDP
    replicas with ``AVG`` exactly when it reduce-scatters with ``AVG`` and no divide factor is set,
    else with ``SUM``.
    """
    factor = getattr(param_group, "gradient_divide_factor", None)
    ar_size = 1
    if getattr(param_group, "_is_hsdp", False):
        try:
            ar_size = param_group._all_reduce_process_group.size()
        except Exception:  # noqa: BLE001 - private API; the all-reduce check then assumes SUM
            ar_size = 1
    if op == dist.ReduceOp.SUM:
        return 1.0, 1.0
    if op == dist.ReduceOp.AVG:
        return 1.0 / group_size, (1.0 / ar_size if factor is None else 1.0)
    # PREMUL_SUM(1 / factor)
    if factor:
        return 1.0 / float(factor), 1.0
    return None, 1.0


class _CheckedReduceScatter:
    """The custom reduce-scatter :func:`watch` installs for one parameter group."""

    def __init__(self, monitor: "FsdpMonitor", inner, param_group) -> None:
        self._monitor = monitor
        self._inner = inner
        self._param_group = param_group
        # this group's calls since its last all-reduce (HSDP accumulation)
        self.pending: list[int] = []
        # the group's own comm and all-reduce hook, given back by uninstall
        self.restore: tuple = (None, None)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        index = self._monitor._before(
            input_tensor, group, _scales(op, group.size(), self._param_group), self._param_group
        )
        self.pending.append(index)
        work = self._inner(output_tensor, input_tensor, group, op, async_op)
        if work is not None and async_op:
            # the output is read below; on CUDA this orders the current stream, no host sync
            work.wait()
        self._monitor._after(index, output_tensor)
        return work


class FsdpMonitor:
    """Per-step numbers of every reduce-scatter on this rank, and the collective check of them.

    The sketches are started with ``fingerprint_async`` inside the collective's stream and
    resolved together in :meth:`check`: one device-to-host transfer per step on CUDA (none on CPU).
    """

    def __init__(
        self,
        *,
        sketch_k: int = C.DEFAULT_SKETCH_K,
        seed: int = C.DEFAULT_SEED,
        inject: Injector | None = None,
        start_step: int = 0,
    ):
        self._k = sketch_k
        self._seed = seed
        self._inject = inject
        # the step the reduce-scatters now running belong to: the last checked + 1
        self.step = start_step
        # this rank's host, device and mesh coordinates (set by watch)
        self.place = ""
        # every rank's, gathered at the first check
        self._places: list[str] | None = None
        self._lock = threading.Lock()
        self._calls: list[_Call] = []

    def _sketch(self, x: torch.Tensor):
        return core.fingerprint_async(x, k=self._k, seed=self._seed, with_digest=False)

    def _before(self, input_tensor: torch.Tensor, group, scales: tuple[float | None, float], param_group=None) -> int:
        ranks = tuple(dist.get_process_group_ranks(group))
        call = _Call(
            group=ranks,
            dtype=str(input_tensor.dtype).removeprefix("torch."),
            scale=scales[0],
            ar_scale=scales[1],
            inputs=[],
            pg=group,
            device=input_tensor.device,
        )
        # the slot is reserved before anything reads the input
        with self._lock:
            index = len(self._calls)
            self._calls.append(call)
        if self._inject is not None:
            self._inject("local-gradient", index, input_tensor)
        # the W chunks in one kernel call (the same numbers as one call each)
        chunks = input_tensor.reshape(-1).chunk(len(ranks))
        call.inputs = core.fingerprints_async(chunks, k=self._k, seed=self._seed, with_digest=False)
        return index

    def _after(self, index: int, output_tensor: torch.Tensor) -> None:
        if self._inject is not None:
            self._inject("reduce-scatter-output", index, output_tensor)
        self._calls[index].output = self._sketch(output_tensor)

    def _after_all_reduce(self, checked: _CheckedReduceScatter, output: torch.Tensor, group) -> None:
        sums, checked.pending = tuple(checked.pending), []
        # FSDP skipped the reduce-scatter (a shard group of one): nothing to compare with
        if not sums:
            return
        index = sums[-1]
        if self._inject is not None:
            self._inject("all-reduce-output", index, output)
        call = self._calls[index]
        call.ar_group = tuple(dist.get_process_group_ranks(group))
        call.ar_pg = group
        call.ar_inputs = sums
        call.ar_output = self._sketch(output)

    def _numbers(self, calls: list[_Call]) -> list[dict]:
        """The calls' numbers on the host: one ``resolve`` for every pending sketch of the step."""
        pending = []
        for call in calls:
            pending += call.inputs + [call.output] + ([call.ar_output] if call.ar_output is not None else [])
        done = iter(core.resolve([p for p in pending if p is not None]))
        out = []
        for call in calls:
            inputs = [_row(next(done)) for _ in call.inputs]
            output = _row(next(done)) if call.output is not None else None
            ar_output = _row(next(done)) if call.ar_output is not None else None
            out.append(
                {
                    "group": list(call.group),
                    "dtype": call.dtype,
                    "scale": call.scale,
                    "ar_scale": call.ar_scale,
                    "inputs": inputs,
                    "output": output,
                    "ar_group": list(call.ar_group),
                    "ar_output": ar_output,
                    "ar_inputs": list(call.ar_inputs),
                }
            )
        return out

    def step_words(self) -> list[int]:
        """This rank's ``[reduce-scatters so far this step, a checksum of which were all-reduced
        (HSDP)]``: what :meth:`check` compares across ranks, for a caller that gathers them with
        words of its own (the recorder) and hands the table to :meth:`check`."""
        with self._lock:
            calls = list(self._calls)
        return _words_of(calls)

    def check(self, step: int, *, policy: str = "return", gathered: np.ndarray | None = None) -> StepCheck:
        """Gathers this step's numbers from every rank and checks every reduce-scatter call.

        Every rank calls it at the same point of every step, after the step's last backward
        (it is a collective).

        Args:
            step: the optimizer step (for the findings and the alarm).
            policy: ``"return"`` the result, or ``"raise"`` :class:`~sdc_forensics.errors.SdcAlarm`
                on every rank when a check fires (its rank: the one suspect, else -1).
            gathered: every rank's :meth:`step_words` ``(W, 2)``, gathered by the caller since the
                step's last reduce-scatter (else this gathers them).
        """
        if policy not in ("return", "raise"):
            raise UsageError(f"policy must be 'return' or 'raise', not {policy!r}")
        with self._lock:
            mine, self._calls = self._calls, []
        numbers = self._numbers(mine)
        ar_calls = tuple(i for i, call in enumerate(mine) if call.ar_output is not None)
        if self._places is None:
            # once: every rank's place (strings, pickled)
            places: list = [None] * dist.get_world_size()
            dist.all_gather_object(places, self.place)
            self._places = [str(place) for place in places]
        # every step: two numbers per rank in one tensor gather (no pickling), or the caller's
        first = np.asarray(gathered) if gathered is not None else _gather_words(_words_of(mine))
        counts = set(first[:, 0].tolist())
        if len(counts) > 1:
            raise UsageError(
                f"step {step}: ranks made different numbers of reduce-scatters ({sorted(counts)}): "
                "call check() at the same point of the step on every rank"
            )
        calls = counts.pop() if counts else 0
        # else unpaired: not checked
        with_all_reduce = ar_calls if len(set(first[:, 1].tolist())) == 1 else ()
        own = _own_findings(mine, numbers, with_all_reduce, self._k)
        findings = []
        # the findings themselves (objects) are gathered only on a step where some rank has one
        if _gather_words([len(own)])[:, 0].any():
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, own)
            findings = _ordered([f for per_rank in everyone for f in per_rank])
        note = ""
        if not calls and dist.get_world_size() > 1:
            note = (
                f"step {step}: no reduce-scatter was seen: check() before backward, a shard group of one, or a comm set "
                "after watch() replaced the checked one (call watch() last)"
            )
        findings = [dataclasses.replace(f, where=self._places[f.rank]) for f in findings]
        result = StepCheck(step=step, calls=calls, findings=tuple(findings), note=note)
        self.step = step + 1
        if policy == "raise" and not result.clean:
            rank = result.suspects[0] if len(result.suspects) == 1 else -1
            raise SdcAlarm("; ".join(result.lines()), step=step, rank=rank, check=result.findings[0].check)
        return result


def _words_of(calls: list[_Call]) -> list[int]:
    """``[how many reduce-scatters, a checksum of which of them were all-reduced]``."""
    ar_calls = [i for i, call in enumerate(calls) if call.ar_output is not None]
    return [len(calls), zlib.crc32(np.asarray(ar_calls, dtype=np.int64).tobytes())]


def _gather_words(words: list[int]) -> np.ndarray:
    """``(W, n)`` int64: every rank's ``n`` words, one ``all_gather`` of a tensor (on the current
    CUDA device under NCCL, which takes no CPU tensors)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out).cpu().numpy()


def _split(row: list[float], k: int) -> tuple[np.ndarray, float, int]:
    return np.asarray(row[:k]), float(row[k]), int(row[k + 1])


def _terms(row: list[float], k: int) -> list[float]:
    """A row's numbers that add across ranks: the sketch, the squared norm, the norm, the NaN/Inf count."""
    return [*row[:k], row[k] * row[k], row[k], row[k + 1]]


def _summed_by_group(calls: list[_Call], rows: list[list[list[float]]], k: int) -> list[np.ndarray]:
    """Each call's rows summed over its reduce-scatter group: the calls of one group (every call of
    a step, in FSDP and HSDP alike) in one all-reduce, groups in the order of their first call."""
    by_group: dict[tuple[int, ...], list[int]] = {}
    for index, call in enumerate(calls):
        by_group.setdefault(call.group, []).append(index)
    out: list = [None] * len(calls)
    # insertion order: first calls' order, the same on every rank of a group
    for indices in by_group.values():
        width = len(rows[indices[0]])
        summed = sum_over([row for i in indices for row in rows[i]], calls[indices[0]].pg, calls[indices[0]].device, k)
        for n, i in enumerate(indices):
            out[i] = summed[n * width : (n + 1) * width]
    return out


def sum_over(rows: list[list[float]], group, device, k: int) -> np.ndarray:
    """``rows`` (the same shape on every rank of ``group``) summed over the group: one all-reduce."""
    table = torch.tensor([_terms(row, k) for row in rows], dtype=torch.float64, device=device)
    dist.all_reduce(table, group=group)
    return table.cpu().numpy()


def sum_check(total: np.ndarray, count: int, scale: float, sketch: np.ndarray, norm: float, dtype: str, k: int) -> str:
    """``""`` when ``sketch`` is ``scale`` times the sum of ``count`` inputs whose terms add to
    ``total`` (``[sketch.., sum of squared norms, sum of norms, NaN/Inf]``), within the calibrated
    tolerance (``tolerance.allreduce_tolerance`` from the same sums), else what differs."""
    residual = float(np.abs(np.asarray(sketch, dtype=np.float64) - scale * total[:k]).max())
    if np.isnan(residual):
        residual = float("inf")
    s = abs(scale)
    reduced = float(np.fmin(abs(norm), s * total[k + 1] * (1.0 + 1e-2)))
    allowed = tolerance.relative_tolerance(dtype, count) * float(np.sqrt(reduced**2 + s * s * total[k]))
    if residual > allowed:
        return f"differs from {scale:.4g} x the sum of its inputs by {residual:.3g} (tolerance {allowed:.3g}, {dtype})"
    return ""


def _ordered(pairs: list[tuple[int, Finding]]) -> list[Finding]:
    """Every rank's ``(phase, finding)`` pairs as one list, in one order (call, phase, rank); an
    all-reduce finding (phase 2) only for a call whose reduce-scatter was clean (phases 0 and 1:
    a NaN/Inf input, or a wrong output, makes the all-reduce wrong too)."""
    scattered = {f.call for phase, f in pairs if phase < 2}
    kept = [(phase, f) for phase, f in pairs if phase < 2 or f.call not in scattered]
    return [f for _, f in sorted(kept, key=lambda pair: (pair[1].call, pair[0], pair[1].rank))]


def _own_findings(
    calls: list[_Call], numbers: list[dict], with_all_reduce: tuple[int, ...], k: int
) -> list[tuple[int, Finding]]:
    """This rank's ``(phase, finding)`` pairs of the step (collectives: every rank of a group runs
    them alike; phase 0 a NaN/Inf input, 1 the reduce-scatter output, 2 the all-reduce output).

    Each reduce-scatter group's chunk numbers are summed over the group (one all-reduce of
    ``W x (k + 3)`` numbers per call, not a gather of everybody's: the traffic grows with the
    group, not with its square); each rank then checks its own output against its chunk's sum.
    HSDP: each rank's all-reduce output against the sum, over the replicas, of the reduce-scatter
    outputs it adds (one all-reduce of ``k + 3`` numbers)."""
    rank = dist.get_rank()
    found: list[tuple[int, Finding]] = []
    totals = _summed_by_group(calls, [nums["inputs"] for nums in numbers], k)
    for index, (call, nums) in enumerate(zip(calls, numbers)):
        own_nan = sum(int(row[k + 1]) for row in nums["inputs"])
        if own_nan:
            found.append(
                (
                    0,
                    Finding(
                        check=Check.NONFINITE_BEFORE,
                        rank=rank,
                        call=index,
                        detail=f"{own_nan} NaN/Inf in its local gradient before the reduce-scatter",
                    ),
                )
            )
        # (W, k + 3): chunk c summed over the group
        total = totals[index]
        if total[:, k + 2].sum() or nums["output"] is None:
            # a NaN/Inf input makes every output non-finite: the input's rank is the finding
            continue
        sketch, norm, nonfinite = _split(nums["output"], k)
        if nonfinite:
            found.append(
                (
                    1,
                    Finding(
                        check=Check.NONFINITE_AFTER,
                        rank=rank,
                        call=index,
                        detail=f"{nonfinite} NaN/Inf in its reduce-scatter output, from finite inputs",
                    ),
                )
            )
        elif call.scale is not None:
            problem = sum_check(total[call.group.index(rank)], len(call.group), call.scale, sketch, norm, call.dtype, k)
            if problem:
                found.append(
                    (
                        1,
                        Finding(
                            check=Check.REDUCE_SCATTER,
                            rank=rank,
                            call=index,
                            detail=f"its output {problem} (W={len(call.group)})",
                        ),
                    )
                )
    paired = [i for i in with_all_reduce if all(numbers[j]["output"] is not None for j in calls[i].ar_inputs)]
    by_replicas: dict[tuple[int, ...], list[int]] = {}
    for index in paired:
        by_replicas.setdefault(calls[index].ar_group, []).append(index)
    ar_totals: dict[int, np.ndarray] = {}
    # one all-reduce per replica group: each call's summed reduce-scatter outputs
    for indices in by_replicas.values():
        rows = []
        for i in indices:
            parts = [numbers[j]["output"] for j in calls[i].ar_inputs]
            # the terms of the outputs it adds
            summed = np.sum([_terms(p, k) for p in parts], axis=0)
            rows.append(summed)
        table = torch.tensor(np.array(rows), dtype=torch.float64, device=calls[indices[0]].device)
        dist.all_reduce(table, group=calls[indices[0]].ar_pg)
        for n, i in enumerate(indices):
            ar_totals[i] = table[n].cpu().numpy()
    for index in paired:
        call, nums = calls[index], numbers[index]
        parts = call.ar_inputs
        total = ar_totals[index]
        sketch, norm, nonfinite = _split(nums["ar_output"], k)
        if nonfinite and not total[k + 2]:
            found.append(
                (
                    2,
                    Finding(
                        check=Check.NONFINITE_AFTER,
                        rank=rank,
                        call=index,
                        detail=f"{nonfinite} NaN/Inf in its replica all-reduce output, from finite shards",
                    ),
                )
            )
        elif not nonfinite and not total[k + 2]:
            problem = sum_check(total, len(call.ar_group) * len(parts), call.ar_scale, sketch, norm, call.dtype, k)
            if problem:
                found.append(
                    (
                        2,
                        Finding(
                            check=Check.REPLICA_ALL_REDUCE,
                            rank=rank,
                            call=index,
                            detail=f"its replica all-reduce output {problem} ({len(call.ar_group)} replicas)",
                        ),
                    )
                )
    return found


def spec_injector(specs, monitor_step: Callable[[], int]) -> Injector:
    """A drill from fault specs ``LOCATION:step=S:rank=R:bit=B[:element=I]`` (``LOCATIONS``; the
    first reduce-scatter of the step, the element 0 unless given), as the DDP recorder's ``--inject``."""
    from sdc_forensics.inject import flip_bit_, parse_spec

    parsed = [parse_spec(text, LOCATIONS) for text in ([specs] if isinstance(specs, str) else specs)]
    if any(spec.location == "all-gather-output" for spec in parsed):
        raise UsageError(
            "all-gather-output drills are the Recorder's (Recorder(..., inject=[...])): watch() sees only "
            "the reduce-scatter and the all-reduce"
        )
    rank = dist.get_rank() if dist.is_initialized() else 0

    def inject(location: str, call: int, tensor: torch.Tensor) -> None:
        for spec in parsed:
            if spec.location == location and spec.rank == rank and spec.step == monitor_step() and call == 0:
                flat = tensor.reshape(-1)
                flip_bit_(flat, (spec.element or 0) % flat.numel(), spec.bit)

    return inject


def watch(
    model: torch.nn.Module,
    *,
    sketch_k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
    inject=None,
    start_step: int = 0,
) -> FsdpMonitor:
    """Installs the checked reduce-scatter on every ``fully_shard`` module of ``model``.

    ``inject``: fault drills, a callable (:data:`Injector`) or fault specs (:func:`spec_injector`);
    ``start_step``: the step of the first reduce-scatters (a resumed job's), which the specs count from.

    Wraps the comm each module's parameter group already has (the default, or one the job set
    with ``set_custom_reduce_scatter``). Refuses, in one line, a model without ``fully_shard``
    modules and a torch whose FSDP2 has no ``set_custom_reduce_scatter`` (checked by feature).
    """
    require_fsdp2(model, "watch()")
    from sdc_forensics.recorder.fsdp_checks import rank_place

    monitor = FsdpMonitor(sketch_k=sketch_k, seed=seed, start_step=start_step)
    monitor.place = rank_place(model)
    if inject is not None and not callable(inject):
        inject = spec_injector(inject, lambda: monitor.step)
    monitor._inject = inject
    install(model, monitor)
    return monitor


def require_fsdp2(model: torch.nn.Module, what: str, *, custom_reduce_scatter: bool = True) -> None:
    """Refuse, in one line, a model without ``fully_shard`` modules and (``custom_reduce_scatter``)
    a torch whose FSDP2 has no ``set_custom_reduce_scatter`` (checked by feature, not version)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        raise UsageError(
            "this torch has no FSDP2 (torch.distributed.fsdp.FSDPModule): the FSDP checks need it"
        ) from None
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise UsageError(f"no fully_shard module in this model: call fully_shard on it (and its blocks) before {what}")
    if custom_reduce_scatter and not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise UsageError(
            "this torch's FSDP2 has no set_custom_reduce_scatter: the reduce-scatter check cannot be installed "
            "(torch 2.8 or later has it)"
        )


def groups_of(module: torch.nn.Module) -> list:
    """The FSDP2 parameter groups of one ``fully_shard`` module's state."""
    state = module._get_fsdp_state()
    found = list(getattr(state, "_fsdp_param_groups", None) or ())
    # FSDP2 before multi-group states
    if not found and getattr(state, "_fsdp_param_group", None) is not None:
        found = [state._fsdp_param_group]
    return found


def param_groups(model: torch.nn.Module) -> list:
    """Every FSDP2 parameter group of ``model`` once (``fully_shard([a, b])`` gives a and b one state)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {}
    for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
        for group in groups_of(module):
            groups[id(group)] = group
    if not groups:
        raise UsageError(
            "this torch's fully_shard keeps its parameter groups where watch() cannot find them: "
            "the reduce-scatter check cannot be installed"
        )
    return list(groups.values())


def install(model: torch.nn.Module, monitor: FsdpMonitor, comm=None) -> None:
    """Put ``monitor``'s checked reduce-scatter on every parameter group of ``model``, around the
    comm the group has (or ``comm``, which replaces it: the recorder's ordered reduce-scatter)."""
    for group in param_groups(model):
        inner = getattr(group, "_reduce_scatter_comm", None)
        if isinstance(inner, _CheckedReduceScatter):
            raise UsageError("this model is already watched: one watch() (or Recorder) per model")
        if comm is not None:
            inner = comm
        elif inner is None:
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

            inner = DefaultReduceScatter()
        checked = _CheckedReduceScatter(monitor, inner, group)
        checked.restore = (getattr(group, "_reduce_scatter_comm", None), getattr(group, "_all_reduce_hook", None))
        group._reduce_scatter_comm = checked
        # the replica all-reduce: checked after it, then the job's hook
        if getattr(group, "_is_hsdp", False):
            user_hook = getattr(group, "_all_reduce_hook", None)
            group._all_reduce_hook = _all_reduce_hook(monitor, checked, group._all_reduce_process_group, user_hook)


def uninstall(model: torch.nn.Module) -> None:
    """Give every parameter group of ``model`` back the reduce-scatter and all-reduce hook it had
    before :func:`install` (a closed recorder reads and changes nothing more)."""
    for group in param_groups(model):
        checked = getattr(group, "_reduce_scatter_comm", None)
        if isinstance(checked, _CheckedReduceScatter):
            group._reduce_scatter_comm, hook = checked.restore
            if getattr(group, "_is_hsdp", False):
                group._all_reduce_hook = hook


def _all_reduce_hook(monitor: FsdpMonitor, checked: _CheckedReduceScatter, process_group, user_hook):
    def hook(output: torch.Tensor) -> None:
        monitor._after_all_reduce(checked, output, process_group)
        if user_hook is not None:
            user_hook(output)

    return hook
