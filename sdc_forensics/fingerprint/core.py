"""Fingerprints of tensors, computed on the tensor's own device: exact digest, linear sketch, stats.

This is the one place that defines how a tensor is fingerprinted; the recorder, replay and
checkpoint verification all call it. The definitions (as math) are in ``docs/fingerprints.md``;
``reference.py`` is the numpy version the tests hold this one to, bit for bit.

Cost: :func:`fingerprint` reads the tensor once from memory, in chunks (1 Mi elements on CPU,
so that a chunk and its scratch stay in cache while every part is computed from it; 16 Mi
elements per slab on CUDA). Per chunk: the digest (two lanes: a wrapping int32 multiply and a row sum, then an
arithmetic shift, a multiply and a row sum), the sketch (one ``beta^T X`` matmul into a ``(k, 1024)`` float64 accumulator),
the stats (one dot product, one ``aminmax``); 16-bit chunks are upcast into a float32 scratch
first (on CUDA a bf16/fp16 matmul with float32 output is used where torch has one). Memory
beyond the tensor: the scratches, one int32 per 4 KiB of tensor for the digest's block sums,
and a contiguous copy when the tensor is not contiguous. Nothing comes back to the host but
the final scalars and the ``k`` sketch values. Measured cost: ``docs/benchmarks.md``.

Paths: that torch code is the fallback. On CPU the one-pass compiled kernel of ``cpu_kernel``
runs when numba is importable (float32, bfloat16, float16, float64; its digest is the same
number, its sketch and norm differ from the torch path's only by rounding, within tolerance),
and on CUDA the Triton kernel of ``triton_kernel`` when Triton is. ``SDC_FORENSICS_KERNELS=off``
forces the fallback; :func:`kernel_path` says which path runs on a device, and the first use of
each path in a process is logged (logger ``sdc_forensics.fingerprint``).

Host syncs: :func:`fingerprint` makes at most one. :func:`fingerprint_async` makes none on CUDA
and :func:`resolve` pulls any number of pending fingerprints with one transfer per device (the
recorder's comm hook: one per step for all buckets).

Over 400 lines on purpose: the public fingerprint API and its dispatch to the compiled kernels
(``cpu_kernel.py``, ``triton_kernel.py``) or torch, which must agree bit for bit (``reference.py``);
one place decides which path a tensor takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import threading

import numpy as np
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import cpu_kernel
from sdc_forensics.fingerprint.tables import TableCache

log = logging.getLogger("sdc_forensics.fingerprint")

# 4 MiB float32 + 4 MiB int32 scratch: in L3; few enough ops that a busy
_CPU_CHUNK_ELEMS = 1 << 20
# machine does not stall every one of them on an OpenMP barrier (2^18 was 3x slower at load 6)
# 64 MiB float32 slabs on CUDA: kernel launches amortised
_CUDA_CHUNK_ELEMS = 1 << 24
_BLOCK_BYTES = 4 * C.BLOCK_WORDS
_lock = threading.Lock()
_cache: dict[tuple, torch.Tensor] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """Fingerprint of one tensor (or of several, combined with :func:`combine`).

    Attributes:
        digest: exact 64-bit digest of the raw bits (position-sensitive).
        sketch: ``(k,)`` float64 linear sketch.
        norm: L2 norm (float64 accumulation of per-chunk float32 norms).
        max_abs: max |x|.
        nonfinite: count of NaN and Inf elements.
        numel: number of elements.
        lanes: the digest's lane totals before it is finished (``sum_j c_j s_j``, ``sum_j c'_j t_j``
            mod 2**64), which add across pieces (``fingerprint/shards.py``); None when combined.
    """

    digest: int
    sketch: np.ndarray
    norm: float
    max_abs: float
    nonfinite: int
    numel: int
    lanes: tuple[int, int] | None = dataclasses.field(default=None, compare=False, repr=False)


# the torch path's device tables (a_i, b_i, c_j, alpha, beta)
_constants = TableCache()
_cached = _constants.get
_prefix_table = _constants.prefix


def _block_weights(device: torch.device, num_blocks: int, seed: int, high: bool = False) -> torch.Tensor:
    return _prefix_table(
        ("c", device, seed, high),
        num_blocks,
        lambda size: torch.from_numpy(C.digest_block_weights(size, seed, high=high)).to(device),
    )


def _beta(device: torch.device, num_blocks: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return _prefix_table(
        ("beta", device, k, seed, dtype),
        num_blocks,
        lambda size: torch.from_numpy(C.sketch_block_signs(size, k, seed)).to(device=device, dtype=dtype),
    )


def _alpha(device: torch.device, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return _cached(
        ("alpha", device, k, seed, dtype),
        lambda: torch.from_numpy(C.sketch_in_block_signs(k, seed)).to(device=device, dtype=dtype),
    )


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in row-major order as a 1-D uint8 tensor on its device (no host copy)."""
    t = tensor.detach()
    # an empty tensor may carry stride 0, which view() refuses
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def _chunk_elems(device: torch.device) -> int:
    return _CUDA_CHUNK_ELEMS if device.type == "cuda" else _CPU_CHUNK_ELEMS


class _Digester:
    """Accumulates the block sums ``s_j`` (low lane) and ``t_j`` (high lane) of the exact digest."""

    def __init__(self, num_bytes: int, device: torch.device, seed: int, max_rows: int):
        self.num_bytes = num_bytes
        self.device = device
        self.seed = seed
        self.num_blocks = -(-num_bytes // _BLOCK_BYTES)
        self.a = _cached(("a", device, seed), lambda: torch.from_numpy(C.digest_word_weights(seed)).to(device))
        self.b = _cached(("b", device, seed), lambda: torch.from_numpy(C.digest_high_weights(seed)).to(device))
        # (blocks,) s_j
        self.sums = torch.zeros(max(self.num_blocks, 1), dtype=torch.int32, device=device)
        # (blocks,) t_j
        self.high_sums = torch.zeros(max(self.num_blocks, 1), dtype=torch.int32, device=device)
        rows = max(1, min(max_rows, self.num_blocks))
        self.scratch = torch.empty(rows, C.BLOCK_WORDS, dtype=torch.int32, device=device)

    def add(self, first_block: int, raw: torch.Tensor) -> None:
        """Block sums of ``raw`` (uint8), the bytes from block ``first_block`` on."""
        # partial block or odd 16-bit offset
        if raw.numel() % _BLOCK_BYTES or raw.storage_offset() % 4:
            padded = torch.zeros(-(-raw.numel() // _BLOCK_BYTES) * _BLOCK_BYTES, dtype=torch.uint8, device=self.device)
            padded[: raw.numel()] = raw
            raw = padded
        # (rows, 1024)
        words = raw.view(torch.int32).view(-1, C.BLOCK_WORDS)
        for start in range(0, words.shape[0], self.scratch.shape[0]):
            chunk = words[start : start + self.scratch.shape[0]]
            buf = self.scratch[: chunk.shape[0]]
            first = first_block + start
            rows = slice(first, first + chunk.shape[0])
            # wraps mod 2**32
            torch.mul(chunk, self.a, out=buf)
            torch.sum(buf, dim=1, dtype=torch.int32, out=self.sums[rows])
            # arithmetic: the high half, sign-extended
            torch.bitwise_right_shift(chunk, 16, out=buf)
            buf.mul_(self.b)
            torch.sum(buf, dim=1, dtype=torch.int32, out=self.high_sums[rows])

    def lane_totals(self, first_block: int = 0) -> torch.Tensor:
        """``(2,)`` int64 on the device: ``sum_j c_j s_j`` and ``sum_j c'_j t_j`` (wrapping), the
        bytes being blocks ``first_block ..`` of a longer vector (a shard of a parameter)."""
        n = self.num_blocks
        if not n:
            return torch.zeros(2, dtype=torch.int64, device=self.device)
        low_sums = self.sums[:n].to(torch.int64) & 0xFFFF_FFFF
        high_sums = self.high_sums[:n].to(torch.int64) & 0xFFFF_FFFF
        end = first_block + n
        return torch.stack(
            [
                (low_sums * _block_weights(self.device, end, self.seed)[first_block:]).sum(),
                (high_sums * _block_weights(self.device, end, self.seed, high=True)[first_block:]).sum(),
            ]
        )

    def finish(self, low: int, high: int) -> int:
        """``D = fmix64(low + 2**32 high + c_len * N mod 2**64)`` from the host values of the lane totals."""
        return _finish_digest(low, high, self.num_bytes, self.seed)

    def value(self) -> int:
        """The digest (one host transfer)."""
        low, high = self.lane_totals().tolist()
        return self.finish(low, high)


def digest(tensor: torch.Tensor, seed: int = C.DEFAULT_SEED) -> int:
    """Exact digest of a tensor's raw bits, computed on its device.

    Args:
        tensor: any dense tensor (float32, bfloat16, float16, float64, integer, bool).
        seed: the fingerprint seed (recorded in the trace manifest).

    Returns:
        The 64-bit digest as a Python int. Identical on CPU and CUDA for identical bits and
        equal to :func:`sdc_forensics.fingerprint.reference.digest_bytes`.
    """
    return digests([tensor], seed)[0]


def digests(tensors, seed: int = C.DEFAULT_SEED) -> list[int]:
    """Exact digests of several tensors with one host transfer per device (a model's parameters).

    Args:
        tensors: an iterable of tensors (any devices).
        seed: the fingerprint seed.

    Returns:
        ``[digest(t) for t in tensors]``, computed without a host sync per tensor.
    """
    sizes, totals = [], []
    tensors = list(tensors)
    # CPU tensors at 4-byte aligned addresses: one compiled call for all of them
    many = _cpu_digest_lanes_many(tensors, seed)
    for index, tensor in enumerate(tensors):
        raw = _raw_bytes(tensor)
        sizes.append(raw.numel())
        if index in many:
            totals.append(many[index])
            continue
        lanes = _cpu_digest_lanes(raw, seed) if raw.device.type == "cpu" and _cpu_kernel_ok() else None
        # host values already: no buffers, no transfer
        if lanes is not None:
            totals.append(lanes)
            continue
        chunk_bytes = 4 * _chunk_elems(raw.device)
        digester = _Digester(raw.numel(), raw.device, seed, chunk_bytes // _BLOCK_BYTES)
        for start in range(0, raw.numel(), chunk_bytes):
            digester.add(start // _BLOCK_BYTES, raw[start : start + chunk_bytes])
        totals.append(digester.lane_totals())
    by_device: dict[torch.device, list[int]] = {}
    for index, total in enumerate(totals):
        if isinstance(total, torch.Tensor):
            by_device.setdefault(total.device, []).append(index)
    values: list[tuple[int, int]] = [t if isinstance(t, tuple) else (0, 0) for t in totals]
    for indices in by_device.values():
        # one transfer per device
        host = torch.stack([totals[i] for i in indices]).tolist()
        for i, (low, high) in zip(indices, host):
            values[i] = (low, high)
    return [_finish_digest(low, high, size, seed) for (low, high), size in zip(values, sizes)]


def _finish_digest(low: int, high: int, num_bytes: int, seed: int) -> int:
    """``D = fmix64(low + 2**32 high + c_len * N mod 2**64)`` from the lane totals."""
    total = (low % (1 << 64) + ((high % (1 << 64)) << 32) + num_bytes * C.digest_length_weight(seed)) % (1 << 64)
    return C.fmix64(total)


# ---------------------------------------------------------------- which path runs
_logged: set[str] = set()


def _cpu_kernel_ok() -> bool:
    ok, _ = cpu_kernel.available()
    return ok


def _compiled_failed(exc: BaseException) -> None:
    reason = f"the compiled kernel failed ({type(exc).__name__}: {exc}); using the torch path from now on"
    log.warning("fingerprints on cpu: %s", reason)
    cpu_kernel.disable(reason)


def _host_bytes(raw: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU uint8 tensor, made without ``Tensor.numpy()``, which marks
    the storage not resizable for good: FSDP2 frees and re-allocates its all-gathered parameters
    by resizing their storage, and the recorder digests them. Valid while ``raw`` lives."""
    if raw.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer((ctypes.c_uint8 * raw.numel()).from_address(raw.data_ptr()), dtype=np.uint8)


def _cpu_digest_lanes_many(tensors: list[torch.Tensor], seed: int) -> dict[int, tuple[int, int]]:
    """``{index: lane totals}`` of the contiguous CPU tensors at 4-byte aligned addresses, from one
    call of the compiled loop (read through their addresses: no ``Tensor.numpy()``, as
    :func:`_host_bytes`); ``{}`` where the kernel does not run (the others go one by one)."""
    chosen = [
        i
        for i, t in enumerate(tensors)
        # plain tensors only: a subclass (DTensor) may have no storage of its own
        if type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.numel()
        and t.data_ptr() % 4 == 0
    ]
    if len(chosen) < 2 or not _cpu_kernel_ok():
        return {}
    addresses = np.array([tensors[i].data_ptr() for i in chosen], dtype=np.int64)
    nbytes = np.array([tensors[i].numel() * tensors[i].element_size() for i in chosen], dtype=np.int64)
    try:
        lanes = cpu_kernel.digest_lanes_many(addresses, nbytes, seed).tolist()
    except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
        _compiled_failed(exc)
        return {}
    return {i: (int(low), int(high)) for i, (low, high) in zip(chosen, lanes)}


def _cpu_digest_lanes(raw: torch.Tensor, seed: int) -> tuple[int, int] | None:
    try:
        return cpu_kernel.digest_lanes(_host_bytes(raw), seed)
    except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
        _compiled_failed(exc)
        return None


def _triton_status(device: torch.device) -> tuple[bool, str]:
    try:
        from sdc_forensics.fingerprint import triton_kernel
    except ImportError:
        return False, "the Triton kernel module is missing"
    return triton_kernel.available(device)


def _triton_supports(dtype: torch.dtype) -> bool:
    from sdc_forensics.fingerprint import triton_kernel

    return triton_kernel.supports(dtype)


def kernel_path(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """Which path fingerprints a tensor of ``dtype`` on ``device``, and why not a faster one.

    Returns:
        ``"numba-cpu"`` (the compiled one-pass CPU kernel), ``"triton-cuda"`` (the Triton
        kernel), or ``"torch (<reason the fast path is off>)"``.
    """
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cpu":
        ok, reason = cpu_kernel.available()
        if ok and cpu_kernel.supports(name):
            return "numba-cpu"
        return f"torch ({reason or f'the compiled kernel does not take {name}'})"
    if device.type == "cuda":
        ok, reason = _triton_status(device)
        if ok and not _triton_supports(dtype):
            ok, reason = False, f"the Triton kernel does not take {name}"
        return "triton-cuda" if ok else f"torch ({reason})"
    return f"torch (no compiled kernel for {device.type})"


def warm_up(device: torch.device | str = "cpu", dtypes=(torch.float32, torch.bfloat16)) -> str:
    """Compiles (or loads from the on-disk cache) the fast path for ``device`` now, not on the first step.

    The first compile of the CPU kernel on a machine takes a few seconds (``docs/fingerprints.md``);
    later processes load it from numba's cache in well under a second. Returns :func:`kernel_path`.
    """
    device = torch.device(device)
    for dtype in dtypes:
        fingerprint(torch.zeros(C.BLOCK_ELEMS + 1, dtype=dtype, device=device))
    return kernel_path(device)


def _note_path(device: torch.device, path: str) -> None:
    key = f"{device.type}:{path}"
    if key not in _logged:
        _logged.add(key)
        log.info("fingerprints on %s: %s", device.type, path)


_PRECISION_FLAGS = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@contextlib.contextmanager
def _full_precision_matmul(device: torch.device):
    """TF32 and reduced-precision split-K reductions off for the sketch matmul on CUDA.

    TF32 would put ~1e-3 relative noise into the sketch, and 16-bit partial sums in cuBLAS's
    split-K reductions ~1e-2: either would blow the calibrated tolerance.
    """
    if device.type != "cuda":
        yield
        return
    settings = torch.backends.cuda.matmul
    previous = {flag: getattr(settings, flag) for flag in _PRECISION_FLAGS if hasattr(settings, flag)}
    for flag in previous:
        setattr(settings, flag, False)
    try:
        yield
    finally:
        for flag, value in previous.items():
            setattr(settings, flag, value)


def _low_precision_mm_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm``/``bmm`` with ``out_dtype=float32`` work for 16-bit inputs here (CUDA)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    key = ("mm_out_dtype", device, dtype)
    with _lock:
        if key in _cache:
            return bool(_cache[key])
    try:
        x = torch.ones(2, 3, C.BLOCK_ELEMS, dtype=dtype, device=device)
        ok = bool((torch.bmm(x.transpose(1, 2), x, out_dtype=torch.float32) == 3).all().item())
        ok = ok and bool((torch.mm(x[0].t(), x[0], out_dtype=torch.float32) == 3).all().item())
    except (RuntimeError, TypeError):
        ok = False
    with _lock:
        _cache[key] = ok
    return ok


def _project(beta_t: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """``beta_t @ x`` summed over row groups of at most ``BLOCK_ELEMS`` (``(k, 1024)``, float64).

    Args:
        beta_t: ``(k, rows)`` block signs of the chunk's blocks.
        x: ``(rows, 1024)`` the chunk.
        out_dtype: float32 for a 16-bit matmul with float32 output, else None.
    """
    kwargs = {"out_dtype": out_dtype} if out_dtype is not None else {}
    rows = x.shape[0]
    # float32 sums of at most BLOCK_ELEMS terms, as the model assumes
    group = min(rows, C.BLOCK_ELEMS)
    full = rows // group * group
    if full == rows and rows == group:
        total = torch.mm(beta_t, x, **kwargs).to(torch.float64)
    else:
        batched = torch.bmm(
            beta_t[:, :full].unflatten(1, (-1, group)).transpose(0, 1), x[:full].unflatten(0, (-1, group)), **kwargs
        )
        # (k, 1024)
        total = batched.sum(dim=0, dtype=torch.float64)
        if full < rows:
            total += torch.mm(beta_t[:, full:], x[full:], **kwargs)
    return total


class _Sketcher:
    """Sketch and stats of a flat tensor, a chunk at a time.

    Uses ``S_m = sum_i alpha_m[i] * Y[m, i]`` with ``Y = beta^T X`` (``X`` the ``(blocks, 1024)``
    view): the matmul then has a wide output, which BLAS and cuBLAS run near memory speed
    (``X @ alpha``, with its 8 output columns, is ~10x slower on CPU). ``Y`` is accumulated in
    float64 chunk by chunk and every float32 sum in it has at most ``BLOCK_ELEMS`` terms.
    """

    def __init__(self, flat: torch.Tensor, k: int, seed: int, block_offset: int, chunk_elems: int):
        self.device = flat.device
        self.acc_dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
        self.low_precision = _low_precision_mm_ok(self.device, flat.dtype)
        mm_dtype = flat.dtype if self.low_precision else self.acc_dtype
        num_blocks = num_sketch_blocks(flat.numel())
        # (blocks, k)
        self.beta = _beta(self.device, block_offset + num_blocks, k, seed, mm_dtype)[block_offset:]
        # (1024, k)
        self.alpha = _alpha(self.device, k, seed, torch.float64)
        self.y = torch.zeros(k, C.BLOCK_ELEMS, dtype=torch.float64, device=self.device)
        self.upcast = flat.dtype != self.acc_dtype and not self.low_precision
        self.scratch = None
        if self.upcast or flat.numel() % C.BLOCK_ELEMS:
            size = min(chunk_elems, num_blocks * C.BLOCK_ELEMS)
            self.scratch = torch.empty(size, dtype=mm_dtype, device=self.device)
        self.sumsq: list[torch.Tensor] = []
        self.lo: list[torch.Tensor] = []
        self.hi: list[torch.Tensor] = []

    def add(self, start: int, x: torch.Tensor) -> None:
        """Adds chunk ``x`` (flat, whole sketch blocks unless it is the last), first element ``start``."""
        rows = -(-x.numel() // C.BLOCK_ELEMS)
        if self.scratch is not None and (self.upcast or x.numel() % C.BLOCK_ELEMS):
            buf = self.scratch[: rows * C.BLOCK_ELEMS]
            # the last, partial block is zero-padded
            if x.numel() % C.BLOCK_ELEMS:
                buf[x.numel() :].zero_()
            buf[: x.numel()].copy_(x)
            x = buf
        first = start // C.BLOCK_ELEMS
        # (k, rows)
        beta_t = self.beta[first : first + rows].t()
        self.y += _project(beta_t, x.view(rows, C.BLOCK_ELEMS), torch.float32 if self.low_precision else None)
        if self.low_precision:
            self.sumsq.append(torch.linalg.vector_norm(x, dtype=torch.float32).square())
        else:
            self.sumsq.append(torch.dot(x, x))
        lo, hi = torch.aminmax(x)
        self.lo.append(lo)
        self.hi.append(hi)

    def device_result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sketch (k,), sumsq, max_abs)``, float64, on the device."""
        # (k,)
        sketch = (self.y * self.alpha.t()).sum(dim=1)
        sumsq = torch.stack(self.sumsq).to(torch.float64).sum()
        max_abs = torch.maximum(-torch.stack(self.lo).min(), torch.stack(self.hi).max()).to(torch.float64)
        return sketch, sumsq, max_abs

    def result(self) -> tuple[np.ndarray, float, float]:
        """(sketch, norm, max_abs) on the host."""
        sketch, sumsq, max_abs = self.device_result()
        scalars = torch.stack([sumsq.sqrt(), max_abs]).cpu()
        return sketch.cpu().numpy(), float(scalars[0]), float(scalars[1])


@dataclasses.dataclass
class PendingFingerprint:
    """A fingerprint whose numbers may still be on the device (see :func:`resolve`).

    Exactly one of ``done`` (host values) and ``values`` (a device vector ``[lane_low,
    lane_high (int64 bits as float64), sketch[k], sumsq, max_abs, nonfinite]``) is set.
    """

    numel: int
    num_bytes: int
    seed: int
    with_digest: bool
    done: Fingerprint | None = None
    values: torch.Tensor | None = None


def fingerprint(
    tensor: torch.Tensor,
    *,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
    block_offset: int = 0,
    with_digest: bool = True,
    digest_block_offset: int = 0,
) -> Fingerprint:
    """Digest, sketch and stats of one tensor, on its own device, in one read of it.

    Args:
        tensor: a floating-point tensor.
        k: number of sketch projections.
        seed: the fingerprint seed.
        block_offset: index of this tensor's first sketch block when it is one piece of a
            longer vector (a DDP bucket inside the whole gradient); keeps the pieces' sketches
            independent so that their sum is the sketch of the concatenation.
        with_digest: skip the exact digest when only the tolerant parts are needed.
        digest_block_offset: index of this tensor's first digest block (4096 bytes) in a longer
            vector; only its ``lanes`` are then meaningful (``fingerprint/shards.py`` adds them).

    Returns:
        A :class:`Fingerprint` (one host sync at most).
    """
    return resolve(
        [
            fingerprint_async(
                tensor,
                k=k,
                seed=seed,
                block_offset=block_offset,
                with_digest=with_digest,
                digest_block_offset=digest_block_offset,
            )
        ]
    )[0]


def fingerprint_async(
    tensor: torch.Tensor,
    *,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
    block_offset: int = 0,
    with_digest: bool = True,
    digest_block_offset: int = 0,
) -> PendingFingerprint:
    """:func:`fingerprint` without the host sync: the tensor is read now, the numbers come later.

    The tensor may be changed (all-reduced in place, say) as soon as this returns: on CUDA the
    work is queued on the current stream before anything the caller queues after it.
    """
    flat = tensor.detach().reshape(-1)
    # a strided 1-D view stays one after reshape: the kernels read rows
    if not flat.is_contiguous():
        flat = flat.contiguous()
    numel = flat.numel()
    pending = PendingFingerprint(numel=numel, num_bytes=numel * flat.element_size(), seed=seed, with_digest=with_digest)
    if numel == 0:
        pending.done = Fingerprint(
            digest=digest(flat, seed) if with_digest else 0,
            sketch=np.zeros(k),
            norm=0.0,
            max_abs=0.0,
            nonfinite=0,
            numel=0,
            lanes=(0, 0),
        )
        return pending
    if digest_block_offset < 0:
        raise ValueError(f"digest_block_offset must be >= 0 (got {digest_block_offset})")
    off = digest_block_offset
    device = flat.device
    path = kernel_path(device, flat.dtype)
    _note_path(device, path)
    if path == "numba-cpu":
        name = str(flat.dtype).removeprefix("torch.")
        try:
            part = cpu_kernel.partials(
                _kernel_words(flat),
                name,
                k=k,
                seed=seed,
                block_offset=block_offset,
                with_digest=with_digest,
                digest_block_offset=off,
            )
        except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
            _compiled_failed(exc)
            pending.done = _torch_fingerprint(flat, k, seed, block_offset, with_digest, off)
        else:
            pending.done = _assemble(pending, part.lanes, part.sketch, part.sumsq, part.max_abs, part.nonfinite)
    elif path == "triton-cuda":
        from sdc_forensics.fingerprint import triton_kernel

        pending.values = triton_kernel.partials(
            flat, k=k, seed=seed, block_offset=block_offset, with_digest=with_digest, digest_block_offset=off
        )
    elif device.type == "cpu":
        pending.done = _torch_fingerprint(flat, k, seed, block_offset, with_digest, off)
    else:
        pending.values = _torch_partials(flat, k, seed, block_offset, with_digest, off)
    return pending


def fingerprints_async(
    tensors,
    *,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
    block_offsets=None,
    with_digest: bool = True,
    digest_block_offsets=None,
) -> list[PendingFingerprint]:
    """:func:`fingerprint_async` of each of ``tensors`` (the same numbers), in one kernel call per
    dtype where the compiled CPU kernel runs: a model's parameters, a bucket's or a shard group's
    pieces cost what one tensor of their total size costs, not a Python call each.

    Args:
        tensors: the tensors, any devices and dtypes (those the CPU kernel does not take, and
            those on other devices, go through :func:`fingerprint_async` one by one).
        k, seed, with_digest: as :func:`fingerprint`, for all of them.
        block_offsets, digest_block_offsets: per tensor (default all 0), as :func:`fingerprint`'s.

    Returns:
        One :class:`PendingFingerprint` per tensor, in order (:func:`resolve` them together).
    """
    tensors = list(tensors)
    offsets = [0] * len(tensors) if block_offsets is None else [int(o) for o in block_offsets]
    digest_offsets = [0] * len(tensors) if digest_block_offsets is None else [int(o) for o in digest_block_offsets]
    if len(offsets) != len(tensors) or len(digest_offsets) != len(tensors):
        raise ValueError("block_offsets and digest_block_offsets need one entry per tensor")
    out: list[PendingFingerprint | None] = [None] * len(tensors)
    # dtype name -> (indices, flat tensors) that the compiled kernel takes in one call
    batches: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    compiled: dict[torch.dtype, bool] = {}
    # (device, dtype) -> indices that the Triton kernel takes in one launch
    on_cuda: dict[tuple, list[int]] = {}
    flats_by_index: dict[int, torch.Tensor] = {}
    for index, tensor in enumerate(tensors):
        flat = tensor.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if flat.dtype not in compiled and flat.device.type == "cpu":
            compiled[flat.dtype] = kernel_path(flat.device, flat.dtype) == "numba-cpu"
        if (
            flat.numel()
            and flat.device.type == "cpu"
            and compiled[flat.dtype]
            and digest_offsets[index] >= 0
            and _aligned(flat)
        ):
            indices, flats = batches.setdefault(str(flat.dtype).removeprefix("torch."), ([], []))
            indices.append(index)
            flats.append(flat)
            continue
        # (kernel_path says so for CUDA tensors; the tests' Triton interpreter, for CPU ones)
        if flat.numel() and kernel_path(flat.device, flat.dtype) == "triton-cuda":
            on_cuda.setdefault((flat.device, flat.dtype), []).append(index)
            flats_by_index[index] = flat
            continue
        _one_each(out, [flat], [index], k, seed, offsets, with_digest, digest_offsets)
    for name, (indices, flats) in batches.items():
        _note_path(torch.device("cpu"), "numba-cpu")
        arrays = [_kernel_words(f) for f in flats]
        try:
            parts = cpu_kernel.partials_many(
                arrays,
                name,
                k=k,
                seed=seed,
                block_offsets=[offsets[i] for i in indices],
                with_digest=with_digest,
                digest_block_offsets=[digest_offsets[i] for i in indices],
            )
        except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
            _compiled_failed(exc)
            parts = None
        if parts is None:
            _one_each(out, flats, indices, k, seed, offsets, with_digest, digest_offsets)
            continue
        for position, (index, flat) in enumerate(zip(indices, flats)):
            part = parts[position]
            pending = _pending_of(flat, seed, with_digest)
            pending.done = _assemble(pending, part.lanes, part.sketch, part.sumsq, part.max_abs, part.nonfinite)
            out[index] = pending
    for indices in on_cuda.values():
        _triton_many(out, [flats_by_index[i] for i in indices], indices, k, seed, offsets, with_digest, digest_offsets)
    return out  # type: ignore[return-value]


def _aligned(flat: torch.Tensor) -> bool:
    """The compiled CPU kernel reads ``flat`` in place: its first word is aligned (16-bit words at
    an odd element offset are not: :func:`fingerprint_async` copies them first)."""
    return flat.data_ptr() % max(4, flat.element_size()) == 0


def _kernel_words(flat: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as the compiled kernel reads it, no copy: 16-bit words as uint16."""
    return flat.view(torch.int16).numpy().view(np.uint16) if flat.element_size() == 2 else flat.numpy()


def chunk_rows(tensor: torch.Tensor, parts: int, *, k: int = C.DEFAULT_SKETCH_K, seed: int = C.DEFAULT_SEED):
    """The sketch numbers of ``tensor``'s ``parts`` equal chunks (``reshape(-1).chunk(parts)``)
    as one ``(parts, k + 2)`` float64 array, row ``[sketch (k), norm, NaN/Inf count]``: the
    numbers :func:`fingerprints_async` of the chunks resolves to, bit for bit, in one compiled
    call with no Python object per chunk. None where that call does not take the tensor (not on
    the CPU kernel's path, ``parts`` not dividing its size, a 16-bit chunk at an odd address):
    the caller then fingerprints the chunks as a list."""
    flat = tensor.detach().reshape(-1)
    if (
        parts < 1
        or flat.device.type != "cpu"
        or not flat.is_contiguous()
        or flat.numel() == 0
        or flat.numel() % parts
        or kernel_path(flat.device, flat.dtype) != "numba-cpu"
        or not _aligned(flat)
        # every chunk starts at an aligned word
        or (flat.numel() // parts * flat.element_size()) % max(4, flat.element_size())
    ):
        return None
    _note_path(flat.device, "numba-cpu")
    name = str(flat.dtype).removeprefix("torch.")
    try:
        return cpu_kernel.chunk_rows(_kernel_words(flat), parts, name, k=k, seed=seed)
    except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
        _compiled_failed(exc)
        return None


def _one_each(out, flats, indices, k, seed, offsets, with_digest, digest_offsets) -> None:
    """:func:`fingerprint_async` of each of ``flats`` (a batch whose one call failed: nothing is
    lost; or a tensor no batch takes), into ``out`` at ``indices``."""
    for index, flat in zip(indices, flats):
        out[index] = fingerprint_async(
            flat,
            k=k,
            seed=seed,
            block_offset=offsets[index],
            with_digest=with_digest,
            digest_block_offset=digest_offsets[index],
        )


def _triton_many(out, flats, indices, k, seed, offsets, with_digest, digest_offsets) -> None:
    """Pending fingerprints of CUDA tensors of one dtype: one launch of the Triton kernel over
    the list (``triton_kernel.partials_many``, each row what its own launch gives)."""
    from sdc_forensics.fingerprint import triton_kernel

    _note_path(flats[0].device, "triton-cuda")
    try:
        rows = triton_kernel.partials_many(
            flats,
            k=k,
            seed=seed,
            block_offsets=[offsets[i] for i in indices],
            with_digest=with_digest,
            digest_block_offsets=[digest_offsets[i] for i in indices],
        )
    except Exception as exc:  # noqa: BLE001 - the list launch must not lose the answer: one launch each
        log.warning("sdc-forensics: the Triton list launch failed (%s); one launch per tensor", exc)
        _one_each(out, flats, indices, k, seed, offsets, with_digest, digest_offsets)
        return
    for row, index, flat in zip(rows, indices, flats):
        out[index] = pending = _pending_of(flat, seed, with_digest)
        pending.values = row


def _pending_of(flat: torch.Tensor, seed: int, with_digest: bool) -> PendingFingerprint:
    return PendingFingerprint(
        numel=flat.numel(), num_bytes=flat.numel() * flat.element_size(), seed=seed, with_digest=with_digest
    )


def resolve(pending: list[PendingFingerprint]) -> list[Fingerprint]:
    """The fingerprints of :func:`fingerprint_async` calls, with one host transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for index, item in enumerate(pending):
        if item.done is None:
            by_device.setdefault(item.values.device, []).append(index)
    out: list[Fingerprint | None] = [item.done for item in pending]
    for indices in by_device.values():
        # one flat vector per device (the calls' sketch widths k may differ: the recorder's
        # tensors with k=8 beside a one-number sketch), moved in the one sync for this device
        rows = [pending[i].values.reshape(-1).to(torch.float64) for i in indices]
        host = torch.cat(rows).cpu().split([row.numel() for row in rows])
        for i, row in zip(indices, host):
            lanes = row[:2].view(torch.int64).tolist()
            tail = row[2:].numpy()
            out[i] = _assemble(
                pending[i], tuple(lanes), tail[:-3].copy(), float(tail[-3]), float(tail[-2]), int(tail[-1])
            )
    return out  # type: ignore[return-value]


def _assemble(pending: PendingFingerprint, lanes, sketch, sumsq: float, max_abs: float, nonfinite: int) -> Fingerprint:
    low, high = int(lanes[0]) % (1 << 64), int(lanes[1]) % (1 << 64)
    digest_value = _finish_digest(low, high, pending.num_bytes, pending.seed) if pending.with_digest else 0
    return Fingerprint(
        digest=digest_value,
        sketch=np.asarray(sketch, dtype=np.float64),
        norm=float(np.sqrt(sumsq)),
        max_abs=float(max_abs),
        nonfinite=int(nonfinite),
        numel=pending.numel,
        lanes=(low, high) if pending.with_digest else None,
    )


def _torch_pass(flat: torch.Tensor, k: int, seed: int, block_offset: int, with_digest: bool):
    """The fallback path's one chunked pass: ``(digester or None, sketcher)``, results on the device."""
    device = flat.device
    # a multiple of both block sizes, for every element size
    chunk = _chunk_elems(device)
    raw = _raw_bytes(flat) if with_digest else None
    digester = _Digester(raw.numel(), device, seed, chunk * 4 // _BLOCK_BYTES) if with_digest else None
    sketcher = _Sketcher(flat, k, seed, block_offset, chunk)
    element_bytes = flat.element_size()
    with _full_precision_matmul(device):
        for start in range(0, flat.numel(), chunk):
            if digester is not None:
                digester.add(
                    start * element_bytes // _BLOCK_BYTES, raw[start * element_bytes : (start + chunk) * element_bytes]
                )
            sketcher.add(start, flat[start : start + chunk])
    return digester, sketcher


def _torch_fingerprint(
    flat: torch.Tensor, k: int, seed: int, block_offset: int, with_digest: bool, digest_block_offset: int = 0
) -> Fingerprint:
    """The fallback on CPU: host values at once (NaN/Inf counted by a second pass only when present)."""
    digester, sketcher = _torch_pass(flat, k, seed, block_offset, with_digest)
    sketch, norm, max_abs = sketcher.result()
    nonfinite = 0
    if not (np.isfinite(norm) and np.isfinite(max_abs)) and flat.is_floating_point():
        nonfinite = int((~torch.isfinite(flat)).sum().item())
        if nonfinite:
            max_abs = float("nan") if torch.isnan(flat).any() else float("inf")
    lanes = None
    if digester is not None:
        low, high = digester.lane_totals(digest_block_offset).tolist()
        lanes = (low % (1 << 64), high % (1 << 64))
    return Fingerprint(
        digest=digester.finish(*lanes) if lanes is not None else 0,
        sketch=sketch,
        norm=norm,
        max_abs=max_abs,
        nonfinite=nonfinite,
        numel=flat.numel(),
        lanes=lanes,
    )


def _torch_partials(
    flat: torch.Tensor, k: int, seed: int, block_offset: int, with_digest: bool, digest_block_offset: int = 0
) -> torch.Tensor:
    """The fallback on an accelerator: the pending vector, no host sync (NaN/Inf counted always)."""
    digester, sketcher = _torch_pass(flat, k, seed, block_offset, with_digest)
    lanes = (
        digester.lane_totals(digest_block_offset)
        if digester is not None
        else torch.zeros(2, dtype=torch.int64, device=flat.device)
    )
    sketch, sumsq, max_abs = sketcher.device_result()
    nonfinite = (
        (~torch.isfinite(flat)).sum().to(torch.float64)
        if flat.is_floating_point()
        else torch.zeros((), dtype=torch.float64, device=flat.device)
    )
    return torch.cat([lanes.view(torch.float64), sketch, torch.stack([sumsq, max_abs, nonfinite])])


_FMIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _finish_digests(low: np.ndarray, high: np.ndarray, num_bytes: np.ndarray, seed: int) -> np.ndarray:
    """:func:`_finish_digest` of arrays (uint64 arithmetic wraps mod 2**64, as the Python ints are masked)."""
    with np.errstate(over="ignore"):
        z = low + (high << np.uint64(32)) + num_bytes.astype(np.uint64) * np.uint64(C.digest_length_weight(seed))
        z = (z ^ (z >> np.uint64(30))) * _FMIX[0]
        z = (z ^ (z >> np.uint64(27))) * _FMIX[1]
        return z ^ (z >> np.uint64(31))


def weights_summary(tensors, seed: int = C.DEFAULT_SEED) -> tuple[int, float, int]:
    """``(digest, L2 norm, NaN/Inf count)`` of a model's parameters, in order: the digest
    :func:`combine_digests` of each tensor's :func:`digest`, the norm ``sqrt(sum of each
    tensor's norm squared)`` in order. The same numbers as :func:`fingerprints_async` with
    ``k=1`` and those sums; on the compiled CPU path the whole list is one call and the
    digests are finished together (a DDP step's weights pass, whatever the parameter count)."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return combine_digests([]), 0.0, 0
    fast = _weights_compiled(tensors, seed)
    if fast is not None:
        return fast
    done = resolve(fingerprints_async(tensors, k=1, seed=seed))
    value = combine_digests([fp.digest for fp in done])
    total = float(np.sqrt(sum(fp.norm * fp.norm for fp in done)))
    return value, total, int(sum(fp.nonfinite for fp in done))


def _weights_compiled(tensors: list[torch.Tensor], seed: int) -> tuple[int, float, int] | None:
    """:func:`weights_summary` in one kernel call, or None: a tensor the call does not take (off
    the CPU, another dtype, not contiguous or aligned, empty, a subclass), several dtypes, a NaN/Inf."""
    first = tensors[0]
    dtype = first.dtype
    name = str(dtype).removeprefix("torch.")
    if not cpu_kernel.supports(name) or kernel_path(first.device, dtype) != "numba-cpu":
        return None
    for t in tensors:
        if (
            type(t) not in (torch.Tensor, torch.nn.Parameter)
            or t.dtype != dtype
            or t.device.type != "cpu"
            or not t.is_contiguous()
            or not t.numel()
            or t.data_ptr() % 4
        ):
            return None
    addresses = np.fromiter((t.data_ptr() for t in tensors), dtype=np.int64, count=len(tensors))
    sizes = np.fromiter((t.numel() for t in tensors), dtype=np.int64, count=len(tensors))
    zeros = np.zeros(len(tensors), dtype=np.int64)
    try:
        lanes, _, sumsq, max_abs = cpu_kernel.many_at(
            addresses, sizes, name, k=1, seed=seed, block_offsets=zeros, digest_block_offsets=zeros, with_digest=True
        )
    except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
        _compiled_failed(exc)
        return None
    _note_path(first.device, "numba-cpu")
    # NaN/Inf somewhere: counted by the general path
    if not (np.isfinite(sumsq).all() and np.isfinite(max_abs).all()):
        return None
    each = _finish_digests(lanes[:, 0], lanes[:, 1], sizes * first.element_size(), seed)
    norms = np.sqrt(sumsq)
    # in order, as sum() of the Python floats: the same bits
    total = float(np.sqrt(sum((norms * norms).tolist())))
    return combine_digests(each.tolist()), total, 0


def num_sketch_blocks(numel: int) -> int:
    """Sketch blocks a tensor of ``numel`` elements occupies (the next piece's ``block_offset``)."""
    return max(1, -(-numel // C.BLOCK_ELEMS))


def combine_digests(digests) -> int:
    """Digest of a sequence of digests, in order (a model = its parameters in a fixed order)."""
    words = np.asarray([d % (1 << 64) for d in digests], dtype="<u8")
    # called several times per replayed step: the compiled loop, not numpy's
    if _cpu_kernel_ok():
        try:
            low, high = cpu_kernel.digest_lanes(words.view(np.uint8))
        except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
            _compiled_failed(exc)
        else:
            return _finish_digest(low, high, words.nbytes, C.DEFAULT_SEED)
    from sdc_forensics.fingerprint.reference import digest_bytes

    return digest_bytes(words)


def combine(parts: list[Fingerprint]) -> Fingerprint:
    """Fingerprint of the concatenation of pieces fingerprinted with consecutive block offsets."""
    if not parts:
        raise ValueError("combine() needs at least one fingerprint")
    return Fingerprint(
        digest=combine_digests(p.digest for p in parts),
        sketch=np.sum([p.sketch for p in parts], axis=0),
        norm=float(np.sqrt(sum(p.norm**2 for p in parts))),
        max_abs=float(np.max([p.max_abs for p in parts])),  # NaN wins, as in fingerprint()
        nonfinite=sum(p.nonfinite for p in parts),
        numel=sum(p.numel for p in parts),
    )
