"""The reduce-scatter check and the NaN/Inf checks of an FSDP2 job, online, every step.

FSDP2 reduce-scatters each parameter group's gradients: every rank's input is its whole local
gradient (``W`` chunks, chunk ``r`` destined for rank ``r``), every rank's output is the sum (or
mean) of everybody's chunk for it. :func:`watch` wraps each ``fully_shard`` module's
reduce-scatter (``set_custom_reduce_scatter``, around whatever comm the job set) so that, per call,
every rank sketches the ``W`` chunks of its input and its output (``docs/fingerprints.md``: the
same linear sketch as DDP's all-reduce check, chunk and output at the same block offsets) and
counts their NaN/Inf. :meth:`FsdpMonitor.check`, called by every rank once per step (after
``backward``, before ``optimizer.step()``), judges them from one table summed over the world
(one all-reduce, :func:`step_table`: each rank adds each chunk's numbers into its destination's
row and its own output into its own; ``calls x W`` rows, linear in ``W``), so every rank reads
every rank's numbers and reaches the same verdicts with no second collective.
:meth:`FsdpMonitor.launch` starts that all-reduce in the background (the recorder launches it
with its own words, and with ``deferred_checks`` resolves both when the next step begins):

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
from sdc_forensics.recorder import exchange
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
    # this rank's chunks r < W: their (W, k + 2) rows (the CPU kernel's one call), or W pending fingerprints
    inputs: object
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


@dataclasses.dataclass
class _Launched:
    """A step's check in flight: its calls, where its table keeps what, the all-reduce of the table."""

    calls: list[_Call]
    cols: "_Columns"
    summed: "exchange.Summed"


def chunk_sketches(input_tensor: torch.Tensor, parts: int, k: int, seed: int):
    """A reduce-scatter input's ``parts`` chunks sketched in one kernel call (the same numbers as
    one call each): on the CPU kernel one ``(parts, k + 2)`` array of their rows, else a pending
    fingerprint per chunk (resolved with the step's others)."""
    rows = core.chunk_rows(input_tensor, parts, k=k, seed=seed)
    if rows is None:
        chunks = input_tensor.reshape(-1).chunk(parts)
        rows = core.fingerprints_async(chunks, k=k, seed=seed, with_digest=False)
    return rows


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
        # whether a replica all-reduce follows the reduce-scatters (set by install: HSDP)
        self.hsdp = False
        # the step whose check :meth:`launch` started
        self._launched: _Launched | None = None
        # a pipeline's: the most reduce-scatters a rank makes in a step (set once, the same on
        # every rank); ranks of different stages may make different numbers, the table has this many
        self.slots: int | None = None

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
        call.inputs = chunk_sketches(input_tensor, len(ranks), self._k, self._seed)
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
            listed = [] if isinstance(call.inputs, np.ndarray) else call.inputs
            pending += listed + [call.output] + ([call.ar_output] if call.ar_output is not None else [])
        done = iter(core.resolve([p for p in pending if p is not None]))
        out = []
        for call in calls:
            # (W, k + 2): each chunk's [sketch, norm, NaN/Inf]
            if isinstance(call.inputs, np.ndarray):
                inputs = call.inputs
            else:
                inputs = np.array([_row(next(done)) for _ in call.inputs], dtype=np.float64).reshape(-1, self._k + 2)
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
        words of its own (the recorder) and hands the table to :meth:`check`; after :meth:`launch`,
        those of the launched step."""
        if self._launched is not None:
            return _words_of(self._launched.calls)
        with self._lock:
            calls = list(self._calls)
        return _words_of(calls)

    def launch(self) -> None:
        """Start this step's check in the background: the calls' numbers into the step's table
        (:func:`step_table`), all-reduced over the world with ``async_op=True``; :meth:`check`
        waits for it. Every rank calls it at the same point (a collective), after the step's last
        backward. On CUDA the sketches are read to the host here (one transfer); the table goes
        back to the device and the host never waits for the collective."""
        with self._lock:
            mine, self._calls = self._calls, []
        numbers = self._numbers(mine)
        cols = _Columns(self._k, self.hsdp)
        # (a pipeline's table has its slots: more calls than that is refused by check, on every rank)
        slots = len(mine) if self.slots is None else self.slots
        table = step_table(mine[:slots], numbers[:slots], cols, dist.get_rank(), dist.get_world_size(), slots)
        self._launched = _Launched(calls=mine, cols=cols, summed=exchange.Summed(table))

    def check(self, step: int, *, policy: str = "return", gathered: np.ndarray | None = None) -> StepCheck:
        """Every reduce-scatter call of this step checked, on every rank's numbers.

        Every rank calls it at the same point of every step, after the step's last backward
        (it is a collective), or after :meth:`launch` (which started it).

        Args:
            step: the optimizer step (for the findings and the alarm).
            policy: ``"return"`` the result, or ``"raise"`` :class:`~sdc_forensics.errors.SdcAlarm`
                on every rank when a check fires (its rank: the one suspect, else -1).
            gathered: every rank's :meth:`step_words` ``(W, 2)``, gathered by the caller since the
                step's last reduce-scatter (else this gathers them).
        """
        if policy not in ("return", "raise"):
            raise UsageError(f"policy must be 'return' or 'raise', not {policy!r}")
        if self._places is None:
            # once: every rank's place (strings, pickled)
            places: list = [None] * dist.get_world_size()
            dist.all_gather_object(places, self.place)
            self._places = [str(place) for place in places]
        # two numbers per rank in one tensor gather (no pickling), or the caller's
        first = np.asarray(gathered) if gathered is not None else _gather_words(self.step_words())
        counts = set(first[:, 0].tolist())
        if self.slots is not None and max(counts) > self.slots:
            self._launched = None
            raise UsageError(
                f"step {step}: a rank made {max(counts)} reduce-scatters, more than the {self.slots} parameter groups "
                "of its stage(s): a group reduce-scattered twice (accumulation that communicates every microbatch)"
            )
        if self.slots is None and len(counts) > 1:
            self._launched = None
            raise UsageError(
                f"step {step}: ranks made different numbers of reduce-scatters ({sorted(counts)}): "
                "call check() at the same point of the step on every rank"
            )
        # launched before the counts were known only where the recorder launched it (the counts
        # of one model's reduce-scatters agree on every rank, or FSDP's own collectives would not)
        if self._launched is None:
            self.launch()
        launched, self._launched = self._launched, None
        calls = len(launched.calls)
        # else unpaired: the replica all-reduces are not checked (a pipeline's stages all-reduce
        # different calls: each row says whether all its replicas added to it)
        paired = self.slots is not None or len(set(first[:, 1].tolist())) == 1
        summed = launched.summed.table()
        rows = calls if self.slots is None else self.slots
        findings = findings_of(summed, rows, dist.get_world_size(), launched.cols, paired)
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


def collective_device() -> torch.device:
    """Where the check's own collectives run: the current CUDA device under NCCL (which takes no CPU tensors)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _gather_words(words: list[int]) -> np.ndarray:
    """``(W, n)`` int64: every rank's ``n`` words, one ``all_gather`` of a tensor."""
    mine = torch.tensor(words, dtype=torch.int64, device=collective_device())
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out).cpu().numpy()


def _split(row, k: int) -> tuple[np.ndarray, float, int]:
    return np.asarray(row[:k]), float(row[k]), int(row[k + 1])


def _terms_of(rows, k: int) -> np.ndarray:
    """The numbers of each row of ``rows`` (``(n, k + 2)``: sketch, norm, NaN/Inf count) that add
    across ranks: ``(n, k + 3)`` of the sketch, the squared norm, the norm, the NaN/Inf count."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, k + 2)
    norm = rows[:, k : k + 1]
    return np.concatenate([rows[:, :k], norm * norm, norm, rows[:, k + 1 : k + 2]], axis=1)


def _terms(row, k: int) -> np.ndarray:
    """:func:`_terms_of` of one row."""
    return _terms_of(row, k)[0]


def sum_over(rows: list[list[float]], group, device, k: int) -> np.ndarray:
    """``rows`` (the same shape on every rank of ``group``) summed over the group: one all-reduce."""
    table = torch.from_numpy(_terms_of(rows, k)).to(device)
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
    allowed = tolerance.relative_tolerance(dtype, count) * float(np.sqrt(reduced * reduced + s * s * total[k]))
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


#: the dtypes a reduce-scatter adds in, by their code in the step's table
_DTYPES = ("float32", "bfloat16", "float16", "float64")


class _Columns:
    """Where a ``(call, rank)`` row of the step's table (:func:`step_table`) keeps each number.

    Summed over every rank (one all-reduce), row ``(i, d)`` holds: ``IN``, the terms of every
    chunk destined for rank ``d`` in call ``i`` (each rank adds its chunk into its destination's
    row: the sum over ``d``'s group, as the reduce-scatter adds them); ``AR_IN`` (HSDP), the terms
    of the reduce-scatter outputs that ``d``'s replicas all-reduce (each adds its own into every
    replica's row) and ``AR_N`` how many replicas did; and what only rank ``d`` wrote (the other
    ranks add zeros, which change no number): its output, its all-reduce output, its NaN/Inf
    inputs, the call's scale, group and dtype. Every rank thus reads every rank's numbers and
    reaches the same findings: no verdict needs a second collective."""

    def __init__(self, k: int, hsdp: bool) -> None:
        self.k = k
        at = 0

        def take(n: int) -> slice:
            nonlocal at
            at += n
            return slice(at - n, at)

        self.IN, self.OUT = take(k + 3), take(k + 2)
        (self.HAS_OUT, self.OWN_NAN, self.SCALE, self.HAS_SCALE, self.SIZE, self.FIRST, self.DTYPE) = (
            take(1).start for _ in range(7)
        )
        if hsdp:
            self.AR_IN, self.AR_OUT = take(k + 3), take(k + 2)
            self.HAS_AR, self.AR_N, self.AR_SIZE, self.AR_SCALE, self.AR_COUNT = (take(1).start for _ in range(5))
        self.hsdp, self.width = hsdp, at


def step_table(
    calls: list[_Call], numbers: list[dict], cols: _Columns, rank: int, world: int, slots: int | None = None
) -> torch.Tensor:
    """This rank's ``(slots, W, width)`` float64 part of the step's table (:class:`_Columns`;
    ``slots`` defaults to its calls, the rest zero), on the device the collectives ran on;
    all-reduced (summed) over the world it is every rank's."""
    k = cols.k
    table = np.zeros((len(calls) if slots is None else slots, world, cols.width), dtype=np.float64)
    for i, (call, nums) in enumerate(zip(calls, numbers)):
        # chunk c's terms into its destination's row, every chunk at once
        inputs = np.asarray(nums["inputs"], dtype=np.float64).reshape(-1, k + 2)
        table[i, np.asarray(call.group, dtype=np.int64), cols.IN] = _terms_of(inputs, k)
        own = table[i, rank]
        if nums["output"] is not None:
            own[cols.OUT], own[cols.HAS_OUT] = nums["output"], 1
        own[cols.OWN_NAN] = inputs[:, k + 1].sum()
        if call.scale is not None:
            own[cols.SCALE], own[cols.HAS_SCALE] = call.scale, 1
        own[cols.SIZE], own[cols.FIRST] = len(call.group), call.group[0]
        own[cols.DTYPE] = _DTYPES.index(call.dtype) if call.dtype in _DTYPES else -1
        paired = nums["ar_output"] is not None and all(numbers[j]["output"] is not None for j in call.ar_inputs)
        if cols.hsdp and paired:
            # the terms of the reduce-scatter outputs it adds, into each replica's row
            summed = _terms_of([numbers[j]["output"] for j in call.ar_inputs], k).sum(axis=0)
            for dest in call.ar_group:
                table[i, dest, cols.AR_IN] += summed
                table[i, dest, cols.AR_N] += 1
            own[cols.AR_OUT], own[cols.HAS_AR] = nums["ar_output"], 1
            own[cols.AR_SIZE], own[cols.AR_SCALE] = len(call.ar_group), call.ar_scale
            own[cols.AR_COUNT] = len(call.ar_group) * len(call.ar_inputs)
    device = calls[0].device if calls else collective_device()
    # (a leading zero keeps a step without calls a non-empty collective)
    return torch.from_numpy(np.concatenate([[0.0], table.reshape(-1)])).to(device)


def _dtypes_of(rows: np.ndarray, cols: _Columns) -> list[str]:
    codes = rows[:, cols.DTYPE].astype(np.int64)
    if ((codes < 0) | (codes >= len(_DTYPES))).any():
        raise UsageError(f"a reduce-scatter in a dtype the check has no tolerance for (one of {', '.join(_DTYPES)})")
    return [_DTYPES[c] for c in codes.tolist()]


def _failing(total: np.ndarray, count: np.ndarray, scale: np.ndarray, out: np.ndarray, dtypes: list[str], k: int):
    """:func:`sum_check` of many rows at once (the same float64 operations, element by element):
    a boolean per row, True where it finds a difference."""
    residual = np.abs(out[:, :k] - scale[:, None] * total[:, :k]).max(axis=1)
    residual[np.isnan(residual)] = np.inf
    s = np.abs(scale)
    reduced = np.fmin(np.abs(out[:, k]), s * total[:, k + 1] * (1.0 + 1e-2))
    tolerances = {key: tolerance.relative_tolerance(*key) for key in set(zip(dtypes, count.tolist()))}
    relative = np.array([tolerances[key] for key in zip(dtypes, count.tolist())], dtype=np.float64)
    return residual > relative * np.sqrt(reduced * reduced + s * s * total[:, k])


def findings_of(summed: np.ndarray, calls: int, world: int, cols: _Columns, paired: bool) -> list[Finding]:
    """Every rank's findings from the summed table (the same numbers, so the same list, on every
    rank; ordered by :func:`_ordered`): phase 0 a NaN/Inf input, 1 the reduce-scatter output, 2
    the replica all-reduce output (``paired``: every rank all-reduced the same calls). The rows
    are judged together (numpy); lines are written for the rows found only."""
    k = cols.k
    found: list[tuple[int, Finding]] = []
    for i, rows in enumerate(summed[1:].reshape(calls, world, cols.width)):
        own_nan = rows[:, cols.OWN_NAN]
        for q in np.flatnonzero(own_nan).tolist():
            detail = f"{int(own_nan[q])} NaN/Inf in its local gradient before the reduce-scatter"
            found.append((0, Finding(check=Check.NONFINITE_BEFORE, rank=q, call=i, detail=detail)))
        # a NaN/Inf input makes every output of its group (named by its first rank) non-finite:
        # the input's rank is the finding
        _, group = np.unique(rows[:, cols.FIRST], return_inverse=True)
        judged = (np.bincount(group, weights=own_nan)[group] == 0) & (rows[:, cols.HAS_OUT] > 0)
        found += _judged(1, i, rows, judged & (rows[:, cols.HAS_SCALE] > 0), judged, cols, "scatter")
        # HSDP: checked where every replica added its outputs' terms, from finite inputs
        if cols.hsdp and paired:
            ar_in = rows[:, cols.AR_IN]
            judged = (rows[:, cols.HAS_AR] > 0) & (rows[:, cols.AR_N] == rows[:, cols.AR_SIZE]) & (ar_in[:, k + 2] == 0)
            found += _judged(2, i, rows, judged, judged, cols, "replicas")
    return _ordered(found)


def _judged(phase: int, call: int, rows: np.ndarray, summable, judged, cols: _Columns, which: str) -> list:
    """``(phase, finding)`` pairs of one call's rows: a non-finite output among the ``judged``
    rows, an output that is not the scaled sum of its inputs among the ``summable`` ones (the
    reduce-scatter's columns, or the replica all-reduce's)."""
    k = cols.k
    if which == "scatter":
        total, out, scale, count, what = cols.IN, cols.OUT, cols.SCALE, cols.SIZE, "reduce-scatter output"
        nonfinite_from, check = "finite inputs", Check.REDUCE_SCATTER
    else:
        total, out, scale, count, what = (
            cols.AR_IN,
            cols.AR_OUT,
            cols.AR_SCALE,
            cols.AR_COUNT,
            "replica all-reduce output",
        )
        nonfinite_from, check = "finite shards", Check.REPLICA_ALL_REDUCE
    nonfinite = rows[:, out][:, k + 1]
    found = [
        (
            phase,
            Finding(
                check=Check.NONFINITE_AFTER,
                rank=q,
                call=call,
                detail=f"{int(nonfinite[q])} NaN/Inf in its {what}, from {nonfinite_from}",
            ),
        )
        for q in np.flatnonzero(judged & (nonfinite > 0)).tolist()
    ]
    candidates = np.flatnonzero(summable & (nonfinite == 0))
    if not candidates.size:
        return found
    sub = rows[candidates]
    dtypes = _dtypes_of(sub, cols)
    bad = candidates[_failing(sub[:, total], sub[:, count].astype(np.int64), sub[:, scale], sub[:, out], dtypes, k)]
    for q in bad.tolist():
        row = rows[q]
        sketch, norm, _ = _split(row[out], k)
        problem = sum_check(
            row[total], int(row[count]), float(row[scale]), sketch, norm, _dtypes_of(row[None], cols)[0], k
        )
        where = f"(W={int(row[cols.SIZE])})" if which == "scatter" else f"({int(row[cols.AR_SIZE])} replicas)"
        lead = "its output" if which == "scatter" else "its replica all-reduce output"
        found.append((phase, Finding(check=check, rank=q, call=call, detail=f"{lead} {problem} {where}")))
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
            monitor.hsdp = True
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
