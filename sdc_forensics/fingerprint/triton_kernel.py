"""One-pass fingerprint partials on CUDA, in Triton: digest lanes, sketch and stats from one read.

:func:`partials` reads a flat CUDA tensor (float32, bfloat16, float16, float64) once and leaves
on the device, with no host sync, one float64 vector of length ``2 + k + 3``::

    [0]         lane_low   sum_j c_j  * s_j  mod 2**64  (int64 bits, read with .view(torch.int64))
    [1]         lane_high  sum_j c'_j * t_j  mod 2**64  (likewise)
    [2 : 2+k]   sketch     S_m, m < k
    [2+k]       sumsq      sum_e x_e**2
    [3+k]       max_abs    max_e |x_e|; NaN if any element is NaN, else Inf if any is infinite
    [4+k]       nonfinite  count of NaN and +-Inf elements

The lanes are those of ``core._Digester.lane_totals()``; the caller adds ``c_len * N`` and
applies ``fmix64`` (``docs/fingerprints.md``). Sketch blocks start at ``block_offset``.

Layout: a *tile* is one digest block (4096 bytes: 1024 float32, 2048 16-bit, 512 float64
elements). Program ``p`` of ``G`` handles tiles ``p, p + G, ...``, at most 1024 of them (512 of
16-bit), two per loop iteration, each loaded an iteration ahead. Per tile it loads the 1024 little-endian 32-bit words once, in the dtype's integer view, and derives the
values from the same registers (bfloat16: ``bits << 16``; float16: a bit cast; float64: two
words per element). Digest: one wrapping int32 multiply-sum per lane per tile, then ``c_j * s_j``
in wrapping int64. Sketch: as ``core._Sketcher``, ``Y = beta^T X`` accumulated in float32
registers (one term per tile, so every float32 sum has at most 1024 terms, as
``tolerance.py`` assumes), then ``S_m = sum_i alpha_m[i] Y[m, i]`` in float64 at the end;
float64 tensors accumulate in float64 directly. Stats: float32 squares per register lane
(float64 for float64), max |x| as the integer max of the finite elements' absolute bit patterns,
NaN and Inf counted separately. Each program writes one row of partials; a second, one-program
kernel adds the ``G`` rows in a fixed order (deterministic) into the output vector: two launches
per call.

Triton is optional: importing this module never fails; :func:`available` says why the kernel
cannot run. Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels
run on CPU tensors through Triton's numpy interpreter; the tests use that.

Over 400 lines on purpose: Triton jit functions call each other only within a module's globals, and
the launch wrappers set the constants the kernels are compiled with.
"""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint.tables import TableCache

# optional: Triton ships with the CUDA builds of torch, not with the CPU ones
try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR = ""
except Exception as error:  # noqa: BLE001 - a broken triton install must not break the package
    triton = None
    tl = None
    _IMPORT_ERROR = f"triton not installed ({type(error).__name__}: {error})"

#: Environment switch: ``SDC_FORENSICS_KERNELS=off`` disables every compiled kernel.
KERNELS_ENV = "SDC_FORENSICS_KERNELS"
# one digest block per tile
_TILE_WORDS = C.BLOCK_WORDS
# keeps every float32 sum of Y at <= 1024 terms
_MAX_TILES_PER_PROGRAM = C.BLOCK_ELEMS
# rows of partials the finishing kernel adds per step
_FINISH_ROWS = 256
# Launch settings: not measured on a GPU yet (docs/gpu.md); bench_fingerprint.py --sweep-triton times them.
_PROGRAMS_PER_SM = 4
_NUM_WARPS = 8
# tiles per loop iteration in the float32 and 16-bit kernels (1 or 2): more loads in flight
_UNROLL = 2
# per thread: two 8-warp programs per SM (ptxas for sm_90 needs 128-136 and spills none at 128)
_MAX_REGISTERS = 128
_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_lock = threading.Lock()
_tables: dict[tuple, torch.Tensor] = {}


def available(device: torch.device) -> tuple[bool, str]:
    """Whether :func:`partials` can run on ``device``.

    Args:
        device: the tensor's device.

    Returns:
        ``(True, "")``, or ``(False, reason)`` with a reason a person can act on.
    """
    if os.environ.get(KERNELS_ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False, f"disabled by {KERNELS_ENV}=off"
    if triton is None:
        return False, _IMPORT_ERROR
    device = torch.device(device)
    if device.type != "cuda":
        return False, "not a CUDA device"
    if not torch.cuda.is_available():
        return False, "CUDA is not available to torch"
    return True, ""


def supports(dtype: torch.dtype) -> bool:
    """Whether :func:`partials` takes tensors of ``dtype``."""
    return dtype in _SUPPORTED


def partials(
    flat: torch.Tensor, *, k: int, seed: int, block_offset: int, with_digest: bool, digest_block_offset: int = 0
) -> torch.Tensor:
    """Digest lanes, sketch and stats of a flat tensor, in one read, left on its device.

    Args:
        flat: 1-D tensor of float32, bfloat16, float16 or float64 (a CUDA tensor; a CPU tensor
            under ``TRITON_INTERPRET=1``). A non-contiguous one is copied first.
        k: number of sketch projections.
        seed: the fingerprint seed.
        block_offset: index of the first sketch block (``core.fingerprint``'s argument).
        with_digest: when False the two lane entries are 0 and the digest is not computed.
        digest_block_offset: index of the first digest block (``core.fingerprint``'s argument).

    Returns:
        float64 tensor of shape ``(2 + k + 3,)`` on ``flat``'s device, laid out as in the module
        docstring. No host synchronisation happens.

    Raises:
        RuntimeError: triton is not importable.
        TypeError: the dtype is not one of the four supported.
        ValueError: ``k < 1`` or ``block_offset < 0``.
    """
    if triton is None:
        raise RuntimeError(f"the Triton fingerprint kernel cannot run: {_IMPORT_ERROR}")
    if flat.dtype not in _SUPPORTED:
        raise TypeError(f"the Triton fingerprint kernel takes float32, bfloat16, float16 or float64, not {flat.dtype}")
    if k < 1 or block_offset < 0 or digest_block_offset < 0:
        raise ValueError(
            f"need k >= 1 and block offsets >= 0 (got k={k}, block_offset={block_offset}, "
            f"digest_block_offset={digest_block_offset})"
        )
    flat = flat.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    device = flat.device
    numel = flat.numel()
    if numel == 0:
        return torch.zeros(2 + k + 3, dtype=torch.float64, device=device)
    num_tiles, num_sblocks, programs = _plan(numel, flat.element_size(), device)
    # k padded to a power of two (extra columns are zero)
    kp = 1 << (k - 1).bit_length()
    a, b = _word_weights(device, seed)
    d0 = digest_block_offset
    c_low = _block_weights(device, d0 + num_tiles, seed, high=False)[d0:]
    c_high = _block_weights(device, d0 + num_tiles, seed, high=True)[d0:]
    alpha = _alpha(device, k, kp, seed)
    beta = _beta(device, block_offset + num_sblocks, k, kp, seed)[block_offset:]
    # low, high, NaN, Inf
    int_rows = torch.empty(programs, 4, dtype=torch.int64, device=device)
    # sketch, sumsq, max
    float_rows = torch.empty(programs, kp + 2, dtype=torch.float64, device=device)
    common = dict(KP=kp, WITH_DIGEST=with_digest, LIST=False, num_warps=_NUM_WARPS, **_launch_options(device))
    tables = (numel, num_tiles, a, b, c_low, c_high, alpha, beta, num_sblocks, int_rows, float_rows)
    # Triton launches on the current CUDA device: make it the tensor's
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        # (the job tables are not read by a launch of one tensor: any tensor stands in)
        _launch(flat, (programs,), *tables, int_rows, int_rows, common, dict(UNROLL=_UNROLL, **common))
        out = torch.empty(2 + k + 3, dtype=torch.float64, device=device)
        _finish[(1,)](
            int_rows, float_rows, out, programs, int_rows, K=k, KP=kp, ROWS=_FINISH_ROWS, LIST=False, num_warps=4
        )
    return out


def _plan(numel: int, element_size: int, device: torch.device) -> tuple[int, int, int]:
    """``(tiles, sketch blocks, programs)`` of a launch over ``numel`` elements."""
    # = digest blocks
    num_tiles = -(-numel * element_size // (4 * _TILE_WORDS))
    num_sblocks = -(-numel // C.BLOCK_ELEMS)
    # 16-bit tiles add two terms per tile to each float32 Y entry: half as many tiles per program
    max_tiles = _MAX_TILES_PER_PROGRAM // (2 if element_size == 2 else 1)
    programs = min(num_tiles, max(_programs_for(device), -(-num_tiles // max_tiles)))
    return num_tiles, num_sblocks, programs


def partials_many(
    flats: list[torch.Tensor],
    *,
    k: int,
    seed: int,
    block_offsets: list[int],
    with_digest: bool,
    digest_block_offsets: list[int],
) -> torch.Tensor:
    """:func:`partials` of several tensors of one dtype on one device, in one launch (and one of
    the finishing kernel): ``(len(flats), 2 + k + 3)`` float64, row ``i`` what
    ``partials(flats[i], ...)`` returns, bit for bit (each tensor gets the programs its own launch
    would, found through a job table). 16-bit tensors read as pairs (odd length or offset) take a
    launch of their own. The tables go to the device through pinned memory: no host sync."""
    if triton is None:
        raise RuntimeError(f"the Triton fingerprint kernel cannot run: {_IMPORT_ERROR}")
    if k < 1 or min(block_offsets, default=0) < 0 or min(digest_block_offsets, default=0) < 0:
        raise ValueError("need k >= 1 and block offsets >= 0")
    flats = [f.detach().reshape(-1) for f in flats]
    flats = [f if f.is_contiguous() else f.contiguous() for f in flats]
    if not flats:
        raise ValueError("partials_many() needs at least one tensor")
    device, dtype = flats[0].device, flats[0].dtype
    if any(f.device != device or f.dtype != dtype for f in flats) or dtype not in _SUPPORTED:
        raise TypeError("partials_many() takes tensors of one supported dtype on one device")
    out = torch.zeros(len(flats), 2 + k + 3, dtype=torch.float64, device=device)
    # 16-bit: pairs (odd length or offset) read as int16, the rest as words; empty tensors stay 0
    groups: dict[bool, list[int]] = {}
    for index, flat in enumerate(flats):
        if flat.numel():
            paired = flat.element_size() == 2 and (flat.numel() % 2 == 1 or flat.storage_offset() % 2 == 1)
            groups.setdefault(paired, []).append(index)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for paired, indices in groups.items():
            rows = _launch_many(
                [flats[i] for i in indices],
                k,
                seed,
                [block_offsets[i] for i in indices],
                with_digest,
                [digest_block_offsets[i] for i in indices],
                paired,
            )
            out[indices] = rows
    return out


def _launch_many(flats, k, seed, block_offsets, with_digest, digest_block_offsets, paired) -> torch.Tensor:
    """One launch over ``flats`` (non-empty, one dtype, one way of reading 16-bit words)."""
    device, element = flats[0].device, flats[0].element_size()
    kp = 1 << (k - 1).bit_length()
    plans = [_plan(f.numel(), element, device) for f in flats]
    # per tensor: address, numel, tiles, sketch blocks, first digest block, first sketch block
    tensors = np.array(
        [
            [f.data_ptr(), f.numel(), tiles, sblocks, d0, b0]
            for f, (tiles, sblocks, _), d0, b0 in zip(flats, plans, digest_block_offsets, block_offsets)
        ],
        dtype=np.int64,
    )
    counts = np.array([programs for _, _, programs in plans], dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # per program: its tensor, its program within it, that tensor's programs
    jobs = np.stack(
        [
            np.repeat(np.arange(len(flats)), counts),
            np.arange(counts.sum()) - np.repeat(firsts, counts),
            np.repeat(counts, counts),
        ],
        axis=1,
    )
    rows = np.stack([firsts, counts], axis=1)
    tensors_t, jobs_t, rows_t = (_to_device(t, device) for t in (tensors, jobs, rows))
    total = int(counts.sum())
    a, b = _word_weights(device, seed)
    c_low = _block_weights(device, int((tensors[:, 4] + tensors[:, 2]).max()), seed, high=False)
    c_high = _block_weights(device, int((tensors[:, 4] + tensors[:, 2]).max()), seed, high=True)
    alpha = _alpha(device, k, kp, seed)
    beta = _beta(device, int((tensors[:, 5] + tensors[:, 3]).max()), k, kp, seed)
    int_rows = torch.empty(total, 4, dtype=torch.int64, device=device)
    float_rows = torch.empty(total, kp + 2, dtype=torch.float64, device=device)
    common = dict(KP=kp, WITH_DIGEST=with_digest, LIST=True, num_warps=_NUM_WARPS, **_launch_options(device))
    # the first tensor stands for the dtype (and the 16-bit reading); the numbers come from the tables
    first = flats[0]
    tables = (0, 0, a, b, c_low, c_high, alpha, beta, 0, int_rows, float_rows)
    _launch(first, (total,), *tables, jobs_t, tensors_t, common, dict(UNROLL=_UNROLL, **common), paired=paired)
    out = torch.empty(len(flats), 2 + k + 3, dtype=torch.float64, device=device)
    _finish[(len(flats),)](int_rows, float_rows, out, 0, rows_t, K=k, KP=kp, ROWS=_FINISH_ROWS, LIST=True, num_warps=4)
    return out


def _to_device(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small int64 table on ``device``: through pinned memory, queued, no host sync (CUDA)."""
    host = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _launch(
    flat,
    grid,
    numel,
    num_tiles,
    a,
    b,
    c_low,
    c_high,
    alpha,
    beta,
    num_sblocks,
    int_rows,
    float_rows,
    jobs,
    tensors,
    common: dict,
    unrolled: dict,
    paired: bool | None = None,
) -> None:
    """The dtype's kernel on ``flat``'s integer view (float32/float64/16-bit); ``jobs`` and
    ``tensors`` are the job tables of a launch over a list (else unread)."""
    tail = (alpha, beta, num_sblocks, int_rows, float_rows, jobs, tensors)
    if flat.dtype == torch.float32:
        _kernel32[grid](flat.view(torch.int32), numel, num_tiles, a, b, c_low, c_high, *tail, **unrolled)
    elif flat.dtype == torch.float64:
        _kernel64[grid](flat.view(torch.int64), numel, num_tiles, a, b, c_low, c_high, *tail, **common)
    else:
        # no int32 view: load 16-bit pairs
        if paired is None:
            paired = numel % 2 == 1 or flat.storage_offset() % 2 == 1
        data = flat.view(torch.int16) if paired else flat.view(torch.int32)
        _kernel16[grid](
            data,
            numel,
            num_tiles,
            a,
            b,
            c_low,
            c_high,
            *tail,
            IS_BF16=flat.dtype == torch.bfloat16,
            PAIRED=paired,
            **unrolled,
        )


# --- constant tables, on the device, cached (prefix-stable ones at power-of-two lengths) ------


_constants = TableCache()
_cached = _constants.get
_prefix = _constants.prefix


def _word_weights(device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    a = _cached(("a", device, seed), lambda: torch.from_numpy(C.digest_word_weights(seed).copy()).to(device))
    b = _cached(("b", device, seed), lambda: torch.from_numpy(C.digest_high_weights(seed).copy()).to(device))
    return a, b


def _block_weights(device: torch.device, rows: int, seed: int, *, high: bool) -> torch.Tensor:
    return _prefix(
        ("c", device, seed, high),
        rows,
        lambda size: torch.from_numpy(C.digest_block_weights(size, seed, high=high)).to(device),
    )


def _padded(signs, kp: int) -> torch.Tensor:
    table = torch.zeros(signs.shape[0], kp, dtype=torch.float32)
    table[:, : signs.shape[1]] = torch.from_numpy(signs)
    return table


def _alpha(device: torch.device, k: int, kp: int, seed: int) -> torch.Tensor:
    return _cached(("alpha", device, k, seed), lambda: _padded(C.sketch_in_block_signs(k, seed), kp).to(device))


def _beta(device: torch.device, rows: int, k: int, kp: int, seed: int) -> torch.Tensor:
    return _prefix(
        ("beta", device, k, seed), rows, lambda size: _padded(C.sketch_block_signs(size, k, seed), kp).to(device)
    )


def _launch_options(device: torch.device) -> dict:
    """``maxnreg`` on CUDA where this Triton has that option (3.0 on); nothing under the interpreter."""
    if device.type != "cuda":
        return {}
    key = ("launch", device.type)
    with _lock:
        if key not in _tables:
            try:
                from triton.backends.nvidia.compiler import CUDAOptions

                has = "maxnreg" in CUDAOptions.__dataclass_fields__
            except Exception:  # noqa: BLE001 - another backend layout: launch with defaults
                has = False
            _tables[key] = {"maxnreg": _MAX_REGISTERS} if has else {}
        return dict(_tables[key])


def _programs_for(device: torch.device) -> int:
    if device.type != "cuda":
        # the interpreter: a few programs, several tiles each, exercise the same paths
        return 3
    key = ("sms", device)
    with _lock:
        if key not in _tables:
            _tables[key] = torch.cuda.get_device_properties(device).multi_processor_count
        return _PROGRAMS_PER_SM * int(_tables[key])


# --- kernels --------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _abs_bits32(x):
        """|x|'s bit pattern (int32) of float32 values."""
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def _finite_stats(bits, max_bits, nan, inf):
        """Running max of the finite ``|x|`` bit patterns (float32) and NaN/Inf counts."""
        max_bits = tl.maximum(max_bits, tl.where(bits < 0x7F800000, bits, 0))
        nan += (bits > 0x7F800000).to(tl.int32)
        inf += (bits == 0x7F800000).to(tl.int32)
        return max_bits, nan, inf

    @triton.jit
    def _lanes(low, high, s, t, c_ptr, ch_ptr, tile, num_tiles):
        """Adds tile ``tile``'s ``c_j s_j`` and ``c'_j t_j`` to the lanes (nothing for a tile past the end).

        ``s``/``t`` are the block's wrapping int32 sums; only their low 32 bits count.
        """
        valid = tile < num_tiles
        low += tl.load(c_ptr + tile, mask=valid, other=0) * (s.to(tl.int64) & 0xFFFFFFFF)
        high += tl.load(ch_ptr + tile, mask=valid, other=0) * (t.to(tl.int64) & 0xFFFFFFFF)
        return low, high

    @triton.jit
    def _store(int_ptr, float_ptr, low, high, nan, inf, sketch, sumsq, max_abs, KP: tl.constexpr):
        pid = tl.program_id(0)
        tl.store(int_ptr + pid * 4 + 0, low)
        tl.store(int_ptr + pid * 4 + 1, high)
        tl.store(int_ptr + pid * 4 + 2, nan)
        tl.store(int_ptr + pid * 4 + 3, inf)
        row = float_ptr + pid * (KP + 2)
        tl.store(row + tl.arange(0, KP), sketch)
        tl.store(row + KP, sumsq)
        tl.store(row + KP + 1, max_abs)

    @triton.jit
    def _job(
        jobs_ptr,
        tensors_ptr,
        data_ptr,
        numel,
        num_tiles,
        num_sblocks,
        c_ptr,
        ch_ptr,
        beta_ptr,
        WORD: tl.constexpr,
        KP: tl.constexpr,
        LIST: tl.constexpr,
    ):
        """What this program reads: one tensor's ``(pid, programs, data, numel, tiles, sketch
        blocks, c, c', beta)``. One tensor: the launch's arguments. ``LIST``: program ``g`` does
        job ``g`` of ``jobs_ptr`` (``[tensor, its program, its programs]``: each tensor's
        programs as its own launch would have them, so the numbers are that launch's), and the
        tensor's row of ``tensors_ptr`` gives ``[address, numel, tiles, sketch blocks, first
        digest block, first sketch block]``; the weights tables start at block 0."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        if LIST:
            job = jobs_ptr + pid.to(tl.int64) * 3
            row = tensors_ptr + tl.load(job) * 6
            pid = tl.load(job + 1)
            programs = tl.load(job + 2)
            data_ptr = tl.load(row).to(tl.pointer_type(WORD))
            numel = tl.load(row + 1)
            num_tiles = tl.load(row + 2)
            num_sblocks = tl.load(row + 3)
            c_ptr += tl.load(row + 4)
            ch_ptr += tl.load(row + 4)
            beta_ptr += tl.load(row + 5) * KP
        return pid, programs, data_ptr, numel, num_tiles, num_sblocks, c_ptr, ch_ptr, beta_ptr

    @triton.jit
    def _load32(words_ptr, numel, tile):
        e = tile * 1024 + tl.arange(0, 1024)
        return tl.load(words_ptr + e, mask=e < numel, other=0)

    @triton.jit
    def _tile32(
        w,
        tile,
        num_tiles,
        a,
        b,
        c_ptr,
        ch_ptr,
        beta_ptr,
        low,
        high,
        y,
        sq,
        max_bits,
        nan,
        inf,
        KP: tl.constexpr,
        WITH_DIGEST: tl.constexpr,
    ):
        """Adds one float32 tile (words ``w``; all zero past the end) to a program's accumulators."""
        if WITH_DIGEST:
            # wrapping int32: s_j mod 2**32
            s = tl.sum(w * a)
            # arithmetic shift: the sign-extended top half
            t = tl.sum((w >> 16) * b)
            low, high = _lanes(low, high, s, t, c_ptr, ch_ptr, tile, num_tiles)
        x = w.to(tl.float32, bitcast=True)
        m = tl.arange(0, KP)
        beta = tl.load(beta_ptr + tile * KP + m, mask=tile + m * 0 < num_tiles, other=0.0)
        y += x[:, None] * beta[None, :]
        sq += x * x
        max_bits, nan, inf = _finite_stats(w & 0x7FFFFFFF, max_bits, nan, inf)
        return low, high, y, sq, max_bits, nan, inf

    @triton.jit
    def _kernel32(
        words_ptr,
        numel,
        num_tiles,
        a_ptr,
        b_ptr,
        c_ptr,
        ch_ptr,
        alpha_ptr,
        beta_ptr,
        num_sblocks,
        int_ptr,
        float_ptr,
        jobs_ptr,
        tensors_ptr,
        KP: tl.constexpr,
        WITH_DIGEST: tl.constexpr,
        UNROLL: tl.constexpr,
        LIST: tl.constexpr,
    ):
        """float32: a tile is 1024 elements, one digest block and one sketch block.

        ``UNROLL`` (1 or 2) tiles per loop iteration, each loaded one iteration ahead. ``LIST``:
        a list of tensors in one launch (:func:`_job`).
        """
        pid, programs, words_ptr, numel, num_tiles, num_sblocks, c_ptr, ch_ptr, beta_ptr = _job(
            jobs_ptr, tensors_ptr, words_ptr, numel, num_tiles, num_sblocks, c_ptr, ch_ptr, beta_ptr, tl.int32, KP, LIST
        )
        i = tl.arange(0, 1024)
        m = tl.arange(0, KP)
        a = tl.load(a_ptr + i)
        b = tl.load(b_ptr + i)
        low = tl.zeros((), dtype=tl.int64)
        high = tl.zeros((), dtype=tl.int64)
        # Y[i, m] = sum_j beta_m[j] x[j, i], this program's j
        y = tl.zeros((1024, KP), dtype=tl.float32)
        sq = tl.zeros((1024,), dtype=tl.float32)
        max_bits = tl.zeros((1024,), dtype=tl.int32)
        nan = tl.zeros((1024,), dtype=tl.int32)
        inf = tl.zeros((1024,), dtype=tl.int32)
        stride = UNROLL * programs
        first = pid.to(tl.int64)
        next_a = _load32(words_ptr, numel, first)
        if UNROLL == 2:
            next_b = _load32(words_ptr, numel, first + programs)
        for n in range(0, tl.cdiv(tl.cdiv(num_tiles - pid, programs), UNROLL)):
            tile = first + n * stride
            w_a = next_a
            # prefetch; masked past the end
            next_a = _load32(words_ptr, numel, tile + stride)
            if UNROLL == 2:
                w_b = next_b
                next_b = _load32(words_ptr, numel, tile + programs + stride)
            low, high, y, sq, max_bits, nan, inf = _tile32(
                w_a,
                tile,
                num_tiles,
                a,
                b,
                c_ptr,
                ch_ptr,
                beta_ptr,
                low,
                high,
                y,
                sq,
                max_bits,
                nan,
                inf,
                KP,
                WITH_DIGEST,
            )
            if UNROLL == 2:
                low, high, y, sq, max_bits, nan, inf = _tile32(
                    w_b,
                    tile + programs,
                    num_tiles,
                    a,
                    b,
                    c_ptr,
                    ch_ptr,
                    beta_ptr,
                    low,
                    high,
                    y,
                    sq,
                    max_bits,
                    nan,
                    inf,
                    KP,
                    WITH_DIGEST,
                )
        alpha = tl.load(alpha_ptr + i[:, None] * KP + m[None, :]).to(tl.float64)
        sketch = tl.sum(alpha * y.to(tl.float64), axis=0)
        max_abs = tl.max(max_bits, axis=0).to(tl.float32, bitcast=True).to(tl.float64)
        _store(
            int_ptr,
            float_ptr,
            low,
            high,
            tl.sum(nan.to(tl.int64), axis=0),
            tl.sum(inf.to(tl.int64), axis=0),
            sketch,
            tl.sum(sq.to(tl.float64), axis=0),
            max_abs,
            KP,
        )

    @triton.jit
    def _words16(data_ptr, numel, tile, half, PAIRED: tl.constexpr):
        """Words ``512 half .. 512 half + 511`` of a 16-bit tile (zero past the end), as int32."""
        w = tl.arange(0, 512) + 512 * half
        # the even element of each word
        e = tile * 2048 + 2 * w
        if PAIRED:
            even = tl.load(data_ptr + e, mask=e < numel, other=0).to(tl.int32) & 0xFFFF
            odd = tl.load(data_ptr + e + 1, mask=e + 1 < numel, other=0).to(tl.int32)
            words = even | (odd << 16)
        else:
            words = tl.load(data_ptr + tile * 1024 + w, mask=e < numel, other=0)
        return words

    @triton.jit
    def _values16(w, IS_BF16: tl.constexpr):
        """The two 16-bit elements of each word as float32: (low half = even element, high half)."""
        if IS_BF16:
            even = (w << 16).to(tl.float32, bitcast=True)
            odd = (w & -65536).to(tl.float32, bitcast=True)
        else:
            even = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return even, odd

    @triton.jit
    def _tile16(
        w0,
        w1,
        tile,
        num_tiles,
        num_sblocks,
        a0,
        a1,
        b0,
        b1,
        c_ptr,
        ch_ptr,
        beta_ptr,
        low,
        high,
        y_even,
        y_odd,
        sq,
        max_bits,
        nan,
        inf,
        KP: tl.constexpr,
        WITH_DIGEST: tl.constexpr,
        IS_BF16: tl.constexpr,
    ):
        """Adds one 16-bit tile (halves ``w0``, ``w1``; all zero past the end) to a program's accumulators."""
        if WITH_DIGEST:
            # wrapping int32: s_j mod 2**32
            s = tl.sum(w0 * a0 + w1 * a1)
            t = tl.sum((w0 >> 16) * b0 + (w1 >> 16) * b1)
            low, high = _lanes(low, high, s, t, c_ptr, ch_ptr, tile, num_tiles)
        # first sketch block: elements 2w, 2w + 1
        x00, x01 = _values16(w0, IS_BF16)
        # second sketch block
        x10, x11 = _values16(w1, IS_BF16)
        m = tl.arange(0, KP)
        block = 2 * tile
        beta0 = tl.load(beta_ptr + block * KP + m, mask=block + m * 0 < num_sblocks, other=0.0)
        beta1 = tl.load(beta_ptr + (block + 1) * KP + m, mask=block + 1 + m * 0 < num_sblocks, other=0.0)
        y_even += x00[:, None] * beta0[None, :]
        y_even += x10[:, None] * beta1[None, :]
        y_odd += x01[:, None] * beta0[None, :]
        y_odd += x11[:, None] * beta1[None, :]
        sq += x00 * x00 + x01 * x01 + x10 * x10 + x11 * x11
        max_bits, nan, inf = _finite_stats(_abs_bits32(x00), max_bits, nan, inf)
        max_bits, nan, inf = _finite_stats(_abs_bits32(x01), max_bits, nan, inf)
        max_bits, nan, inf = _finite_stats(_abs_bits32(x10), max_bits, nan, inf)
        max_bits, nan, inf = _finite_stats(_abs_bits32(x11), max_bits, nan, inf)
        return low, high, y_even, y_odd, sq, max_bits, nan, inf

    @triton.jit
    def _kernel16(
        data_ptr,
        numel,
        num_tiles,
        a_ptr,
        b_ptr,
        c_ptr,
        ch_ptr,
        alpha_ptr,
        beta_ptr,
        num_sblocks,
        int_ptr,
        float_ptr,
        jobs_ptr,
        tensors_ptr,
        KP: tl.constexpr,
        WITH_DIGEST: tl.constexpr,
        IS_BF16: tl.constexpr,
        PAIRED: tl.constexpr,
        UNROLL: tl.constexpr,
        LIST: tl.constexpr,
    ):
        """bfloat16/float16: a tile is 1024 words = 2048 elements, one digest block, two sketch blocks.

        Word ``w`` holds elements ``2w`` (low half) and ``2w + 1``. The tile is handled as two
        halves of 512 words, one per sketch block; both halves' element ``2w + j`` sit at
        sketch position ``2w + j``, so they share one ``Y`` entry: two terms per tile, at most
        512 tiles per program (the host's cap), so every float32 sum still has <= 1024 terms.
        ``data_ptr`` is the int32 view, or with ``PAIRED`` (odd length or odd offset) the int16
        view, whose pairs are assembled into words in registers. ``UNROLL`` (1 or 2) tiles per
        loop iteration, each loaded one iteration ahead. ``LIST``: a list of tensors (:func:`_job`).
        """
        pid, programs, data_ptr, numel, num_tiles, num_sblocks, c_ptr, ch_ptr, beta_ptr = _job(
            jobs_ptr,
            tensors_ptr,
            data_ptr,
            numel,
            num_tiles,
            num_sblocks,
            c_ptr,
            ch_ptr,
            beta_ptr,
            tl.int16 if PAIRED else tl.int32,
            KP,
            LIST,
        )
        i = tl.arange(0, 512)
        m = tl.arange(0, KP)
        a0 = tl.load(a_ptr + i)
        a1 = tl.load(a_ptr + 512 + i)
        b0 = tl.load(b_ptr + i)
        b1 = tl.load(b_ptr + 512 + i)
        low = tl.zeros((), dtype=tl.int64)
        high = tl.zeros((), dtype=tl.int64)
        # Y at sketch positions 2w
        y_even = tl.zeros((512, KP), dtype=tl.float32)
        # Y at sketch positions 2w + 1
        y_odd = tl.zeros((512, KP), dtype=tl.float32)
        sq = tl.zeros((512,), dtype=tl.float32)
        max_bits = tl.zeros((512,), dtype=tl.int32)
        nan = tl.zeros((512,), dtype=tl.int32)
        inf = tl.zeros((512,), dtype=tl.int32)
        stride = UNROLL * programs
        first = pid.to(tl.int64)
        next_a0 = _words16(data_ptr, numel, first, 0, PAIRED)
        next_a1 = _words16(data_ptr, numel, first, 1, PAIRED)
        if UNROLL == 2:
            next_b0 = _words16(data_ptr, numel, first + programs, 0, PAIRED)
            next_b1 = _words16(data_ptr, numel, first + programs, 1, PAIRED)
        for n in range(0, tl.cdiv(tl.cdiv(num_tiles - pid, programs), UNROLL)):
            tile = first + n * stride
            w_a0 = next_a0
            w_a1 = next_a1
            # prefetch; masked past the end
            next_a0 = _words16(data_ptr, numel, tile + stride, 0, PAIRED)
            next_a1 = _words16(data_ptr, numel, tile + stride, 1, PAIRED)
            if UNROLL == 2:
                w_b0 = next_b0
                w_b1 = next_b1
                next_b0 = _words16(data_ptr, numel, tile + programs + stride, 0, PAIRED)
                next_b1 = _words16(data_ptr, numel, tile + programs + stride, 1, PAIRED)
            low, high, y_even, y_odd, sq, max_bits, nan, inf = _tile16(
                w_a0,
                w_a1,
                tile,
                num_tiles,
                num_sblocks,
                a0,
                a1,
                b0,
                b1,
                c_ptr,
                ch_ptr,
                beta_ptr,
                low,
                high,
                y_even,
                y_odd,
                sq,
                max_bits,
                nan,
                inf,
                KP,
                WITH_DIGEST,
                IS_BF16,
            )
            if UNROLL == 2:
                low, high, y_even, y_odd, sq, max_bits, nan, inf = _tile16(
                    w_b0,
                    w_b1,
                    tile + programs,
                    num_tiles,
                    num_sblocks,
                    a0,
                    a1,
                    b0,
                    b1,
                    c_ptr,
                    ch_ptr,
                    beta_ptr,
                    low,
                    high,
                    y_even,
                    y_odd,
                    sq,
                    max_bits,
                    nan,
                    inf,
                    KP,
                    WITH_DIGEST,
                    IS_BF16,
                )
        alpha_even = tl.load(alpha_ptr + (2 * i)[:, None] * KP + m[None, :]).to(tl.float64)
        alpha_odd = tl.load(alpha_ptr + (2 * i + 1)[:, None] * KP + m[None, :]).to(tl.float64)
        sketch = tl.sum(alpha_even * y_even.to(tl.float64) + alpha_odd * y_odd.to(tl.float64), axis=0)
        max_abs = tl.max(max_bits, axis=0).to(tl.float32, bitcast=True).to(tl.float64)
        _store(
            int_ptr,
            float_ptr,
            low,
            high,
            tl.sum(nan.to(tl.int64), axis=0),
            tl.sum(inf.to(tl.int64), axis=0),
            sketch,
            tl.sum(sq.to(tl.float64), axis=0),
            max_abs,
            KP,
        )

    @triton.jit
    def _kernel64(
        data_ptr,
        numel,
        num_tiles,
        a_ptr,
        b_ptr,
        c_ptr,
        ch_ptr,
        alpha_ptr,
        beta_ptr,
        num_sblocks,
        int_ptr,
        float_ptr,
        jobs_ptr,
        tensors_ptr,
        KP: tl.constexpr,
        WITH_DIGEST: tl.constexpr,
        LIST: tl.constexpr,
    ):
        """float64: a tile is 512 elements (1024 words, low word first), half a sketch block.

        The sketch accumulates in float64 directly: a per-tile sum of 512 terms times ``beta``.
        ``LIST``: a list of tensors (:func:`_job`).
        """
        pid, programs, data_ptr, numel, num_tiles, num_sblocks, c_ptr, ch_ptr, beta_ptr = _job(
            jobs_ptr, tensors_ptr, data_ptr, numel, num_tiles, num_sblocks, c_ptr, ch_ptr, beta_ptr, tl.int64, KP, LIST
        )
        i = tl.arange(0, 512)
        m = tl.arange(0, KP)
        a_low = tl.load(a_ptr + 2 * i)
        a_high = tl.load(a_ptr + 2 * i + 1)
        b_low = tl.load(b_ptr + 2 * i)
        b_high = tl.load(b_ptr + 2 * i + 1)
        low = tl.zeros((), dtype=tl.int64)
        high = tl.zeros((), dtype=tl.int64)
        sketch = tl.zeros((KP,), dtype=tl.float64)
        sq = tl.zeros((512,), dtype=tl.float64)
        max_bits = tl.zeros((512,), dtype=tl.int64)
        nan = tl.zeros((512,), dtype=tl.int32)
        inf = tl.zeros((512,), dtype=tl.int32)
        e = pid.to(tl.int64) * 512 + i
        upcoming = tl.load(data_ptr + e, mask=e < numel, other=0)
        for n in range(0, tl.cdiv(num_tiles - pid, programs)):
            tile = (pid + n * programs).to(tl.int64)
            v = upcoming
            e = (tile + programs) * 512 + i
            # prefetch; masked past the end
            upcoming = tl.load(data_ptr + e, mask=e < numel, other=0)
            if WITH_DIGEST:
                # truncation: the low word
                w_low = v.to(tl.int32)
                w_high = (v >> 32).to(tl.int32)
                s = tl.sum(w_low * a_low + w_high * a_high)
                t = tl.sum((w_low >> 16) * b_low + (w_high >> 16) * b_high)
                low += tl.load(c_ptr + tile) * (s.to(tl.int64) & 0xFFFFFFFF)
                high += tl.load(ch_ptr + tile) * (t.to(tl.int64) & 0xFFFFFFFF)
            x = v.to(tl.float64, bitcast=True)
            alpha = tl.load(alpha_ptr + ((tile % 2) * 512 + i)[:, None] * KP + m[None, :]).to(tl.float64)
            beta = tl.load(beta_ptr + (tile // 2) * KP + m).to(tl.float64)
            sketch += tl.sum(x[:, None] * alpha, axis=0) * beta
            sq += x * x
            bits = v & 0x7FFFFFFFFFFFFFFF
            finite = bits < 0x7FF0000000000000
            max_bits = tl.maximum(max_bits, tl.where(finite, bits, 0))
            nan += (bits > 0x7FF0000000000000).to(tl.int32)
            inf += (bits == 0x7FF0000000000000).to(tl.int32)
        max_abs = tl.max(max_bits, axis=0).to(tl.float64, bitcast=True)
        _store(
            int_ptr,
            float_ptr,
            low,
            high,
            tl.sum(nan.to(tl.int64), axis=0),
            tl.sum(inf.to(tl.int64), axis=0),
            sketch,
            tl.sum(sq, axis=0),
            max_abs,
            KP,
        )

    @triton.jit
    def _finish(
        int_ptr,
        float_ptr,
        out_ptr,
        programs,
        rows_ptr,
        K: tl.constexpr,
        KP: tl.constexpr,
        ROWS: tl.constexpr,
        LIST: tl.constexpr,
    ):
        """One program: adds the ``programs`` rows of partials (in a fixed order) into the output
        vector. ``LIST``: program ``t`` does tensor ``t``, whose rows ``rows_ptr`` gives as
        ``[first, count]``, into row ``t`` of the output."""
        if LIST:
            t = tl.program_id(0).to(tl.int64)
            first = tl.load(rows_ptr + 2 * t)
            programs = tl.load(rows_ptr + 2 * t + 1)
            int_ptr += first * 4
            float_ptr += first * (KP + 2)
            out_ptr += t * (K + 5)
        r = tl.arange(0, ROWS)
        m = tl.arange(0, KP)
        low = tl.zeros((ROWS,), dtype=tl.int64)
        high = tl.zeros((ROWS,), dtype=tl.int64)
        nan = tl.zeros((ROWS,), dtype=tl.int64)
        inf = tl.zeros((ROWS,), dtype=tl.int64)
        sketch = tl.zeros((ROWS, KP), dtype=tl.float64)
        sq = tl.zeros((ROWS,), dtype=tl.float64)
        max_abs = tl.zeros((ROWS,), dtype=tl.float64)
        for start in range(0, programs, ROWS):
            rows = start + r
            valid = rows < programs
            # wrapping int64
            low += tl.load(int_ptr + rows * 4, mask=valid, other=0)
            high += tl.load(int_ptr + rows * 4 + 1, mask=valid, other=0)
            nan += tl.load(int_ptr + rows * 4 + 2, mask=valid, other=0)
            inf += tl.load(int_ptr + rows * 4 + 3, mask=valid, other=0)
            row = float_ptr + rows * (KP + 2)
            sketch += tl.load(row[:, None] + m[None, :], mask=valid[:, None], other=0.0)
            sq += tl.load(row + KP, mask=valid, other=0.0)
            # finite, >= 0
            max_abs = tl.maximum(max_abs, tl.load(row + KP + 1, mask=valid, other=0.0))
        nan_count = tl.sum(nan, axis=0)
        inf_count = tl.sum(inf, axis=0)
        nan_value = tl.full((), 0x7FF8000000000000, tl.int64).to(tl.float64, bitcast=True)
        inf_value = tl.full((), 0x7FF0000000000000, tl.int64).to(tl.float64, bitcast=True)
        worst = tl.where(nan_count > 0, nan_value, tl.where(inf_count > 0, inf_value, tl.max(max_abs, axis=0)))
        tl.store(out_ptr, tl.sum(low, axis=0).to(tl.float64, bitcast=True))
        tl.store(out_ptr + 1, tl.sum(high, axis=0).to(tl.float64, bitcast=True))
        tl.store(out_ptr + 2 + m, tl.sum(sketch, axis=0), mask=m < K)
        tl.store(out_ptr + 2 + K, tl.sum(sq, axis=0))
        tl.store(out_ptr + 3 + K, worst)
        tl.store(out_ptr + 4 + K, (nan_count + inf_count).to(tl.float64))
