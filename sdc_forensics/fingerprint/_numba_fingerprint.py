"""The compiled loops of the one-pass CPU fingerprint (imported only when numba is; see ``cpu_kernel``).

Every function is compiled for the host CPU on first use and cached on disk by numba
(``cache=True``). The order of every floating-point operation here is the one that
``reference.sketch_stats_in_kernel_order`` states in numpy; change one, change both.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic

# constants.BLOCK_WORDS: numba freezes module globals at compile time
BLOCK_WORDS = 1024
# constants.BLOCK_ELEMS
BLOCK_ELEMS = 1024
TILE_ROWS = 8
GROUP_ROWS = 1024

_jit = {"cache": True, "nogil": True, "boundscheck": False, "error_model": "numpy"}


@nb.njit(**_jit)
def _pairs(x, pairs):
    """``pairs[2p] = x[2p] + x[2p+1]`` and ``pairs[2p+1] = x[2p] - x[2p+1]`` for the tile's row pairs."""
    for p in range(TILE_ROWS // 2):
        first, second = x[2 * p], x[2 * p + 1]
        plus, minus = pairs[2 * p], pairs[2 * p + 1]
        for i in range(BLOCK_ELEMS):
            plus[i] = first[i] + second[i]
            minus[i] = first[i] - second[i]


# y + g * c with g = +-1: exact product, so an FMA rounds alike
@nb.njit(fastmath={"contract"}, **_jit)
def _sketch_tile(x, signs, y, pairs):
    """``y[m] += sum_r signs[r, m] * x[r]`` for one tile, as four pair terms added in order.

    ``s0 x0 + s1 x1 = s0 (x0 + s0 s1 x1)``: each pair of rows is added (or subtracted) once,
    rounded, and the result goes into ``y[m]`` with the sign of the pair's first row; 4 additions
    per projection and tile instead of 8.
    """
    _pairs(x, pairs)
    for m in range(y.shape[0]):
        g0, g1, g2, g3 = signs[0, m], signs[2, m], signs[4, m], signs[6, m]
        c0 = pairs[0] if signs[1, m] == g0 else pairs[1]
        c1 = pairs[2] if signs[3, m] == g1 else pairs[3]
        c2 = pairs[4] if signs[5, m] == g2 else pairs[5]
        c3 = pairs[6] if signs[7, m] == g3 else pairs[7]
        ym = y[m]
        for i in range(BLOCK_ELEMS):
            acc = ym[i] + g0 * c0[i]
            acc = acc + g1 * c1[i]
            acc = acc + g2 * c2[i]
            ym[i] = acc + g3 * c3[i]


@nb.njit(**_jit)
def _stats_tile(x, q, mx):
    """Lane by lane, row after row: ``q += v * v`` (rounded product, then sum) and max |v| (NaN skipped).

    NaN and Inf are not counted here: either makes ``q`` non-finite, and the caller counts them
    then (a second pass only over a tensor that holds one). The eight rows are written out so
    that ``q`` and ``mx`` are loaded and stored once per tile (the same order of additions).
    """
    for i in range(BLOCK_ELEMS):
        v0, v1, v2, v3 = x[0, i], x[1, i], x[2, i], x[3, i]
        v4, v5, v6, v7 = x[4, i], x[5, i], x[6, i], x[7, i]
        q[i] = q[i] + v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3 + v4 * v4 + v5 * v5 + v6 * v6 + v7 * v7
        m = mx[i]
        for a in (abs(v0), abs(v1), abs(v2), abs(v3), abs(v4), abs(v5), abs(v6), abs(v7)):
            m = a if a > m else m
        mx[i] = m


@nb.njit(**_jit)
def _flush(y, y64, q, q64):
    for m in range(y.shape[0]):
        for i in range(BLOCK_ELEMS):
            y64[m, i] += np.float64(y[m, i])
            y[m, i] = 0
    for i in range(BLOCK_ELEMS):
        q64[i] += np.float64(q[i])
        q[i] = 0


@nb.njit(**_jit)
def _widen_bf16(src, r0, out):
    """Rows ``r0..r0+TILE_ROWS`` of bfloat16 bits ``src`` as float32 in ``out`` (exact)."""
    bits = out.view(np.uint32)
    for r in range(TILE_ROWS):
        row = src[r0 + r]
        dst = bits[r]
        for i in range(BLOCK_ELEMS):
            dst[i] = np.uint32(row[i]) << np.uint32(16)


@nb.njit(**_jit)
def _widen_f16(src, r0, out):
    """Rows ``r0..r0+TILE_ROWS`` of float16 bits ``src`` as float32 in ``out`` (exact, subnormals too)."""
    bits = out.view(np.uint32)
    magic = np.float32(2.0**-14)
    for r in range(TILE_ROWS):
        row = src[r0 + r]
        dst = bits[r]
        for i in range(BLOCK_ELEMS):
            h = np.uint32(row[i])
            e = h & np.uint32(0x7C00)
            u = ((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(112 << 23)
            # Inf/NaN: exponent 255
            u = u + np.uint32(112 << 23) if e == np.uint32(0x7C00) else u
            # zero/subnormal: 2^-14 (1 + m / 1024)
            u = u + np.uint32(1 << 23) if e == np.uint32(0) else u
            dst[i] = u
        values = out[r]
        for i in range(BLOCK_ELEMS):
            if row[i] & np.uint16(0x7C00) == np.uint16(0):
                # = m * 2^-24, exact
                values[i] = values[i] - magic
        for i in range(BLOCK_ELEMS):
            dst[i] |= (np.uint32(row[i]) & np.uint32(0x8000)) << np.uint32(16)


@nb.njit(**_jit)
def _digest_until(words, blocks_done, last_block, a, b, c, c2, lanes):
    """Blocks ``[blocks_done, last_block)`` of ``int32`` words into the lane totals; returns the next block.

    Per block ``j``: ``s_j = sum_i a_i w_i`` and ``t_j = sum_i b_i (w_i >> 16)`` mod 2**32 (the
    shift arithmetic), then ``lanes += (c_j s_j, c'_j t_j)`` mod 2**64. (Written inline: as a
    separate function, or indexing ``words[j * 1024 + i]`` from ``range(first, last)``, LLVM's
    vectorised loop ran 5-6x slower; a row view from a loop starting at 0 runs at memory speed.)
    """
    low = lanes[0]
    high = lanes[1]
    for jj in range(last_block - blocks_done):
        j = blocks_done + jj
        row = words[j * BLOCK_WORDS : (j + 1) * BLOCK_WORDS]
        s = np.int32(0)
        t = np.int32(0)
        for i in range(BLOCK_WORDS):
            w = row[i]
            s = np.int32(s + np.int32(w * a[i]))
            t = np.int32(t + np.int32((w >> np.int32(16)) * b[i]))
        low += np.uint64(np.uint32(s)) * c[j]
        high += np.uint64(np.uint32(t)) * c2[j]
    lanes[0] = low
    lanes[1] = high
    return max(blocks_done, last_block)


@nb.njit(**_jit)
def _after_tile(row, y, y64, q, q64):
    if (row + TILE_ROWS) % GROUP_ROWS == 0:
        _flush(y, y64, q, q64)


@nb.njit(**_jit)
def run_direct(
    values, words, num_blocks, blocks_per_tile, row_base, a, b, c, c2, beta, y, y64, q, q64, mx, lanes, pairs
):
    """Digest, sketch and stats of float32 or float64 ``values`` (whole tiles), into the state arrays.

    Args:
        values: ``(rows, BLOCK_ELEMS)``, ``rows`` a multiple of ``TILE_ROWS``.
        words: the same bytes as ``uint32``, whole digest blocks; ``num_blocks`` of them are digested.
        blocks_per_tile: digest blocks per tile of rows.
        row_base: the global row of ``values[0]`` (group flushes are global).
        c, c2: block weights from this call's first block; ``beta``: signs from its first row.
        y, y64, q, q64, mx: accumulators; ``lanes``: ``(2,)`` uint64 lane totals.
    """
    done = 0
    for r0 in range(0, values.shape[0], TILE_ROWS):
        done = _digest_until(words, done, min(num_blocks, (r0 // TILE_ROWS + 1) * blocks_per_tile), a, b, c, c2, lanes)
        x = values[r0 : r0 + TILE_ROWS]
        _sketch_tile(x, beta[r0 : r0 + TILE_ROWS], y, pairs)
        _stats_tile(x, q, mx)
        _after_tile(row_base + r0, y, y64, q, q64)
    _digest_until(words, done, num_blocks, a, b, c, c2, lanes)


@nb.njit(**_jit)
def run_widened(
    values,
    is_f16,
    words,
    num_blocks,
    blocks_per_tile,
    row_base,
    a,
    b,
    c,
    c2,
    beta,
    tile,
    y,
    y64,
    q,
    q64,
    mx,
    lanes,
    pairs,
):
    """:func:`run_direct` for 16-bit ``values`` (uint16 bits), widened tile by tile into float32 ``tile``."""
    done = 0
    for r0 in range(0, values.shape[0], TILE_ROWS):
        done = _digest_until(words, done, min(num_blocks, (r0 // TILE_ROWS + 1) * blocks_per_tile), a, b, c, c2, lanes)
        if is_f16:
            _widen_f16(values, r0, tile)
        else:
            _widen_bf16(values, r0, tile)
        _sketch_tile(tile, beta[r0 : r0 + TILE_ROWS], y, pairs)
        _stats_tile(tile, q, mx)
        _after_tile(row_base + r0, y, y64, q, q64)
    _digest_until(words, done, num_blocks, a, b, c, c2, lanes)


@nb.njit(**_jit)
def finish(y, y64, q, q64, alpha):
    """``(sketch, sumsq)`` after the last flush: sums over lanes in order, in float64."""
    _flush(y, y64, q, q64)
    k = y.shape[0]
    sketch = np.zeros(k)
    for m in range(k):
        acc = 0.0
        for i in range(BLOCK_ELEMS):
            acc += alpha[i, m] * y64[m, i]
        sketch[m] = acc
    total = 0.0
    for i in range(BLOCK_ELEMS):
        total += q64[i]
    return sketch, total


# ---------------------------------------------------------------- many tensors in one call
# A list of tensors is handed over as their addresses and sizes (a numba typed list of arrays
# costs microseconds per element to build); each is read through a C array made on its address.


def _pointer_to(item_type):
    """An intrinsic turning an int64 address into a ``CPointer(item_type)`` (for ``nb.carray``)."""

    @intrinsic
    def at(typingctx, address):
        sig = types.CPointer(item_type)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(item_type)))

        return sig, codegen

    return at


_f32_at = _pointer_to(types.float32)
_f64_at = _pointer_to(types.float64)
_u16_at = _pointer_to(types.uint16)


@nb.njit(**_jit)
def _reset(y, y64, q, q64, mx, lanes):
    y[:] = 0
    y64[:] = 0
    q[:] = 0
    q64[:] = 0
    mx[:] = 0
    lanes[:] = 0


@nb.njit(**_jit)
def _piece(values, second, n, num_blocks):
    """The first or ``second`` piece of one tensor's pass, as ``cpu_kernel.partials`` cuts it:
    its whole tiles, then the rest zero-padded to a tile. Returns ``(rows x BLOCK_ELEMS grid, its
    words, digest blocks, first row, first block)``; an empty grid when the piece is empty."""
    element = values.itemsize
    main_rows = n // (TILE_ROWS * BLOCK_ELEMS) * TILE_ROWS
    main_blocks = main_rows * BLOCK_ELEMS * element // (4 * BLOCK_WORDS)
    if not second:
        part = values[: main_rows * BLOCK_ELEMS]
        blocks, row_base, first = min(main_blocks, num_blocks), 0, 0
    else:
        rest = n - main_rows * BLOCK_ELEMS
        part = np.zeros(TILE_ROWS * BLOCK_ELEMS if rest else 0, dtype=values.dtype)
        part[:rest] = values[main_rows * BLOCK_ELEMS : n]
        blocks = max(0, num_blocks - main_blocks)
        row_base, first = main_rows, main_blocks if blocks else 0
    return part.reshape((part.size // BLOCK_ELEMS, BLOCK_ELEMS)), part.view(np.int32), blocks, row_base, first


@nb.njit(**_jit)
def _one_direct(values, n, num_blocks, a, b, c, c2, beta, alpha, y, y64, q, q64, mx, lanes, pairs):
    """One float32 or float64 tensor's pass; returns ``(sketch, sumsq)``, ``lanes`` and ``mx`` hold the rest."""
    _reset(y, y64, q, q64, mx, lanes)
    for second in (False, True):
        grid, words, blocks, row, first = _piece(values, second, n, num_blocks)
        if grid.shape[0]:
            per_tile = TILE_ROWS * BLOCK_ELEMS * values.itemsize // (4 * BLOCK_WORDS)
            run_direct(
                grid, words, blocks, per_tile, row, a, b, c[first:], c2[first:], beta[row:],
                y, y64, q, q64, mx, lanes, pairs,
            )  # fmt: skip
    return finish(y, y64, q, q64, alpha)


@nb.njit(**_jit)
def _one_widened(values, is_f16, n, num_blocks, a, b, c, c2, beta, alpha, tile, y, y64, q, q64, mx, lanes, pairs):
    """:func:`_one_direct` for 16-bit bits."""
    _reset(y, y64, q, q64, mx, lanes)
    for second in (False, True):
        grid, words, blocks, row, first = _piece(values, second, n, num_blocks)
        if grid.shape[0]:
            per_tile = TILE_ROWS * BLOCK_ELEMS * 2 // (4 * BLOCK_WORDS)
            run_widened(
                grid, is_f16, words, blocks, per_tile, row, a, b, c[first:], c2[first:], beta[row:],
                tile, y, y64, q, q64, mx, lanes, pairs,
            )  # fmt: skip
    return finish(y, y64, q, q64, alpha)


@nb.njit(**_jit)
def _many(kind, addresses, sizes, block_offsets, digest_offsets, with_digest, a, b, c, c2, beta, alpha):
    """Every tensor's lanes ``(T, 2)``, sketch ``(T, k)``, sum of squares and max |x| ``(T,)``."""
    count, k = addresses.size, alpha.shape[1]
    lanes_out = np.zeros((count, 2), dtype=np.uint64)
    sketch_out = np.zeros((count, k))
    sumsq_out = np.zeros(count)
    max_out = np.zeros(count)
    y = np.zeros((k, BLOCK_ELEMS), dtype=beta.dtype)
    y64 = np.zeros((k, BLOCK_ELEMS))
    q = np.zeros(BLOCK_ELEMS, dtype=beta.dtype)
    q64 = np.zeros(BLOCK_ELEMS)
    mx = np.zeros(BLOCK_ELEMS, dtype=beta.dtype)
    lanes = np.zeros(2, dtype=np.uint64)
    tile = np.empty((TILE_ROWS, BLOCK_ELEMS), dtype=np.float32)
    pairs = np.empty((TILE_ROWS, BLOCK_ELEMS), dtype=beta.dtype)
    for t in range(count):
        n = sizes[t]
        offset, digest_offset = block_offsets[t], digest_offsets[t]
        beta_t, c_t, c2_t = beta[offset:], c[digest_offset:], c2[digest_offset:]
        if kind == 0:
            values32 = nb.carray(_f32_at(addresses[t]), (n,))
            blocks = -(-n * 4 // (4 * BLOCK_WORDS)) if with_digest else 0
            sketch, sumsq = _one_direct(
                values32, n, blocks, a, b, c_t, c2_t, beta_t, alpha, y, y64, q, q64, mx, lanes, pairs
            )
        elif kind == 3:
            values64 = nb.carray(_f64_at(addresses[t]), (n,))
            blocks = -(-n * 8 // (4 * BLOCK_WORDS)) if with_digest else 0
            sketch, sumsq = _one_direct(
                values64, n, blocks, a, b, c_t, c2_t, beta_t, alpha, y, y64, q, q64, mx, lanes, pairs
            )
        else:
            values16 = nb.carray(_u16_at(addresses[t]), (n,))
            blocks = -(-n * 2 // (4 * BLOCK_WORDS)) if with_digest else 0
            sketch, sumsq = _one_widened(
                values16, kind == 2, n, blocks, a, b, c_t, c2_t, beta_t, alpha, tile, y, y64, q, q64, mx, lanes, pairs
            )
        lanes_out[t, 0], lanes_out[t, 1] = lanes[0], lanes[1]
        sketch_out[t] = sketch
        sumsq_out[t] = sumsq
        max_out[t] = np.float64(mx.max())
    return lanes_out, sketch_out, sumsq_out, max_out
