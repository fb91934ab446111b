"""Memory is planned, not discovered: what a replay needs per process, before it builds anything.

A trace does not hold parameter sizes; the checkpoint a replay starts from does (its metadata:
every tensor's key, dtype and shape, read without loading a byte: ``checkpoint.formats``). From it
and the trace (the checkpoint note's parameter names, the manifest's world size ``W`` and mesh):

* **model state** ``M`` = parameters + their gradients (the parameters' dtype) + the optimizer
  state. The optimizer state is the checkpoint's tensors outside the parameters (``optim.*``,
  ``optimizer.*``, ``state.*``: exact, whatever the optimizer); where the checkpoint holds none, it
  is *assumed* to be AdamW's two float32 moments per parameter element, and the plan says so.
* **one-process replay** (today's path, the whole unsharded model): ``M`` + one whole local
  gradient per recorded rank (the replay keeps every rank's, in the reduction dtype, to reduce them
  in the recorded order) + the reduced gradient + the reduction's temporaries (three whole
  gradients, measured: ``benchmarks/bench_sharded_replay.py``) + the runtime allowance ``R`` + the
  activation allowance.
* **sharded replay on ``k`` processes** (``replay/sharded.py``): ``M / k`` + the ordered
  reduction's accumulator ``/ k`` (``reduction.accumulation_dtype``) + what does not shrink with
  ``k``: one whole *unsharded* local gradient (FSDP2's accumulation without sync holds it until the
  last microbatch, as the job itself did; the replay reads it into one flat vector parameter by
  parameter, so the largest parameter's gradient once more) + FSDP2's all-gathered blocks (the group
  in use and the prefetched next one unsharded, and one all-gather buffer: three times the largest
  parameter group, from the recorded groups) + ``R`` + the activation allowance.
* **runtime allowance** ``R`` = 64 MiB: what a replay process holds beside the model (the trace's
  records, the DCP load's and gloo's buffers; 28-50 MiB measured on the CPU benchmark).
* **activation allowance** ``A``: ``SDC_FORENSICS_REPLAY_ACTIVATIONS`` bytes, else a quarter of
  the parameters' bytes and at least 64 MiB (a heuristic: a microbatch's activations are not in the
  trace; set it for a large microbatch or long context).

A freed tensor is given back to the system at once (:func:`return_freed_memory`, glibc): otherwise
glibc's heap keeps the pages of the freed gradient-sized blocks, 100-130 MiB on the benchmark, that
no plan can predict.

The budget per process is ``SDC_FORENSICS_REPLAY_MEMORY`` (bytes; ``K``/``M``/``G``/``T`` suffixes,
binary) or the chosen device's free memory (CUDA ``mem_get_info``; CPU ``MemAvailable`` of
``/proc/meminfo``). A one-process replay whose estimate exceeds it is refused up front
(:class:`MemoryRefused`, exit 2, as a placement refusal), naming the processes it needs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from sdc_forensics.errors import UsageError

BUDGET_ENV = "SDC_FORENSICS_REPLAY_MEMORY"
ACTIVATIONS_ENV = "SDC_FORENSICS_REPLAY_ACTIVATIONS"
MIN_ACTIVATIONS = 64 << 20
RUNTIME_BYTES = 64 << 20
#: blocks of 4 MiB and more mapped, whatever was freed before (mallopt's ``M_MMAP_THRESHOLD`` is -3)
_MMAP_THRESHOLD, _M_MMAP_THRESHOLD = 4 << 20, -3
_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
_OPTIM_PREFIXES = ("optim.", "optimizer.", "optim_state", "state.", "optimizer_state")
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class MemoryRefused(UsageError):
    """A one-process replay that cannot fit the memory budget (exit 2): it names the processes it needs."""


def parse_bytes(text: str, what: str = BUDGET_ENV) -> int:
    """``"12G"`` -> bytes (binary suffixes K, M, G, T, an optional ``B`` or ``iB``)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _SUFFIX and value[-1:] else ""
    number = value[: len(value) - len(unit)].strip()
    try:
        amount = float(number)
    except ValueError:
        raise UsageError(f"{what}={text!r} is not a number of bytes (e.g. 80000000000 or 75G)") from None
    if not amount > 0:
        raise UsageError(f"{what}={text!r}: a positive number of bytes")
    return int(amount * _SUFFIX[unit])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def device_budget(device: str = "cpu", env: str = BUDGET_ENV) -> tuple[int | None, str]:
    """``(bytes per process, where it comes from)``: the environment variable ``env``, else the device's free memory."""
    text = os.environ.get(env, "").strip()
    if text:
        return parse_bytes(text, env), env
    if device.split(":")[0] == "cuda":
        try:
            import torch

            free, _ = torch.cuda.mem_get_info(torch.device(device))
            return int(free), f"free memory of {device}"
        except Exception:  # noqa: BLE001 - no GPU here: nothing to plan against
            return None, "no CUDA device to measure"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available RAM (/proc/meminfo)"
    except OSError:
        pass
    return None, "available RAM unknown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What a replay of one trace needs per process (bytes), and against what budget.

    Attributes:
        numel: trainable parameter elements.
        params_bytes, grads_bytes, optimizer_bytes: the whole model's state.
        optimizer_assumed: True when the checkpoint holds no optimizer state (AdamW's two float32 moments assumed).
        reduce_itemsize: bytes per element of a local gradient as reduced.
        acc_itemsize: bytes per element of the sharded replay's accumulator.
        largest_group_bytes: the largest FSDP2 parameter group's unsharded bytes (the whole model's
            parameters when the groups are not known).
        largest_param_bytes: the largest parameter's bytes.
        world_size: recorded ranks ``W``.
        activations: the activation allowance per process.
        budget: bytes per process (None: unknown, nothing refused); budget_source: where it comes from.
        sharded: the trace is a sharded job (FSDP2/HSDP): a sharded replay can split it.
        checkpoint: the checkpoint the sizes were read from.
    """

    numel: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    optimizer_assumed: bool
    reduce_itemsize: int
    world_size: int
    acc_itemsize: int = 4
    largest_group_bytes: int = 0
    largest_param_bytes: int = 0
    activations: int
    budget: int | None
    budget_source: str
    sharded: bool
    checkpoint: str = ""

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def one_process(self) -> int:
        """Today's one-process replay: the whole state, every recorded rank's local gradient, the reduced
        one, the reduction's temporaries."""
        grad = self.numel * self.reduce_itemsize
        return self.state_bytes + (self.world_size + 1 + 3) * grad + RUNTIME_BYTES + self.activations

    def per_process(self, k: int) -> int:
        """Bytes per process of a replay on ``k`` processes (``k`` = 1: :meth:`one_process`)."""
        if k <= 1:
            return self.one_process()
        shrinking = -(-self.state_bytes // k) + -(-self.acc_itemsize * self.numel // k)
        return shrinking + self.unsharded_bytes() + RUNTIME_BYTES + self.activations

    def unsharded_bytes(self) -> int:
        """What a sharded replay process holds whatever ``k``: the whole local gradient, its largest
        parameter once more (the flat copy), three of the largest group (FSDP2's all-gathers)."""
        return self.grads_bytes + self.largest_param_bytes + 3 * self.largest_group_bytes

    def candidates(self) -> list[int]:
        """Process counts the sharded replay can use: 1, then the divisors of ``W`` (rounds of ``k`` recorded ranks)."""
        if not self.sharded:
            return [1]
        return [1] + [k for k in range(2, self.world_size + 1) if self.world_size % k == 0]

    def processes_needed(self) -> int | None:
        """The fewest processes whose replay fits the budget (None: none does, or no budget known)."""
        if self.budget is None:
            return None
        return next((k for k in self.candidates() if self.per_process(k) <= self.budget), None)

    def fits(self, k: int) -> bool:
        return self.budget is None or self.per_process(k) <= self.budget

    def lines(self) -> list[str]:
        """Sentences for the preflight and ``inspect``."""
        opt = (
            f"optimizer {human(self.optimizer_bytes)} (assumed: AdamW's two float32 moments; the checkpoint holds no "
            "optimizer state)"
            if self.optimizer_assumed
            else f"optimizer {human(self.optimizer_bytes)} (from the checkpoint)"
        )
        head = (
            f"memory: {self.numel:,} parameter elements, model state {human(self.state_bytes)} (parameters "
            f"{human(self.params_bytes)}, gradients {human(self.grads_bytes)}, {opt}); activation allowance "
            f"{human(self.activations)} per process ({ACTIVATIONS_ENV})"
        )
        one = f"one process needs {human(self.one_process())}"
        if self.budget is None:
            return [head, f"{one}; budget unknown ({self.budget_source}): set {BUDGET_ENV}"]
        need = self.processes_needed()
        budget = f"budget {human(self.budget)} per process ({self.budget_source})"
        if need == 1:
            tail = f"{one}, {budget}: fits one process"
        elif need is None:
            k = self.candidates()[-1]
            tail = (
                f"{one}, {budget}: does not fit"
                + (f", nor {k} processes ({human(self.per_process(k))} each)" if k > 1 else "")
                + ("" if self.sharded else " (a DDP job's model is replayed whole)")
            )
        else:
            tail = (
                f"{one}, {budget}: the replay needs {need} processes (torchrun --standalone --nproc-per-node {need}: "
                f"{human(self.per_process(need))} each, the model sharded over them)"
            )
        return [head, tail]

    def to_json(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "optimizer_assumed": self.optimizer_assumed,
            "activations_bytes": self.activations,
            "one_process_bytes": self.one_process(),
            "per_process_bytes": {str(k): self.per_process(k) for k in self.candidates()},
            "budget_bytes": self.budget,
            "budget_source": self.budget_source,
            "processes_needed": self.processes_needed(),
            "checkpoint": self.checkpoint,
        }

    def refusal(self, processes: int = 1) -> str:
        """The one line a replay on ``processes`` that cannot fit says ("" when it fits)."""
        if self.fits(processes):
            return ""
        need = self.processes_needed()
        what = "one-process replay" if processes == 1 else f"replay on {processes} processes"
        head = (
            f"the {what} needs {human(self.per_process(processes))} per process and the budget is {human(self.budget)} "
            f"({self.budget_source})"
        )
        if need is None:
            return head + (
                f": it does not fit even on {self.candidates()[-1]} processes; raise {BUDGET_ENV} or use a larger device"
                if self.sharded
                else f": a DDP job's model is replayed whole; use a larger device or raise {BUDGET_ENV}"
            )
        return head + (
            f": it needs {need} processes: torchrun --standalone --nproc-per-node {need} -m sdc_forensics ... "
            f"({human(self.per_process(need))} each, the model sharded over them)"
        )


def plan_from_infos(infos, manifest, param_names=(), *, device: str = "cpu", checkpoint: str = "") -> MemoryPlan | None:
    """The plan from a checkpoint's tensor metadata (``TensorInfo``s) and the trace's manifest."""
    names = set(param_names)
    params, optim = [], []
    for info in infos:
        key = info.key
        if (key in names) if names else not key.startswith(_OPTIM_PREFIXES):
            params.append(info)
        elif key.startswith(_OPTIM_PREFIXES) or "state" in key:
            optim.append(info)
    if not params:
        return None
    numel_of = lambda info: _prod(info.shape)  # noqa: E731
    numel = sum(numel_of(i) for i in params)
    params_bytes = sum(numel_of(i) * _ITEMSIZE.get(i.dtype, 4) for i in params)
    optim_bytes = sum(numel_of(i) * _ITEMSIZE.get(i.dtype, 4) for i in optim if len(i.shape))
    assumed = optim_bytes == 0
    if assumed:
        optim_bytes = 2 * 4 * numel
    mesh = manifest.parallel
    bytes_of = {i.key: numel_of(i) * _ITEMSIZE.get(i.dtype, 4) for i in params}
    groups = getattr(mesh, "groups", ()) if mesh is not None else ()
    ordered = [bytes_of.get(n, 0) for n in param_names]
    if groups and ordered and all(0 <= j < len(ordered) for g in groups for j in g):
        largest_group = max(sum(ordered[j] for j in g) for g in groups)
    else:
        # the groups are not known: the whole model all-gathered at once
        largest_group = params_bytes
    reduce_itemsize = _ITEMSIZE.get(mesh.reduce_dtype, 0) if mesh is not None and mesh.reduce_dtype else 0
    reduce_itemsize = reduce_itemsize or max(1, params_bytes // max(numel, 1))
    budget, source = device_budget(device)
    return MemoryPlan(
        numel=numel,
        params_bytes=params_bytes,
        grads_bytes=params_bytes,
        optimizer_bytes=optim_bytes,
        optimizer_assumed=assumed,
        reduce_itemsize=reduce_itemsize,
        world_size=int(manifest.world_size),
        acc_itemsize=max(4, params_bytes // max(numel, 1)),
        largest_group_bytes=largest_group,
        largest_param_bytes=max(bytes_of.values()),
        activations=activation_allowance(params_bytes),
        budget=budget,
        budget_source=source,
        sharded=mesh is not None,
        checkpoint=checkpoint,
    )


def return_freed_memory() -> None:
    """Give a freed tensor's pages back to the system at once (glibc; elsewhere nothing).

    glibc raises its mmap threshold to the size of the last freed mapped block (up to 32 MiB), so
    after the first gradient-sized tensor is freed the next ones come from the heap, whose freed
    pages stay resident: a replay's resident set then grows by blocks that no longer hold anything
    (about 100 MiB on ``benchmarks/bench_sharded_replay.py``). A fixed threshold keeps every block of
    4 MiB or more mapped and unmapped when freed. Nothing computed changes. Lower would cost time: a
    fresh mapping is zero-filled on first touch, so small tensors would pay for it on every allocation;
    a gradient-sized block was mapped afresh already before glibc raised the threshold. Called only
    for a sharded job's replay (``sharded.dispatch``), whose plan it keeps true.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        # not glibc (musl has no mallopt): its own allocator's behaviour stands
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def activation_allowance(params_bytes: int) -> int:
    """``SDC_FORENSICS_REPLAY_ACTIVATIONS`` bytes ("0": none), else a quarter of the parameters' bytes, at least 64 MiB."""
    text = os.environ.get(ACTIVATIONS_ENV, "").strip()
    if text == "0":
        return 0
    return parse_bytes(text, ACTIVATIONS_ENV) if text else max(MIN_ACTIVATIONS, params_bytes // 4)


def plan_checkpoint(path, manifest, param_names=(), *, device: str = "cpu") -> MemoryPlan | None:
    """The plan of a replay starting from the checkpoint at ``path`` (None: unreadable, no parameters found)."""
    from sdc_forensics.checkpoint.formats import open_checkpoint

    try:
        with open_checkpoint(path) as reader:
            infos = reader.infos()
    except Exception:  # noqa: BLE001 - a checkpoint the replay itself will refuse, with its own message
        return None
    return plan_from_infos(infos, manifest, param_names, device=device, checkpoint=str(path))


def plan_trace(trace_dir, manifest=None, *, device: str = "cpu") -> MemoryPlan | None:
    """The plan of a replay of the trace at ``trace_dir``, sized from its latest noted checkpoint that is found."""
    from sdc_forensics.checkpoint.locate import locate_checkpoint
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes
    from sdc_forensics.trace.manifest import read_manifest

    try:
        manifest = manifest if manifest is not None else read_manifest(trace_dir)
        notes = read_checkpoint_notes(trace_dir)
    except Exception:  # noqa: BLE001 - inspect says what is wrong with the trace itself
        return None
    for note in sorted(notes, key=lambda n: (n.step, n.attempt), reverse=True):
        path = locate_checkpoint(note, None, trace_dir)
        if path is not None:
            found = plan_checkpoint(path, manifest, note.param_names, device=device)
            if found is not None:
                return found
    return None


def inspect_lines(trace_dir, manifest=None) -> list[str]:
    """``inspect``'s lines: the plan on the device the job trained on (its free memory, or the budget variable)."""
    device = "cpu"
    if manifest is not None and manifest.attempts:
        det = max(manifest.attempts, key=lambda a: a.attempt).determinism
        device = "cuda" if str(det.get("device_type") or "cpu") == "cuda" else "cpu"
    found = plan_trace(trace_dir, manifest, device=device)
    return (
        found.lines()
        if found is not None
        else ["memory: no estimate (no noted checkpoint found to size the model from)"]
    )


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
