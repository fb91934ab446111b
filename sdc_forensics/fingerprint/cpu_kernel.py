"""The one-pass CPU fingerprint: digest, sketch and stats from one read of the tensor.

The loops live in ``_numba_fingerprint`` and are compiled by numba for the host CPU on first use
(a few seconds, once per machine: numba caches them on disk, see ``docs/fingerprints.md``);
:func:`available` says whether they can run here and why not, and the caller falls back to the
torch path in ``core``. Results:

* the digest's two lane totals are **bit-identical** to :func:`reference.digest_bytes`;
* the sketch, sum of squares, max |x| and NaN/Inf count are **bit-identical** to
  :func:`reference.sketch_stats_in_kernel_order`, the numpy statement of the kernel's
  accumulation order, on every x86 CPU: IEEE operations in a fixed order, and the one fused
  multiply-add, ``y + s * x`` with ``s = +-1``, has an exact product so it rounds as the two steps.

Accumulation order (float32, bfloat16 and float16 accumulate in float32, float64 in float64):
rows of ``BLOCK_ELEMS`` elements (the last zero-padded), tiles of ``TILE_ROWS`` rows (the last
padded with zero rows), groups of ``GROUP_ROWS`` rows. Lane by lane, ``Y[m, i] += beta_m[row] * x``
and ``q[i] += x * x`` row after row; the single-precision accumulators are added into float64 ones
at the end of each group (so no single-precision sum has more than ``GROUP_ROWS`` terms, as the
tolerance model assumes). Then ``S_m = sum_i alpha_m[i] * Y64[m, i]`` and ``sum_i q64[i]`` in
order. A tile is worked through in strips of ``STRIP`` lanes (``_numba_fingerprint``): each
strip's words are digested, paired, squared and projected while they sit in L1, so the tensor is
read from memory once and each lane still sees the operations above in the order stated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import numpy as np

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint.tables import TableCache

TILE_ROWS = 8
GROUP_ROWS = 1024
#: Environment switch: ``off`` turns the compiled kernels off (the numpy/torch paths run instead).
KERNELS_ENV = "SDC_FORENSICS_KERNELS"
_TILE_ELEMS = TILE_ROWS * C.BLOCK_ELEMS
_BLOCK_BYTES = 4 * C.BLOCK_WORDS
_tables = TableCache()


def kernels_disabled() -> bool:
    """Whether the user turned the compiled kernels off (``SDC_FORENSICS_KERNELS=off``)."""
    return os.environ.get(KERNELS_ENV, "").strip().lower() in {"off", "0", "false", "no"}


@functools.lru_cache(maxsize=1)
def _loops():
    """The compiled module, or the reason it cannot be had (imported once per process)."""
    try:
        from sdc_forensics.fingerprint import _numba_fingerprint
    except Exception as exc:  # noqa: BLE001 - numba missing or broken: the fallback runs
        return None, f"numba is not importable ({type(exc).__name__}: {exc})"
    return _numba_fingerprint, ""


def _compiled():
    """The compiled module (raises ``RuntimeError`` with the reason where it cannot be had)."""
    module, reason = _loops()
    if module is None:
        raise RuntimeError(reason)
    return module


# set once when a compiled call failed: this process uses the fallback from then on
_failure: list[str] = []


def disable(reason: str) -> None:
    """Stop using the compiled kernel in this process (a call failed: a broken cache, say)."""
    if not _failure:
        _failure.append(reason)


def available() -> tuple[bool, str]:
    """``(usable, reason)``: whether the compiled CPU kernel can run here, and why not."""
    if kernels_disabled():
        return False, f"turned off by {KERNELS_ENV}={os.environ.get(KERNELS_ENV)}"
    if _failure:
        return False, _failure[0]
    module, reason = _loops()
    return module is not None, reason


#: dtypes the kernel reads: numpy dtype of the values it is handed, and whether they are 16-bit bits.
_DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": np.uint16, "float16": np.uint16}


def supports(dtype_name: str) -> bool:
    """Whether the kernel handles this dtype (a torch dtype's name without ``torch.``)."""
    return dtype_name in _DTYPES


def _prefix(key: tuple, length: int, make) -> np.ndarray:
    return _tables.prefix(key, length, make)


def _block_weights(length: int, seed: int, high: bool) -> np.ndarray:
    return _prefix(("c", seed, high), length, lambda n: C.digest_block_weights(n, seed, high=high).view(np.uint64))


def _beta(length: int, k: int, seed: int, dtype) -> np.ndarray:
    return _prefix(
        ("beta", k, seed, np.dtype(dtype).str), length, lambda n: C.sketch_block_signs(n, k, seed).astype(dtype)
    )


@functools.lru_cache(maxsize=8)
def _word_weights(seed: int) -> tuple[np.ndarray, np.ndarray]:
    # int32
    return C.digest_word_weights(seed), C.digest_high_weights(seed)


@dataclasses.dataclass
class Partials:
    """What one kernel call computed, on the host."""

    # the digest's lane totals, each mod 2**64
    lanes: tuple[int, int]
    # (k,) float64
    sketch: np.ndarray
    sumsq: float
    max_abs: float
    nonfinite: int


def _digest_words(module, raw: np.ndarray, seed: int, lanes: np.ndarray) -> None:
    """Lane totals of ``raw`` (uint8, C order) added into ``lanes``."""
    a, b = _word_weights(seed)
    num_blocks = -(-raw.size // _BLOCK_BYTES)
    c, c2 = _block_weights(max(num_blocks, 1), seed, False), _block_weights(max(num_blocks, 1), seed, True)
    full = raw.size // _BLOCK_BYTES
    if full:
        words = raw[: full * _BLOCK_BYTES].view(np.int32)
        module._digest_until(words, 0, full, a, b, c, c2, lanes)
    if raw.size > full * _BLOCK_BYTES:
        tail = np.zeros(_BLOCK_BYTES, dtype=np.uint8)
        tail[: raw.size - full * _BLOCK_BYTES] = raw[full * _BLOCK_BYTES :]
        module._digest_until(tail.view(np.int32), 0, 1, a, b, c[full:], c2[full:], lanes)


def digest_lanes(raw: np.ndarray, seed: int = C.DEFAULT_SEED) -> tuple[int, int]:
    """The digest's lane totals of any bytes (``uint8`` array), with the compiled loop.

    Raises:
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    module = _compiled()
    lanes = np.zeros(2, dtype=np.uint64)
    _digest_words(module, np.ascontiguousarray(raw).reshape(-1).view(np.uint8), seed, lanes)
    return int(lanes[0]), int(lanes[1])


def digest_lanes_many(addresses: np.ndarray, nbytes: np.ndarray, seed: int = C.DEFAULT_SEED) -> np.ndarray:
    """:func:`digest_lanes` of ``T`` byte runs in one compiled call: ``(T, 2)`` uint64 lane totals.

    Args:
        addresses: ``(T,)`` int64, each 4-byte aligned, of memory that stays alive for the call.
        nbytes: ``(T,)`` int64 byte counts.

    Raises:
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    module = _compiled()
    a, b = _word_weights(seed)
    most = max(1, int(-(-nbytes.max() // _BLOCK_BYTES))) if nbytes.size else 1
    c, c2 = _block_weights(most, seed, False), _block_weights(most, seed, True)
    return module.digest_many(addresses, nbytes, a, b, c, c2)


def partials(
    values: np.ndarray,
    dtype_name: str,
    *,
    k: int,
    seed: int,
    block_offset: int,
    with_digest: bool,
    digest_block_offset: int = 0,
) -> Partials:
    """Digest lanes, sketch and stats of a flat tensor's values, in one pass.

    Args:
        values: 1-D, C-contiguous: float32 / float64 values, or the uint16 bits of a bfloat16 /
            float16 tensor (``tensor.view(torch.int16).numpy().view(np.uint16)``).
        dtype_name: ``float32``, ``float64``, ``bfloat16`` or ``float16``.
        k, seed, block_offset, with_digest, digest_block_offset: as
            :func:`sdc_forensics.fingerprint.core.fingerprint`.

    Raises:
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    module = _compiled()
    # a 16-bit view at an odd offset: words must be aligned
    if values.ctypes.data % max(4, values.itemsize):
        values = values.copy()
    n = values.size
    widened = values.dtype == np.uint16
    acc = np.float64 if values.dtype == np.float64 else np.float32
    element = values.dtype.itemsize
    num_rows = max(1, -(-n // C.BLOCK_ELEMS))
    beta = _beta(block_offset + num_rows + TILE_ROWS, k, seed, acc)[block_offset:]
    a, b = _word_weights(seed)
    num_blocks = -(-n * element // _BLOCK_BYTES) if with_digest else 0
    c = _block_weights(digest_block_offset + max(num_blocks, 1), seed, False)[digest_block_offset:]
    c2 = _block_weights(digest_block_offset + max(num_blocks, 1), seed, True)[digest_block_offset:]
    y = np.zeros((k, C.BLOCK_ELEMS), dtype=acc)
    y64 = np.zeros((k, C.BLOCK_ELEMS))
    q = np.zeros(C.BLOCK_ELEMS, dtype=acc)
    q64 = np.zeros(C.BLOCK_ELEMS)
    mx = np.zeros(C.BLOCK_ELEMS, dtype=acc)
    lanes = np.zeros(2, dtype=np.uint64)
    tile = np.empty((TILE_ROWS, C.BLOCK_ELEMS), dtype=np.float32)
    pairs = np.empty((TILE_ROWS, C.BLOCK_ELEMS), dtype=acc)
    per_tile = _TILE_ELEMS * element // _BLOCK_BYTES

    def call(part: np.ndarray, blocks: int, row_base: int, first_block: int, live: int) -> None:
        words = part.reshape(-1).view(np.int32)
        args = (words, blocks, per_tile, row_base, a, b, c[first_block:], c2[first_block:], beta[row_base:])
        if widened:
            module.run_widened(part, dtype_name == "float16", *args, tile, y, y64, q, q64, mx, lanes, pairs, live)
        else:
            module.run_direct(part, *args, y, y64, q, q64, mx, lanes, pairs, live)

    main_rows = n // _TILE_ELEMS * TILE_ROWS
    main_blocks = main_rows * C.BLOCK_ELEMS * element // _BLOCK_BYTES
    if main_rows:
        main = values[: main_rows * C.BLOCK_ELEMS].reshape(main_rows, C.BLOCK_ELEMS)
        call(main, min(main_blocks, num_blocks), 0, 0, main.size)
    rest = n - main_rows * C.BLOCK_ELEMS
    if rest:
        padded = np.zeros(_TILE_ELEMS, dtype=values.dtype)
        padded[:rest] = values[main_rows * C.BLOCK_ELEMS :]
        rest_blocks = max(0, num_blocks - main_blocks)
        call(padded.reshape(TILE_ROWS, C.BLOCK_ELEMS), rest_blocks, main_rows, main_blocks if rest_blocks else 0, rest)
    sketch, sumsq = module.finish(y, y64, q, q64, _alpha(k, seed))
    nonfinite, max_abs = _checked(values, dtype_name, float(sumsq), float(mx.max()))
    return Partials(
        lanes=(int(lanes[0]), int(lanes[1])), sketch=sketch, sumsq=float(sumsq), max_abs=max_abs, nonfinite=nonfinite
    )


def _checked(values: np.ndarray, dtype_name: str, sumsq: float, max_abs: float) -> tuple[int, float]:
    """``(NaN/Inf count, max |x|)`` of ``values``, whose sums came out ``sumsq`` and ``max_abs``:
    counted only where those are not finite (NaN/Inf present, or ``x * x`` overflowed); ``max |x|``
    is then NaN where a NaN is present, else inf where an Inf is."""
    if math.isfinite(sumsq) and math.isfinite(max_abs):
        return 0, max_abs
    nonfinite = _count_nonfinite(values, dtype_name)
    if nonfinite:
        max_abs = math.nan if _has_nan(values, dtype_name) else math.inf
    return nonfinite, max_abs


_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2, "float64": 3}


def partials_many(
    arrays: list[np.ndarray],
    dtype_name: str,
    *,
    k: int,
    seed: int,
    block_offsets: list[int],
    with_digest: bool,
    digest_block_offsets: list[int],
) -> list[Partials]:
    """:func:`partials` of several flat arrays of one dtype in one compiled call: the same numbers
    as one call per array (the same loops in the same order, run from the kernel over the arrays'
    addresses), without the tens of microseconds of Python each call costs.

    Args:
        arrays: 1-D, C-contiguous, each as :func:`partials` takes it and aligned to 4 bytes
            (a 16-bit view at an odd element offset goes through :func:`partials`).
        block_offsets, digest_block_offsets: per array, as :func:`partials`'.

    Raises:
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    if not arrays:
        return []
    sizes = np.array([a.size for a in arrays], dtype=np.int64)
    offsets = np.array(block_offsets, dtype=np.int64)
    digest_offsets = np.array(digest_block_offsets, dtype=np.int64)
    addresses = np.array([a_.ctypes.data for a_ in arrays], dtype=np.int64)
    lanes, sketch, sumsq, max_abs = many_at(
        addresses, sizes, dtype_name, k=k, seed=seed, block_offsets=offsets, digest_block_offsets=digest_offsets,
        with_digest=with_digest,
    )  # fmt: skip
    out = []
    for index, values in enumerate(arrays):
        total = float(sumsq[index])
        nonfinite, largest = _checked(values, dtype_name, total, float(max_abs[index]))
        out.append(
            Partials(
                lanes=(int(lanes[index, 0]), int(lanes[index, 1])),
                sketch=sketch[index],
                sumsq=total,
                max_abs=largest,
                nonfinite=nonfinite,
            )
        )
    return out


def chunk_rows(values: np.ndarray, parts: int, dtype_name: str, *, k: int, seed: int) -> np.ndarray:
    """The sketch numbers of ``values``' ``parts`` equal chunks in one compiled call, as an array:
    row ``r`` is ``[sketch (k), norm, NaN/Inf count]`` of chunk ``r`` (no digest), the numbers
    :func:`partials_many` gives for the chunks as separate arrays, bit for bit, with no Python
    object per chunk (a reduce-scatter's input has as many chunks as its group has ranks).

    Args:
        values: 1-D, C-contiguous, ``parts`` dividing its size; 4-byte aligned, and for 16-bit
            words an even chunk length (every chunk's address aligned to 4 bytes).

    Raises:
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    n = values.size // parts
    addresses = values.ctypes.data + np.arange(parts, dtype=np.int64) * (n * values.itemsize)
    zeros = np.zeros(parts, dtype=np.int64)
    _, sketch, sumsq, max_abs = many_at(
        addresses, np.full(parts, n, dtype=np.int64), dtype_name, k=k, seed=seed, block_offsets=zeros,
        digest_block_offsets=zeros, with_digest=False,
    )  # fmt: skip
    rows = np.empty((parts, k + 2))
    rows[:, :k] = sketch
    rows[:, k] = np.sqrt(sumsq)
    rows[:, k + 1] = 0.0
    # only the chunks whose sums are not finite can hold NaN/Inf (_checked's rule)
    for r in np.flatnonzero(~(np.isfinite(sumsq) & np.isfinite(max_abs))).tolist():
        rows[r, k + 1] = _checked(values[r * n : (r + 1) * n], dtype_name, float(sumsq[r]), float(max_abs[r]))[0]
    return rows


def end_numbers(
    words: np.ndarray,
    floats: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    first_rows: np.ndarray,
    *,
    k: int,
    seed: int,
):
    """A sharded piece's cut ends in one compiled call (``shards._batched_ends``): ``(s, t, sketch,
    sumsq, max_abs, nonfinite)``, see ``_numba_fingerprint.ends``.

    Raises:
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    module = _compiled()
    a, b = _word_weights(seed)
    rows = floats.shape[1] // C.BLOCK_ELEMS
    beta = _beta(int(first_rows.max()) + rows + 1 if first_rows.size else 1, k, seed, np.float32)
    return module.ends(words, floats, positions, lengths, first_rows, a, b, beta, _alpha(k, seed))


def many_at(
    addresses: np.ndarray,
    sizes: np.ndarray,
    dtype_name: str,
    *,
    k: int,
    seed: int,
    block_offsets: np.ndarray,
    digest_block_offsets: np.ndarray,
    with_digest: bool,
):
    """The loop under :func:`partials_many`, on tensors given by address: ``(lanes (T, 2) uint64,
    sketch (T, k), sumsq (T,), max_abs (T,))``, NaN/Inf not counted (a non-finite sumsq or max
    says one is there). Each address must be aligned to 4 bytes and stay alive for the call.

    Raises:
        RuntimeError: the kernel is not available (check :func:`available` first).
    """
    module = _compiled()
    element = 8 if dtype_name == "float64" else 4 if dtype_name == "float32" else 2
    acc = np.float64 if dtype_name == "float64" else np.float32
    rows = -(-np.maximum(sizes, 1) // C.BLOCK_ELEMS)
    blocks = -(-sizes * element // _BLOCK_BYTES)
    beta = _beta(int((block_offsets + rows).max()) + TILE_ROWS, k, seed, acc)
    weights = int((digest_block_offsets + np.maximum(blocks, 1)).max())
    a, b = _word_weights(seed)
    c, c2 = _block_weights(weights, seed, False), _block_weights(weights, seed, True)
    return module._many(
        _KINDS[dtype_name], addresses, sizes, block_offsets, digest_block_offsets, with_digest, a, b, c, c2, beta,
        _alpha(k, seed),
    )  # fmt: skip


class RunsTotal:
    """``shards.fingerprint_runs`` added over several compiled calls (a rank's whole local gradient
    arrives one reduce-scatter at a time): the bodies' lane totals, every cut end's block sums,
    the sketch and sums added in call order."""

    def __init__(self, k: int, seed: int) -> None:
        self.k, self.seed = k, seed
        self.sketch = np.zeros(k)
        # [sum of squares, max |x|]
        self.sums = np.zeros(2)
        self.low = self.high = 0
        self.ends: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.numel = self.num_bytes = 0

    def add(
        self, addresses: np.ndarray, sizes: np.ndarray, offsets: np.ndarray, dtype_name: str, *, align: int
    ) -> bool:
        """Add float32 or bfloat16 runs; False (nothing added) where one holds a NaN/Inf.

        Raises:
            RuntimeError: the kernel is not available (check :func:`available` first).
        """
        module = _compiled()
        itemsize = 4 if dtype_name == "float32" else 2
        stop = int((offsets + sizes).max()) + 2 * align
        a, b = _word_weights(self.seed)
        c, c2 = self._weights(stop * itemsize)
        beta = _beta(-(-stop // C.BLOCK_ELEMS) + TILE_ROWS, self.k, self.seed, np.float32)
        sketch, sums = self.sketch.copy(), self.sums.copy()
        low, high, blocks, s, t, finite = module.runs(
            0 if dtype_name == "float32" else 1, addresses, sizes, offsets, align, a, b, c, c2, beta,
            _alpha(self.k, self.seed), sketch, sums,
        )  # fmt: skip
        if not finite:
            return False
        self.sketch, self.sums = sketch, sums
        self.low, self.high = (self.low + int(low)) % (1 << 64), (self.high + int(high)) % (1 << 64)
        self.ends.append((blocks.copy(), s.copy(), t.copy()))
        self.numel += int(sizes.sum())
        self.num_bytes += int(sizes.sum()) * itemsize
        return True

    def _weights(self, num_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        blocks = -(-num_bytes // _BLOCK_BYTES) + 1
        return _block_weights(blocks, self.seed, False), _block_weights(blocks, self.seed, True)

    def lanes(self) -> tuple[int, int]:
        """The lane totals with every cut block entered once."""
        module, _ = _loops()
        if not self.ends:
            return self.low, self.high
        blocks, s, t = (np.concatenate(parts) for parts in zip(*self.ends))
        c, c2 = self._weights((int(blocks.max()) + 1) * _BLOCK_BYTES)
        low, high = module.weigh_ends(blocks, s, t, c, c2)
        return (self.low + int(low)) % (1 << 64), (self.high + int(high)) % (1 << 64)


def warm_up(dtype_names=("float32", "bfloat16", "float64")) -> bool:
    """Compile (or load from numba's cache) the loops for these dtypes on numpy zeros: no torch
    operator runs, so a fork server may call this before it forks (``demo/_preload.py``).
    ``False`` where the kernel is not available."""
    if not available()[0]:
        return False
    for name in dtype_names:
        dtype = np.uint16 if name in ("bfloat16", "float16") else np.dtype(name)
        partials(
            np.zeros(C.BLOCK_ELEMS + 1, dtype=dtype),
            name,
            k=C.DEFAULT_SKETCH_K,
            seed=C.DEFAULT_SEED,
            block_offset=0,
            with_digest=True,
        )
        partials_many(
            [np.zeros(C.BLOCK_ELEMS + 1, dtype=dtype)],
            name,
            k=C.DEFAULT_SKETCH_K,
            seed=C.DEFAULT_SEED,
            block_offsets=[0],
            with_digest=True,
            digest_block_offsets=[0],
        )
    digest_lanes(np.zeros(8, dtype=np.uint8))
    for name in ("float32", "bfloat16"):
        run = np.zeros(3 * C.BLOCK_ELEMS, dtype=np.float32 if name == "float32" else np.uint16)
        total = RunsTotal(C.DEFAULT_SKETCH_K, C.DEFAULT_SEED)
        total.add(
            np.array([run.ctypes.data], dtype=np.int64),
            np.array([run.size - 10], dtype=np.int64),
            np.array([5], dtype=np.int64),
            name,
            align=C.BLOCK_ELEMS if name == "float32" else 2 * C.BLOCK_ELEMS,
        )
        total.lanes()
    words = np.zeros(C.BLOCK_WORDS + 1, dtype=np.int32)
    digest_lanes_many(np.array([words.ctypes.data], dtype=np.int64), np.array([words.nbytes], dtype=np.int64))
    end_numbers(
        np.zeros((1, C.BLOCK_WORDS), dtype=np.int32),
        np.zeros((1, C.BLOCK_ELEMS)),
        np.zeros(1, dtype=np.int64),
        np.ones(1, dtype=np.int64),
        np.zeros(1, dtype=np.int64),
        k=C.DEFAULT_SKETCH_K,
        seed=C.DEFAULT_SEED,
    )
    return True


@functools.lru_cache(maxsize=16)
def _alpha(k: int, seed: int) -> np.ndarray:
    return C.sketch_in_block_signs(k, seed).astype(np.float64)


def _count_nonfinite(values: np.ndarray, dtype_name: str) -> int:
    if dtype_name == "bfloat16":
        return int(((values & 0x7F80) == 0x7F80).sum())
    if dtype_name == "float16":
        return int(((values & 0x7C00) == 0x7C00).sum())
    return int(values.size - np.isfinite(values).sum())


def _has_nan(values: np.ndarray, dtype_name: str) -> bool:
    if dtype_name == "bfloat16":
        return bool(((values & 0x7FFF) > 0x7F80).any())
    if dtype_name == "float16":
        return bool(((values & 0x7FFF) > 0x7C00).any())
    return bool(np.isnan(values).any())
