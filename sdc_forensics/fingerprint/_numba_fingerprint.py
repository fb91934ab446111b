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


# lanes per strip: a tile is worked through in strips of lanes, so that the strip's rows, its
# row pairs and its accumulators (8 KiB each for float32 and k = 8) stay in L1 while every part reads
# them; each lane still sees exactly the operations, in the order, that reference.py states
STRIP = 256


@nb.njit(**_jit)
def _digest_strip(words, r0, lane, element, first_block, tile_blocks, a, b, s_sums, t_sums):
    """The digest words of one strip of tile rows ``r0..r0+TILE_ROWS``, lanes ``lane..lane+STRIP``,
    added into their blocks' sums: ``s_j += sum_i a_p w_i``, ``t_j += sum_i b_p (w_i >> 16)`` mod
    2**32 (``p`` the word's place in block ``j``; wrapping sums, so any order is exact). Blocks
    from ``tile_blocks`` on (past the words to digest) are skipped."""
    row_words = BLOCK_ELEMS * element // 4
    count = STRIP * element // 4
    for r in range(TILE_ROWS):
        first_word = (r0 + r) * row_words + lane * element // 4
        block = first_word // BLOCK_WORDS - first_block
        if block < tile_blocks:
            place = first_word % BLOCK_WORDS
            run = words[first_word : first_word + count]
            wa = a[place : place + count]
            wb = b[place : place + count]
            s = np.int32(0)
            t = np.int32(0)
            for i in range(count):
                w = run[i]
                s = np.int32(s + np.int32(w * wa[i]))
                t = np.int32(t + np.int32((w >> np.int32(16)) * wb[i]))
            s_sums[block] += s
            t_sums[block] += t


@nb.njit(**_jit)
def _tile_lanes(first_block, tile_blocks, s_sums, t_sums, c, c2, lanes):
    """A tile's block sums into the lane totals: ``lanes += (c_j s_j, c'_j t_j)`` mod 2**64."""
    low = lanes[0]
    high = lanes[1]
    for block in range(tile_blocks):
        low += np.uint64(np.uint32(s_sums[block])) * c[first_block + block]
        high += np.uint64(np.uint32(t_sums[block])) * c2[first_block + block]
        s_sums[block] = 0
        t_sums[block] = 0
    lanes[0] = low
    lanes[1] = high


@nb.njit(**_jit)
def _pairs_and_stats(x, at, q, mx, lane, pairs):
    """One strip, lanes ``lane..lane+STRIP`` (read from ``x[:, at..at+STRIP]``): the row pairs
    ``pairs[2p] = x_2p + x_2p+1``, ``pairs[2p+1] = x_2p - x_2p+1``, and lane by lane, row after
    row, ``q += v * v`` (rounded product, then sum) and max |v| (NaN skipped).

    NaN and Inf are not counted here: either makes ``q`` non-finite, and the caller counts them
    then (a second pass only over a tensor that holds one).
    """
    end = at + STRIP
    x0, x1, x2, x3 = x[0, at:end], x[1, at:end], x[2, at:end], x[3, at:end]
    x4, x5, x6, x7 = x[4, at:end], x[5, at:end], x[6, at:end], x[7, at:end]
    p0, p1, p2, p3 = pairs[0, :STRIP], pairs[1, :STRIP], pairs[2, :STRIP], pairs[3, :STRIP]
    p4, p5, p6, p7 = pairs[4, :STRIP], pairs[5, :STRIP], pairs[6, :STRIP], pairs[7, :STRIP]
    qs, ms = q[lane : lane + STRIP], mx[lane : lane + STRIP]
    for i in range(STRIP):
        v0, v1, v2, v3 = x0[i], x1[i], x2[i], x3[i]
        v4, v5, v6, v7 = x4[i], x5[i], x6[i], x7[i]
        p0[i], p1[i], p2[i], p3[i] = v0 + v1, v0 - v1, v2 + v3, v2 - v3
        p4[i], p5[i], p6[i], p7[i] = v4 + v5, v4 - v5, v6 + v7, v6 - v7
        qs[i] = qs[i] + v0 * v0 + v1 * v1 + v2 * v2 + v3 * v3 + v4 * v4 + v5 * v5 + v6 * v6 + v7 * v7
        m = ms[i]
        for a in (abs(v0), abs(v1), abs(v2), abs(v3), abs(v4), abs(v5), abs(v6), abs(v7)):
            m = a if a > m else m
        ms[i] = m


# y + g * c with g = +-1: exact product, so an FMA rounds alike
@nb.njit(fastmath={"contract"}, **_jit)
def _sketch_strip(signs, y, lane, pairs):
    """``y[m] += sum_r signs[r, m] * x[r]`` for one strip, as four pair terms added in order.

    ``s0 x0 + s1 x1 = s0 (x0 + s0 s1 x1)``: each pair of rows is added (or subtracted) once,
    rounded, and the result goes into ``y[m]`` with the sign of the pair's first row; 4 additions
    per projection and tile instead of 8.
    """
    for m in range(y.shape[0]):
        g0, g1, g2, g3 = signs[0, m], signs[2, m], signs[4, m], signs[6, m]
        c0 = pairs[0, :STRIP] if signs[1, m] == g0 else pairs[1, :STRIP]
        c1 = pairs[2, :STRIP] if signs[3, m] == g1 else pairs[3, :STRIP]
        c2 = pairs[4, :STRIP] if signs[5, m] == g2 else pairs[5, :STRIP]
        c3 = pairs[6, :STRIP] if signs[7, m] == g3 else pairs[7, :STRIP]
        ym = y[m, lane : lane + STRIP]
        for i in range(STRIP):
            acc = ym[i] + g0 * c0[i]
            acc = acc + g1 * c1[i]
            acc = acc + g2 * c2[i]
            ym[i] = acc + g3 * c3[i]


@nb.njit(**_jit)
def _pairs_and_stats_rows(x, at, q, mx, lane, pairs, rows):
    """:func:`_pairs_and_stats` of a tile whose rows from ``rows`` on are zero (the zero padding
    of a tensor's last tile): only the first ``2 * ceil(rows / 2)`` rows are read. A zero row
    adds ``+0`` to a sum that is never ``-0``, and never raises a max: the same bits."""
    npairs = (rows + 1) // 2
    end = at + STRIP
    for p in range(npairs):
        xa, xb = x[2 * p, at:end], x[2 * p + 1, at:end]
        pa, pb = pairs[2 * p, :STRIP], pairs[2 * p + 1, :STRIP]
        for i in range(STRIP):
            pa[i], pb[i] = xa[i] + xb[i], xa[i] - xb[i]
    qs, ms = q[lane : lane + STRIP], mx[lane : lane + STRIP]
    for i in range(STRIP):
        acc = qs[i]
        m = ms[i]
        for r in range(2 * npairs):
            v = x[r, at + i]
            acc = acc + v * v
            a = abs(v)
            m = a if a > m else m
        qs[i] = acc
        ms[i] = m


@nb.njit(fastmath={"contract"}, **_jit)
def _sketch_strip_pairs(signs, y, lane, pairs, npairs):
    """:func:`_sketch_strip` over the first ``npairs`` row pairs only (the others are zero: adding
    ``g * 0`` to an accumulator that is never ``-0`` changes no bit)."""
    for m in range(y.shape[0]):
        ym = y[m, lane : lane + STRIP]
        for p in range(npairs):
            g = signs[2 * p, m]
            c = pairs[2 * p, :STRIP] if signs[2 * p + 1, m] == g else pairs[2 * p + 1, :STRIP]
            for i in range(STRIP):
                ym[i] = ym[i] + g * c[i]


@nb.njit(**_jit)
def _live(live, r0):
    """``(rows, lanes)`` of the tile at row ``r0`` that may hold data: its first ``rows`` rows
    (the rest zero padding), and, where that is one row, its first ``lanes`` lanes (the strips
    after them hold only zeros: skipped, digest included, since zero words add nothing)."""
    left = live - r0 * BLOCK_ELEMS
    rows = min(TILE_ROWS, max(0, -(-left // BLOCK_ELEMS)))
    return rows, (left if rows == 1 else (BLOCK_ELEMS if rows else 0))


@nb.njit(**_jit)
def _strip(x, at, q, mx, lane, pairs, signs, y, rows):
    """One strip's pairs, stats and sketch: the whole tile's code, or the fewer rows' (the same bits)."""
    if rows == TILE_ROWS:
        _pairs_and_stats(x, at, q, mx, lane, pairs)
        _sketch_strip(signs, y, lane, pairs)
    else:
        _pairs_and_stats_rows(x, at, q, mx, lane, pairs, rows)
        _sketch_strip_pairs(signs, y, lane, pairs, (rows + 1) // 2)


@nb.njit(**_jit)
def _flush(y, y64, q, q64):
    _flush_lanes(y, y64, q, q64, BLOCK_ELEMS)


@nb.njit(**_jit)
def _flush_lanes(y, y64, q, q64, used):
    """The float32 sums of lanes ``[0, used)`` added into the float64 ones, and cleared."""
    for m in range(y.shape[0]):
        for i in range(used):
            y64[m, i] += np.float64(y[m, i])
            y[m, i] = 0
    for i in range(used):
        q64[i] += np.float64(q[i])
        q[i] = 0


@nb.njit(**_jit)
def _widen_bf16(src, r0, lane, out):
    """Lanes ``lane..lane+STRIP`` of rows ``r0..r0+TILE_ROWS`` of bfloat16 bits ``src`` as float32 in ``out`` (exact)."""
    bits = out.view(np.uint32)
    for r in range(TILE_ROWS):
        row = src[r0 + r, lane : lane + STRIP]
        dst = bits[r, :STRIP]
        for i in range(STRIP):
            dst[i] = np.uint32(row[i]) << np.uint32(16)


@nb.njit(**_jit)
def _widen_f16(src, r0, lane, out):
    """:func:`_widen_bf16` for float16 bits (exact, subnormals too)."""
    bits = out.view(np.uint32)
    magic = np.float32(2.0**-14)
    for r in range(TILE_ROWS):
        row = src[r0 + r, lane : lane + STRIP]
        dst = bits[r, :STRIP]
        for i in range(STRIP):
            h = np.uint32(row[i])
            e = h & np.uint32(0x7C00)
            u = ((h & np.uint32(0x7FFF)) << np.uint32(13)) + np.uint32(112 << 23)
            # Inf/NaN: exponent 255
            u = u + np.uint32(112 << 23) if e == np.uint32(0x7C00) else u
            # zero/subnormal: 2^-14 (1 + m / 1024)
            u = u + np.uint32(1 << 23) if e == np.uint32(0) else u
            dst[i] = u
        values = out[r, :STRIP]
        for i in range(STRIP):
            if row[i] & np.uint16(0x7C00) == np.uint16(0):
                # = m * 2^-24, exact
                values[i] = values[i] - magic
        for i in range(STRIP):
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
def run_direct(
    values, words, num_blocks, blocks_per_tile, row_base, a, b, c, c2, beta, y, y64, q, q64, mx, lanes, pairs, live
):
    """Digest, sketch and stats of float32 or float64 ``values`` (whole tiles), into the state arrays.

    One read of memory: strip by strip, the strip's digest words, row pairs, stats and sketch.

    Args:
        values: ``(rows, BLOCK_ELEMS)``, ``rows`` a multiple of ``TILE_ROWS``.
        words: the same bytes as ``int32``; the first ``num_blocks`` digest blocks are digested.
        blocks_per_tile: digest blocks per tile of rows.
        row_base: the global row of ``values[0]`` (group flushes are global).
        c, c2: block weights from this call's first block; ``beta``: signs from its first row.
        y, y64, q, q64, mx: accumulators; ``lanes``: ``(2,)`` uint64 lane totals; ``pairs``:
            ``(TILE_ROWS, >= STRIP)`` scratch of the accumulators' dtype.
        live: the elements of ``values`` (flat) that may be nonzero, the rest zero padding: rows
            and strips holding only padding skip the sketch and stats (:func:`_strip`).
    """
    element = values.itemsize
    # (blocks_per_tile,) the tile's block sums s_j, t_j, strip by strip
    s_sums = np.zeros(blocks_per_tile, dtype=np.int32)
    t_sums = np.zeros(blocks_per_tile, dtype=np.int32)
    for r0 in range(0, values.shape[0], TILE_ROWS):
        first_block = r0 // TILE_ROWS * blocks_per_tile
        tile_blocks = min(blocks_per_tile, num_blocks - first_block)
        x = values[r0 : r0 + TILE_ROWS]
        signs = beta[r0 : r0 + TILE_ROWS]
        rows, lanes_live = _live(live, r0)
        for lane in range(0, BLOCK_ELEMS, STRIP):
            if lane >= lanes_live:
                break
            if tile_blocks > 0:
                _digest_strip(words, r0, lane, element, first_block, tile_blocks, a, b, s_sums, t_sums)
            _strip(x, lane, q, mx, lane, pairs, signs, y, rows)
        _tile_lanes(first_block, tile_blocks, s_sums, t_sums, c, c2, lanes)
        if (row_base + r0 + TILE_ROWS) % GROUP_ROWS == 0:
            _flush(y, y64, q, q64)


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
    live,
):
    """:func:`run_direct` for 16-bit ``values`` (uint16 bits), widened strip by strip into float32 ``tile``."""
    s_sums = np.zeros(blocks_per_tile, dtype=np.int32)
    t_sums = np.zeros(blocks_per_tile, dtype=np.int32)
    for r0 in range(0, values.shape[0], TILE_ROWS):
        first_block = r0 // TILE_ROWS * blocks_per_tile
        tile_blocks = min(blocks_per_tile, num_blocks - first_block)
        signs = beta[r0 : r0 + TILE_ROWS]
        rows, lanes_live = _live(live, r0)
        for lane in range(0, BLOCK_ELEMS, STRIP):
            if lane >= lanes_live:
                break
            if tile_blocks > 0:
                _digest_strip(words, r0, lane, 2, first_block, tile_blocks, a, b, s_sums, t_sums)
            if is_f16:
                _widen_f16(values, r0, lane, tile)
            else:
                _widen_bf16(values, r0, lane, tile)
            _strip(tile, 0, q, mx, lane, pairs, signs, y, rows)
        _tile_lanes(first_block, tile_blocks, s_sums, t_sums, c, c2, lanes)
        if (row_base + r0 + TILE_ROWS) % GROUP_ROWS == 0:
            _flush(y, y64, q, q64)


@nb.njit(**_jit)
def finish(y, y64, q, q64, alpha):
    """``(sketch, sumsq)`` after the last flush: sums over lanes in order, in float64. Leaves
    ``y``, ``y64``, ``q`` and ``q64`` zero (the next pass's start, :func:`_reset`)."""
    return _finish_lanes(y, y64, q, q64, alpha, BLOCK_ELEMS)


@nb.njit(**_jit)
def _finish_lanes(y, y64, q, q64, alpha, used):
    """:func:`finish` of a pass that touched only lanes ``[0, used)`` (the rest hold exact +0.0).

    The same bits as over every lane: each sum starts at +0.0 and adds its lanes in order, so it
    is never -0.0, and adding the skipped lanes' products (+0.0 or -0.0) would change nothing.
    """
    _flush_lanes(y, y64, q, q64, used)
    k = y.shape[0]
    # each sum adds its lanes in order; four side by side (in registers), so that the additions
    # of four chains overlap instead of one chain of 1024 dependent additions waiting on itself
    sketch = np.zeros(k)
    m = 0
    while m + 4 <= k:
        s0 = s1 = s2 = s3 = 0.0
        for i in range(used):
            s0 += alpha[i, m] * y64[m, i]
            s1 += alpha[i, m + 1] * y64[m + 1, i]
            s2 += alpha[i, m + 2] * y64[m + 2, i]
            s3 += alpha[i, m + 3] * y64[m + 3, i]
            y64[m, i] = y64[m + 1, i] = y64[m + 2, i] = y64[m + 3, i] = 0.0
        sketch[m], sketch[m + 1], sketch[m + 2], sketch[m + 3] = s0, s1, s2, s3
        m += 4
    for m in range(m, k):
        acc = 0.0
        for i in range(used):
            acc += alpha[i, m] * y64[m, i]
            y64[m, i] = 0.0
        sketch[m] = acc
    total = 0.0
    for i in range(used):
        total += q64[i]
        q64[i] = 0.0
    return sketch, total


@nb.njit(**_jit)
def _lanes_used(n):
    """The lanes a pass over ``n`` elements can touch: every lane from one whole row on, else the
    strips that hold its elements (the strips after them are skipped, :func:`_live`)."""
    if n >= BLOCK_ELEMS:
        return BLOCK_ELEMS
    return min(BLOCK_ELEMS, -(-n // STRIP) * STRIP)


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
def _reset(mx, lanes):
    """A pass's start, after :func:`_state` or the last pass's :func:`finish` (which leaves the
    sums zero): the max and the digest lanes."""
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
    _reset(mx, lanes)
    for second in (False, True):
        grid, words, blocks, row, first = _piece(values, second, n, num_blocks)
        if grid.shape[0]:
            per_tile = TILE_ROWS * BLOCK_ELEMS * values.itemsize // (4 * BLOCK_WORDS)
            run_direct(
                grid, words, blocks, per_tile, row, a, b, c[first:], c2[first:], beta[row:],
                y, y64, q, q64, mx, lanes, pairs, n - row * BLOCK_ELEMS,
            )  # fmt: skip
    return _finish_lanes(y, y64, q, q64, alpha, _lanes_used(n))


@nb.njit(**_jit)
def _one_widened(values, is_f16, n, num_blocks, a, b, c, c2, beta, alpha, tile, y, y64, q, q64, mx, lanes, pairs):
    """:func:`_one_direct` for 16-bit bits."""
    _reset(mx, lanes)
    for second in (False, True):
        grid, words, blocks, row, first = _piece(values, second, n, num_blocks)
        if grid.shape[0]:
            per_tile = TILE_ROWS * BLOCK_ELEMS * 2 // (4 * BLOCK_WORDS)
            run_widened(
                grid, is_f16, words, blocks, per_tile, row, a, b, c[first:], c2[first:], beta[row:],
                tile, y, y64, q, q64, mx, lanes, pairs, n - row * BLOCK_ELEMS,
            )  # fmt: skip
    return _finish_lanes(y, y64, q, q64, alpha, _lanes_used(n))


@nb.njit(**_jit)
def _state(k, beta):
    """A pass's accumulators and scratch, in ``beta``'s dtype (the accumulators')."""
    y = np.zeros((k, BLOCK_ELEMS), dtype=beta.dtype)
    y64 = np.zeros((k, BLOCK_ELEMS))
    q = np.zeros(BLOCK_ELEMS, dtype=beta.dtype)
    q64 = np.zeros(BLOCK_ELEMS)
    mx = np.zeros(BLOCK_ELEMS, dtype=beta.dtype)
    lanes = np.zeros(2, dtype=np.uint64)
    tile = np.empty((TILE_ROWS, BLOCK_ELEMS), dtype=np.float32)
    pairs = np.empty((TILE_ROWS, BLOCK_ELEMS), dtype=beta.dtype)
    return y, y64, q, q64, mx, lanes, tile, pairs


@nb.njit(**_jit)
def _many(kind, addresses, sizes, block_offsets, digest_offsets, with_digest, a, b, c, c2, beta, alpha):
    """Every tensor's lanes ``(T, 2)``, sketch ``(T, k)``, sum of squares and max |x| ``(T,)``."""
    count, k = addresses.size, alpha.shape[1]
    lanes_out = np.zeros((count, 2), dtype=np.uint64)
    sketch_out = np.zeros((count, k))
    sumsq_out = np.zeros(count)
    max_out = np.zeros(count)
    y, y64, q, q64, mx, lanes, tile, pairs = _state(k, beta)
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


# ---------------------------------------------------------------- a sharded piece's cut ends
@nb.njit(**_jit)
def _end_terms(words, floats, start, stop, signs, a, b, alpha, acc, s_row, t_row, sketch_row):
    """One cut end's numbers from its zero-padded chunk (``words`` int32, ``floats`` float64,
    empty for a tensor that is not floating point): its digest block sums into ``s_row``,
    ``t_row`` (int64, as uint32 values), its sketch terms added into ``sketch_row`` (rows of
    ``signs`` from the chunk's first sketch block); returns ``(sumsq, max |x|, NaN/Inf count)``.
    Each sum runs in order over the end's own elements ``[start, stop)`` (the padding adds exact
    zeros, so it is skipped)."""
    for j in range(words.size // BLOCK_WORDS):
        row = words[j * BLOCK_WORDS : (j + 1) * BLOCK_WORDS]
        s = np.int32(0)
        t = np.int32(0)
        for i in range(BLOCK_WORDS):
            w = row[i]
            s = np.int32(s + np.int32(w * a[i]))
            t = np.int32(t + np.int32((w >> np.int32(16)) * b[i]))
        s_row[j] = np.int64(np.uint32(s))
        t_row[j] = np.int64(np.uint32(t))
    if floats.size == 0:
        return 0.0, 0.0, 0
    k = alpha.shape[1]
    for r in range(floats.size // BLOCK_ELEMS):
        lo = max(start, r * BLOCK_ELEMS)
        hi = min(stop, (r + 1) * BLOCK_ELEMS)
        if lo >= hi:
            continue
        acc[:] = 0.0
        for i in range(lo, hi):
            x = floats[i]
            lane = i - r * BLOCK_ELEMS
            for m in range(k):
                acc[m] += x * alpha[lane, m]
        for m in range(k):
            sketch_row[m] += acc[m] * np.float64(signs[r, m])
    total = 0.0
    largest = 0.0
    nan = False
    bad = 0
    for i in range(start, stop):
        x = floats[i]
        total += x * x
        if x != x:
            nan = True
            bad += 1
        elif abs(x) == np.inf:
            bad += 1
            largest = np.inf
        elif abs(x) > largest:
            largest = abs(x)
    return total, np.nan if nan else largest, bad


@nb.njit(**_jit)
def ends(words, floats, positions, lengths, first_rows, a, b, beta, alpha):
    """The numbers of ``E`` cut ends (``shards._batched_ends``), each a zero-padded chunk.

    Args:
        words: ``(E, blocks * BLOCK_WORDS)`` int32, each chunk's bytes.
        floats: ``(E, rows * BLOCK_ELEMS)`` float64, each chunk's values (exact), or ``(E, 0)``
            for a tensor that is not floating point.
        positions, lengths: where each end's values sit in its chunk, and how many.
        first_rows: the sketch block of each chunk's first row (its row of ``beta``).

    Returns:
        ``(s, t)`` the digest block sums mod 2**32 ``(E, blocks)`` (int64, as uint32 values),
        the sketch ``(E, k)``, and per end its sum of squares, max |x| (NaN wins) and NaN/Inf
        count (:func:`_end_terms`).
    """
    count, width = words.shape
    blocks = width // BLOCK_WORDS
    k = alpha.shape[1]
    s_out = np.zeros((count, blocks), dtype=np.int64)
    t_out = np.zeros((count, blocks), dtype=np.int64)
    sketch = np.zeros((count, k))
    sumsq = np.zeros(count)
    max_abs = np.zeros(count)
    nonfinite = np.zeros(count, dtype=np.int64)
    acc = np.zeros(k)
    for e in range(count):
        start = positions[e]
        sumsq[e], max_abs[e], nonfinite[e] = _end_terms(
            words[e], floats[e], start, start + lengths[e], beta[first_rows[e] :], a, b, alpha, acc,
            s_out[e], t_out[e], sketch[e],
        )  # fmt: skip
    return s_out, t_out, sketch, sumsq, max_abs, nonfinite


_i32_at = _pointer_to(types.int32)
_u8_at = _pointer_to(types.uint8)


@nb.njit(**_jit)
def digest_many(addresses, nbytes, a, b, c, c2):
    """The digest's lane totals ``(T, 2)`` of ``T`` byte runs (addresses 4-byte aligned): each as
    ``cpu_kernel._digest_words`` takes it, its whole blocks, then its rest zero-padded to a block."""
    count = addresses.size
    out = np.zeros((count, 2), dtype=np.uint64)
    lanes = np.zeros(2, dtype=np.uint64)
    tail = np.zeros(BLOCK_WORDS, dtype=np.int32)
    tail_bytes = tail.view(np.uint8)
    for t in range(count):
        n = nbytes[t]
        full = n // (4 * BLOCK_WORDS)
        lanes[0] = 0
        lanes[1] = 0
        if full:
            words = nb.carray(_i32_at(addresses[t]), (full * BLOCK_WORDS,))
            _digest_until(words, 0, full, a, b, c, c2, lanes)
        rest = n - full * 4 * BLOCK_WORDS
        if rest:
            tail[:] = 0
            src = nb.carray(_u8_at(addresses[t] + full * 4 * BLOCK_WORDS), (rest,))
            tail_bytes[:rest] = src
            _digest_until(tail, 0, 1, a, b, c[full:], c2[full:], lanes)
        out[t, 0] = lanes[0]
        out[t, 1] = lanes[1]
    return out


# ---------------------------------------------------------------- a rank's runs of one flat vector, whole
@nb.njit(**_jit)
def runs(kind, addresses, sizes, offsets, align, a, b, c, c2, beta, alpha, sketch, sums):
    """``shards.fingerprint_runs`` of float32 (``kind`` 0) or bfloat16 (1) runs in one call: each
    run (``sizes[t]`` elements at ``addresses[t]``, element ``offsets[t]`` of the flat vector) cut
    as ``shards.fingerprint_piece`` cuts it (a head and a tail end, a body of whole chunks of
    ``align`` elements); the bodies through the one-pass loops, the ends through
    :func:`_end_terms`, each run's parts added in order (head, body, tail), the runs in order.

    ``sketch`` ``(k,)`` and ``sums`` ``[sum of squares, max |x|]`` are added into (a running
    total: several calls add as one). Returns ``(low, high, blocks, s, t, finite)``: the bodies'
    lane totals, each cut end's digest blocks with their word sums (mod 2**32, not yet weighted:
    ends of other calls may share a block; :func:`weigh_ends`), and ``finite`` False where a
    NaN/Inf was met (the caller then takes the general path, which counts them).
    """
    itemsize = 4 if kind == 0 else 2
    k = alpha.shape[1]
    count = addresses.size
    per_end = align * itemsize // (4 * BLOCK_WORDS)
    end_blocks = np.zeros(2 * count * per_end, dtype=np.int64)
    end_s = np.zeros(2 * count * per_end, dtype=np.int64)
    end_t = np.zeros(2 * count * per_end, dtype=np.int64)
    used = 0
    chunk = np.zeros(align * itemsize, dtype=np.uint8)
    words = chunk.view(np.int32)
    bits16 = chunk.view(np.uint16)
    wide = np.zeros(align, dtype=np.uint32)
    floats = np.zeros(align)
    acc = np.zeros(k)
    s_row = np.zeros(per_end, dtype=np.int64)
    t_row = np.zeros(per_end, dtype=np.int64)
    part_sketch = np.zeros(k)
    y, y64, q, q64, mx, lanes, tile, pairs = _state(k, beta)
    low = np.uint64(0)
    high = np.uint64(0)
    sumsq = sums[0]
    largest = sums[1]
    finite = True
    piece = np.zeros(k)
    for t in range(count):
        n = sizes[t]
        off = offsets[t]
        if n == 0:
            continue
        head = min(n, (align - off % align) % align)
        body = (n - head) // align * align
        tail = n - head - body
        piece[:] = 0.0
        piece_sumsq = 0.0
        raw = nb.carray(_u8_at(addresses[t]), (n * itemsize,))
        for part in range(3):
            if part == 1:
                if body == 0:
                    continue
                first = off + head
                blocks = body * itemsize // (4 * BLOCK_WORDS)
                row0 = first // BLOCK_ELEMS
                block0 = first * itemsize // (4 * BLOCK_WORDS)
                if kind == 0:
                    values32 = nb.carray(_f32_at(addresses[t] + head * itemsize), (body,))
                    done, part_sumsq = _one_direct(
                        values32, body, blocks, a, b, c[block0:], c2[block0:], beta[row0:], alpha,
                        y, y64, q, q64, mx, lanes, pairs,
                    )  # fmt: skip
                    part_sketch[:] = done
                else:
                    values16 = nb.carray(_u16_at(addresses[t] + head * itemsize), (body,))
                    done, part_sumsq = _one_widened(
                        values16, False, body, blocks, a, b, c[block0:], c2[block0:], beta[row0:], alpha,
                        tile, y, y64, q, q64, mx, lanes, pairs,
                    )  # fmt: skip
                    part_sketch[:] = done
                low += lanes[0]
                high += lanes[1]
                top = np.float64(mx.max())
                # as core: the norm, then its square (the body's piece keeps fp.norm ** 2)
                norm = np.sqrt(part_sumsq)
                part_sumsq = norm * norm
                if not (np.isfinite(part_sumsq) and np.isfinite(top)):
                    finite = False
                largest = max(largest, top)
            else:
                length = head if part == 0 else tail
                if length == 0:
                    continue
                pos = off % align if part == 0 else 0
                first = off - pos if part == 0 else off + head + body
                src = 0 if part == 0 else (head + body) * itemsize
                chunk[pos * itemsize : (pos + length) * itemsize] = raw[src : src + length * itemsize]
                if kind == 0:
                    fl = chunk.view(np.float32)
                    for i in range(pos, pos + length):
                        floats[i] = np.float64(fl[i])
                else:
                    for i in range(pos, pos + length):
                        wide[i] = np.uint32(bits16[i]) << np.uint32(16)
                    fw = wide.view(np.float32)
                    for i in range(pos, pos + length):
                        floats[i] = np.float64(fw[i])
                part_sketch[:] = 0.0
                part_sumsq, top, bad = _end_terms(
                    words, floats, pos, pos + length, beta[first // BLOCK_ELEMS :], a, b, alpha, acc,
                    s_row, t_row, part_sketch,
                )  # fmt: skip
                if bad:
                    finite = False
                largest = max(largest, top)
                block0 = first * itemsize // (4 * BLOCK_WORDS)
                for j in range(per_end):
                    end_blocks[used] = block0 + j
                    end_s[used] = s_row[j]
                    end_t[used] = t_row[j]
                    used += 1
                chunk[pos * itemsize : (pos + length) * itemsize] = 0
                floats[pos : pos + length] = 0.0
            piece += part_sketch
            piece_sumsq += part_sumsq
        sketch += piece
        sumsq += piece_sumsq
    sums[0] = sumsq
    sums[1] = largest
    return low, high, end_blocks[:used], end_s[:used], end_t[:used], finite


@nb.njit(**_jit)
def weigh_ends(blocks, s_sums, t_sums, c, c2):
    """Cut blocks into lane totals ``(low, high)``: each block's words summed over the ends that
    hold it (mod 2**32), times ``c_j`` (``c'_j``), mod 2**64."""
    low = np.uint64(0)
    high = np.uint64(0)
    used = blocks.size
    order = np.argsort(blocks, kind="mergesort")
    i = 0
    while i < used:
        block = blocks[order[i]]
        s = np.uint64(0)
        t = np.uint64(0)
        while i < used and blocks[order[i]] == block:
            s = (s + np.uint64(s_sums[order[i]])) & np.uint64(0xFFFFFFFF)
            t = (t + np.uint64(t_sums[order[i]])) & np.uint64(0xFFFFFFFF)
            i += 1
        low += s * np.uint64(c[block])
        high += t * np.uint64(c2[block])
    return low, high
