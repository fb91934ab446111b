"""Numpy reference of the exact digest and the linear sketch: slow, short, obviously correct.

Tests compare the torch implementation against these functions bit for bit (digest) and within
rounding (sketch). They also serve code paths that must not import torch (checkpoint files read
with mmap, trace-only analysis). The definitions, as math, are in ``docs/fingerprints.md``.
"""

from __future__ import annotations

import numpy as np

from sdc_forensics.fingerprint import constants as C

_MASK32 = np.uint64(0xFFFF_FFFF)


def digest_bytes(data: bytes | np.ndarray, seed: int = C.DEFAULT_SEED) -> int:
    """Exact digest of a byte string (the tensor's raw bytes in row-major order).

    Args:
        data: the bytes, or a numpy array whose raw bytes (C order) are digested.
        seed: the fingerprint seed.

    Returns:
        The 64-bit digest as a Python int.
    """
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    num_bytes = raw.size
    num_words = -(-num_bytes // 4)
    num_blocks = -(-num_words // C.BLOCK_WORDS)
    padded = np.zeros(num_blocks * C.BLOCK_WORDS * 4, dtype=np.uint8)
    padded[:num_bytes] = raw
    signed = padded.view("<i4").reshape(num_blocks, C.BLOCK_WORDS)
    # (num_blocks, 1024) w_{j,i} as unsigned
    words = signed.view("<u4").astype(np.uint64)
    # (num_blocks, 1024) arithmetic shift: in [-2**15, 2**15)
    high = (signed >> 16).astype(np.int64)
    a = C.digest_word_weights(seed).view(np.uint32).astype(np.uint64)
    b = C.digest_high_weights(seed).view(np.uint32).astype(np.int64)
    # s_j = sum_i a_i * w_{j,i} mod 2**32 ;  t_j = sum_i b_i * (w_{j,i} >> 16) mod 2**32
    # (num_blocks,)
    low_sums = ((words * a) & _MASK32).sum(axis=1, dtype=np.uint64) & _MASK32
    high_sums = ((high * b) & 0xFFFF_FFFF).astype(np.uint64).sum(axis=1, dtype=np.uint64) & _MASK32
    c = C.digest_block_weights(num_blocks, seed).view(np.uint64)
    c_high = C.digest_block_weights(num_blocks, seed, high=True).view(np.uint64)
    with np.errstate(over="ignore"):
        low = (low_sums * c).sum(dtype=np.uint64)
        high_total = (high_sums * c_high).sum(dtype=np.uint64)
    total = (int(low) + (int(high_total) << 32) + num_bytes * C.digest_length_weight(seed)) % (1 << 64)
    return C.fmix64(total)


def sketch(values: np.ndarray, k: int = C.DEFAULT_SKETCH_K, seed: int = C.DEFAULT_SEED) -> np.ndarray:
    """Linear sketch ``S_m(x) = sum_e alpha_m[e mod B] * beta_m[e div B] * x_e`` in float64."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    num_blocks = max(1, -(-x.size // C.BLOCK_ELEMS))
    padded = np.zeros(num_blocks * C.BLOCK_ELEMS, dtype=np.float64)
    padded[: x.size] = x
    per_block = padded.reshape(num_blocks, C.BLOCK_ELEMS) @ C.sketch_in_block_signs(k, seed).astype(np.float64)
    return (per_block * C.sketch_block_signs(num_blocks, k, seed)).sum(axis=0)


def sketch_stats_in_kernel_order(
    values: np.ndarray, k: int = C.DEFAULT_SKETCH_K, seed: int = C.DEFAULT_SEED, block_offset: int = 0
) -> tuple[np.ndarray, float, float, int]:
    """``(sketch, sumsq, max_abs, nonfinite)`` with every rounding in the compiled CPU kernel's order.

    The order (``cpu_kernel``'s docstring states it in words): ``values`` (float32, or 16-bit
    values widened to float32, or float64) in rows of ``BLOCK_ELEMS``, zero-padded to whole tiles
    of 8 rows; row pair after row pair, ``y += beta[r] * (x_r +- x_{r+1})`` (the sign making it
    ``beta[r] x_r + beta[r+1] x_{r+1}``) and row after row ``q += x * x``, in the input's precision,
    added into float64 every 1,024 rows and at the end; the lanes are then summed in order.
    """
    acc = np.float64 if values.dtype == np.float64 else np.float32
    x = np.asarray(values, dtype=acc).reshape(-1)
    rows = max(1, -(-x.size // C.BLOCK_ELEMS))
    # cpu_kernel.TILE_ROWS
    rows = -(-rows // 8) * 8
    padded = np.zeros(rows * C.BLOCK_ELEMS, dtype=acc)
    padded[: x.size] = x
    table = padded.reshape(rows, C.BLOCK_ELEMS)
    beta = C.sketch_block_signs(block_offset + rows, k, seed)[block_offset:].astype(acc)
    y, q = np.zeros((k, C.BLOCK_ELEMS), dtype=acc), np.zeros(C.BLOCK_ELEMS, dtype=acc)
    y64, q64 = np.zeros((k, C.BLOCK_ELEMS)), np.zeros(C.BLOCK_ELEMS)
    # Inf and NaN inputs propagate, as in the kernel
    with np.errstate(over="ignore", invalid="ignore"):
        return _kernel_order_sums(table, beta, y, q, y64, q64, x, k, seed)


def _kernel_order_sums(table, beta, y, q, y64, q64, x, k, seed):
    rows = table.shape[0]
    for row in range(rows):
        # rows in pairs: s0 x0 + s1 x1 = s0 (x0 + s0 s1 x1), the pair rounded once
        if row % 2 == 0:
            # (k,)
            same = beta[row] == beta[row + 1]
            pair = np.where(same[:, None], table[row] + table[row + 1], table[row] - table[row + 1])
            # the product is exact (+-1): one rounding
            y += beta[row][:, None] * pair
        q += table[row] * table[row]
        if (row + 1) % 1024 == 0 or row + 1 == rows:
            y64 += y
            q64 += q
            y[:], q[:] = 0, 0
    alpha = C.sketch_in_block_signs(k, seed).astype(np.float64)

    # 0.0 + t_0 + t_1 + ... left to right
    def in_order(terms: np.ndarray) -> float:
        return float(np.cumsum(np.concatenate([[0.0], terms]))[-1])

    sketch = np.array([in_order(alpha[:, m] * y64[m]) for m in range(k)])
    finite = np.isfinite(x)
    nonfinite = int(x.size - finite.sum())
    max_abs = float(np.abs(x[~np.isnan(x)]).max()) if (~np.isnan(x)).any() else 0.0
    if nonfinite:
        max_abs = float("nan") if np.isnan(x).any() else float("inf")
    return sketch, in_order(q64), max_abs, nonfinite
