"""Compiled loops of the trace scan (numba), over rank files' raw 64-bit words.

Imported only by :mod:`sdc_forensics.trace.scan` when numba is importable and the kernels are
not turned off (``SDC_FORENSICS_KERNELS=off``); nothing else may import it. Every function
here has a numpy twin that defines what it computes (``format.checksums``, ``Trace.valid_mask``,
``windows.iter_windows``, ``triage``); ``tests/trace/test_scan_fast.py`` holds them equal.

A record (``format.py``) seen as little-endian 64-bit words ``w`` (and as float32 ``f``)::

    w[0]  magic (bits 0-31), kind (32-47), flags (48-63)     w[1]  step
    w[2]  rank (bits 0-31), attempt                          w[8]  nonfinite_local (bits 32-63)
    w[9]  nonfinite_reduced (0-31), nonfinite_weights (32-63)
    w[11] reduced_digest   w[12] weights_digest   f[26] local_norm   f[27] reduced_norm
    f[36 : 36 + k] local_sketch   f[36 + k : 36 + 2 k] reduced_sketch   w[-1] checksum

Compiled with ``cache=True`` (the machine code is kept next to this file, or in
``NUMBA_CACHE_DIR``), single-threaded, no ``parallel=True``: the first run on a machine compiles
in a few seconds, later runs load the cache.

Over 400 lines on purpose: numba freezes module globals into each compiled kernel and caches per
module: the kernels and the constants they share stay in one module so that one cache entry matches
one set of constants.
"""

from __future__ import annotations

import numba
import numpy as np

from sdc_forensics.trace import format as F

_U32 = np.uint64(0xFFFF_FFFF)
_U16 = np.uint64(0xFFFF)
_SH16 = np.uint64(16)
_SH27 = np.uint64(27)
_SH30 = np.uint64(30)
_SH31 = np.uint64(31)
_SH32 = np.uint64(32)
_SH48 = np.uint64(48)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MAGIC = np.uint64(F.RECORD_MAGIC)
_STEP = np.uint64(int(F.Kind.STEP))
_HAS_GRADS = np.uint64(int(F.Flag.HAS_GRADS))
_HAS_WEIGHTS = np.uint64(int(F.Flag.HAS_WEIGHTS))

# cell bits of a window
PRESENT = 1
GRADS = 2
WEIGHTS = 4
SUPERSEDED = 8
# row events of a window
EV_NONFINITE = 1
EV_ALLREDUCE = 2
EV_WEIGHTS = 4
EV_HOLE = 8
EV_OUTLIER = 16
# columns of the per-row accumulators ``racc`` (float64)
(
    A_PRESENT,
    A_GRADS,
    A_NF_LOCAL,
    A_NF_REDUCED,
    A_NF_WEIGHTS,
    A_SUM_LN,
    A_SUM_LN2,
    A_MIN_RN,
    A_ODD,
    A_RDIG_DIFF,
    A_RDIG_SEEN,
) = range(11)
NUM_ACC = 11
# the summary of a file (``validate``'s int64 output)
S_BAD, S_WILD, S_FIRST_STEP_INDEX, S_LAST_STEP_INDEX, S_DENSE, S_ORDERED, S_KINDS = 0, 1, 2, 3, 4, 5, 6
# kinds 0..6 counted apart, every other value in bucket 7
NUM_KIND_BUCKETS = 8
SUMMARY_SIZE = S_KINDS + NUM_KIND_BUCKETS
# a cell's code: (file index << 40) | record index
CELL_SHIFT = 40


@numba.njit(cache=True, nogil=True)
def validate(words, weights, rank, max_step, mask, summary):  # pragma: no cover - compiled
    """Checksum, magic and rank of every record into ``mask``; the file's shape into ``summary``."""
    num, width = words.shape
    bad = 0
    wild = -1
    first_i = -1
    last_i = -1
    dense = num > 0
    ordered = True
    prev_step = np.int64(-1)
    have_prev = False
    last_step_step = np.int64(-1)
    first_step = np.int64(0)
    for kind_bucket in range(NUM_KIND_BUCKETS):
        summary[S_KINDS + kind_bucket] = 0
    for i in range(num):
        total = np.uint64(0)
        for t in range(width - 1):
            total += weights[t] * words[i, t]
        z = total + _GOLDEN
        z = (z ^ (z >> _SH30)) * _M1
        z = (z ^ (z >> _SH27)) * _M2
        z = z ^ (z >> _SH31)
        w0 = words[i, 0]
        ok = z == words[i, width - 1] and (w0 & _U32) == _MAGIC and (words[i, 2] & _U32) == np.uint64(rank)
        mask[i] = ok
        if not ok:
            bad += 1
            dense = False
            continue
        step = np.int64(words[i, 1])
        if (step < 0 or step > max_step) and wild < 0:
            wild = i
        kind = (w0 >> _SH32) & _U16
        bucket = np.int64(kind) if kind < np.uint64(NUM_KIND_BUCKETS - 1) else NUM_KIND_BUCKETS - 1
        summary[S_KINDS + bucket] += 1
        if have_prev and step < prev_step:
            ordered = False
        prev_step = step
        have_prev = True
        if kind == _STEP:
            if last_i >= 0 and step <= last_step_step:
                ordered = False
            if first_i < 0:
                first_i = i
                first_step = step
            last_i = i
            last_step_step = step
            if dense and step != first_step + i:
                dense = False
        else:
            dense = False
    summary[S_BAD] = bad
    summary[S_WILD] = wild
    summary[S_FIRST_STEP_INDEX] = first_i
    summary[S_LAST_STEP_INDEX] = last_i
    summary[S_DENSE] = 1 if dense else 0
    summary[S_ORDERED] = 1 if ordered else 0


@numba.njit(cache=True, nogil=True)
def next_step(words, mask, all_valid, index, pos):  # pragma: no cover - compiled
    """``(index, step)`` of the first valid STEP record at or after ``index`` with a step >= ``pos``
    (``(len, -1)`` if none)."""
    num = words.shape[0]
    for i in range(index, num):
        if not all_valid and not mask[i]:
            continue
        if ((words[i, 0] >> _SH32) & _U16) == _STEP and np.int64(words[i, 1]) >= pos:
            return i, np.int64(words[i, 1])
    return num, np.int64(-1)


@numba.njit(cache=True, nogil=True)
def gather(
    words,
    f32,
    f64,
    mask,
    all_valid,
    dense_first,
    index,
    w_lo,
    w_hi,
    col,
    code,
    k,
    full,
    hints,
    bits,
    wdig,
    cell,
    racc,
    sk,
    rdig,
    loss,
    local_norm_cells,
    out,
):  # pragma: no cover - compiled
    """Put one file's STEP records of steps ``[w_lo, w_hi)`` into the window's cells and rows.

    A dense file (``dense_first >= 0``) is indexed by arithmetic; any other (ordered: steps of
    valid records never decrease, STEP steps increase) is read from ``index`` on, up to its first
    valid record of a step >= ``w_hi``. ``out`` gets ``(next index, next STEP step >= w_hi or -1)``.
    A cell already present (files come latest attempt first) is marked superseded instead.
    With ``hints``, each cell's loss and local gradient norm are kept for :func:`outlier_rows`.
    One loop, no helper call: a call per record costs reference counting of every array.
    """
    num = words.shape[0]
    dense = dense_first >= 0
    if dense:
        i = max(w_lo - dense_first, 0)
        stop = min(w_hi - dense_first, num)
    else:
        i = index
        stop = num
    while i < stop:
        if not dense:
            if not all_valid and not mask[i]:
                i += 1
                continue
            step = np.int64(words[i, 1])
            if step >= w_hi:
                break
            if ((words[i, 0] >> _SH32) & _U16) != _STEP or step < w_lo:
                i += 1
                continue
            s = step - w_lo
        else:
            s = dense_first + i - w_lo
        if bits[col, s] & PRESENT:
            bits[col, s] |= SUPERSEDED
            i += 1
            continue
        racc[s, A_PRESENT] += 1.0
        cell[col, s] = code | i
        if not full:
            bits[col, s] = PRESENT
            i += 1
            continue
        flags = (words[i, 0] >> _SH48) & _U16
        grads = (flags & _HAS_GRADS) != 0
        has_w = (flags & _HAS_WEIGHTS) != 0
        cell_bits = PRESENT
        if grads:
            cell_bits |= GRADS
            racc[s, A_GRADS] += 1.0
        if has_w:
            cell_bits |= WEIGHTS
        bits[col, s] = cell_bits
        wdig[col, s] = words[i, 12]
        if (words[i, 8] >> _SH32) != 0:
            racc[s, A_NF_LOCAL] = 1.0
        if (words[i, 9] & _U32) != 0:
            racc[s, A_NF_REDUCED] = 1.0
        if has_w and (words[i, 9] >> _SH32) != 0:
            racc[s, A_NF_WEIGHTS] = 1.0
        local_norm = np.float64(f32[i, 26])
        reduced_norm = np.float64(f32[i, 27])
        if hints:
            loss[col, s] = f64[i, 4]
            local_norm_cells[col, s] = f32[i, 26]
        racc[s, A_SUM_LN] += local_norm
        racc[s, A_SUM_LN2] += local_norm * local_norm
        if abs(reduced_norm) < racc[s, A_MIN_RN]:
            racc[s, A_MIN_RN] = abs(reduced_norm)
        odd = not (np.isfinite(local_norm) and np.isfinite(reduced_norm))
        for j in range(k):
            x = np.float64(f32[i, 36 + j])
            y = np.float64(f32[i, 36 + k + j])
            sk[s, 0, j] += x
            sk[s, 1, j] += abs(x)
            if y > sk[s, 2, j]:
                sk[s, 2, j] = y
            if y < sk[s, 3, j]:
                sk[s, 3, j] = y
            if not (np.isfinite(x) and np.isfinite(y)):
                odd = True
        if odd:
            racc[s, A_ODD] = 1.0
        if grads:
            if racc[s, A_RDIG_SEEN] == 0.0:
                rdig[s] = words[i, 11]
                racc[s, A_RDIG_SEEN] = 1.0
            elif rdig[s] != words[i, 11]:
                racc[s, A_RDIG_DIFF] = 1.0
        i += 1
    if dense:
        out[0] = max(stop, index)
        out[1] = dense_first + out[0] if out[0] < num else -1
        return
    out[0] = i
    out[1] = -1
    while i < num:
        if (all_valid or mask[i]) and ((words[i, 0] >> _SH32) & _U16) == _STEP:
            out[1] = np.int64(words[i, 1])
            break
        i += 1


@numba.njit(cache=True, nogil=True)
def rows(
    w_lo, bits, wdig, racc, sk, rel_tol, mean, full, state, diverged, events, pre_diverged, pre_last
):  # pragma: no cover - compiled
    """Per step of a window: which checks may fire (``events``), and replica weight divergence.

    Cells are ``(R, S)`` (rank-major, as the files fill them). The all-reduce test is a filter:
    a step is an event when its largest residual, plus a bound on what a different summation
    order can change, reaches its smallest tolerance, less the same bound; triage re-checks
    every event step with numpy, so no step it would report is missed and none is reported
    that it would not. The weight vote is exact (integers): the strict majority (Boyer-Moore,
    then a count), onsets against the divergence carried in ``diverged``; ``state`` = ``[last
    checked step or -1, first step or -1, steps checked, superseded cells, cells with
    gradients]`` carried across windows. ``pre_diverged`` / ``pre_last`` keep the state before
    each step (read at weight events).
    """
    num_ranks, num_steps = bits.shape
    k = sk.shape[2]
    unit = 2.0**-53
    slack = 8.0 * (num_ranks + 8) * unit
    divisor = np.float64(num_ranks) if mean else 1.0
    if full:
        # replica weights, rank-major passes: the strict majority of the cells holding post-update weights
        num_w = np.zeros(num_steps, dtype=np.int64)
        run = np.zeros(num_steps, dtype=np.int64)
        votes = np.zeros(num_steps, dtype=np.int64)
        candidate = np.zeros(num_steps, dtype=np.uint64)
        onset = np.zeros(num_steps, dtype=np.bool_)
        for r in range(num_ranks):
            for s in range(num_steps):
                b = bits[r, s]
                if b & SUPERSEDED:
                    state[3] += 1
                if b & WEIGHTS:
                    num_w[s] += 1
                    if run[s] == 0:
                        candidate[s] = wdig[r, s]
                        run[s] = 1
                    elif wdig[r, s] == candidate[s]:
                        run[s] += 1
                    else:
                        run[s] -= 1
        for r in range(num_ranks):
            for s in range(num_steps):
                if bits[r, s] & WEIGHTS and wdig[r, s] == candidate[s]:
                    votes[s] += 1
        for r in range(num_ranks):
            div = diverged[r]
            for s in range(num_steps):
                pre_diverged[r, s] = div
                if num_w[s] >= 2 and votes[s] * 2 > num_w[s]:
                    has_w = (bits[r, s] & WEIGHTS) != 0
                    now = has_w and wdig[r, s] != candidate[s]
                    if now and not div:
                        onset[s] = True
                    div = now or (div and not has_w)
            diverged[r] = div
    for s in range(num_steps):
        count = racc[s, A_PRESENT]
        pre_last[s] = state[0]
        if count == 0.0:
            events[s] = 0
            continue
        step = w_lo + s
        if state[1] < 0:
            state[1] = step
        event = 0
        if count < num_ranks:
            event |= EV_HOLE
        if not full:
            events[s] = event
            continue
        state[4] += np.int64(racc[s, A_GRADS])
        if racc[s, A_NF_LOCAL] != 0.0 or racc[s, A_NF_REDUCED] != 0.0 or racc[s, A_NF_WEIGHTS] != 0.0:
            event |= EV_NONFINITE
        if racc[s, A_GRADS] == num_ranks and racc[s, A_NF_LOCAL] == 0.0:
            if racc[s, A_ODD] != 0.0 or racc[s, A_RDIG_DIFF] != 0.0:
                event |= EV_ALLREDUCE
            else:
                residual = 0.0
                spread = 0.0
                for j in range(k):
                    expected = sk[s, 0, j] / divisor
                    residual = max(residual, abs(sk[s, 2, j] - expected), abs(sk[s, 3, j] - expected))
                    spread = max(spread, sk[s, 1, j] / divisor)
                local_part = racc[s, A_SUM_LN2] / (divisor * divisor)
                cap = racc[s, A_SUM_LN] / divisor * (1.0 + 1e-2)
                reduced = min(racc[s, A_MIN_RN], cap)
                tol = rel_tol * np.sqrt(reduced * reduced + local_part)
                if not (residual + slack * (spread + residual) < tol * (1.0 - slack)):
                    event |= EV_ALLREDUCE
        if num_w[s] >= 2:
            state[2] += 1
            if votes[s] * 2 <= num_w[s] or onset[s]:
                event |= EV_WEIGHTS
            state[0] = step
        events[s] = event


@numba.njit(cache=True, nogil=True)
def _median(values, n):  # pragma: no cover - compiled
    """Median of ``values[:n]`` (finite), as numpy's: the middle order statistic, or the mean of
    the two. Quickselect in place (np.partition compiles for seconds; this in a fraction)."""
    kth = n // 2
    lo, hi = 0, n - 1
    while lo < hi:
        pivot = values[(lo + hi) // 2]
        i, j = lo, hi
        while i <= j:
            while values[i] < pivot:
                i += 1
            while values[j] > pivot:
                j -= 1
            if i <= j:
                values[i], values[j] = values[j], values[i]
                i += 1
                j -= 1
        if kth <= j:
            hi = j
        elif kth >= i:
            lo = i
        else:
            break
    upper = values[kth]
    if n % 2:
        return upper
    lower = values[0]
    # everything left of kth is <= values[kth]: the lower middle is their max
    for i in range(1, kth):
        lower = max(lower, values[i])
    return (lower + upper) / 2.0


@numba.njit(cache=True, nogil=True)
def outlier_rows(bits, loss, local_norm, threshold, events, s_lo, s_hi):  # pragma: no cover - compiled
    """Flag (``EV_OUTLIER``) the steps ``s_lo .. s_hi - 1`` where triage's outlier hint may fire:
    a present loss or local gradient norm that is infinite, or whose robust z-score (median / MAD
    over the ranks' finite values) may exceed ``threshold`` while it is farther from the median
    than the median from zero. A filter with a margin, as for the all-reduce: triage re-checks
    flagged steps. Steps are read in blocks turned step-major (a rank-major column read step by
    step would touch a page per rank). Disjoint step ranges may run on threads at once."""
    num_ranks = bits.shape[0]
    block = 64
    present = np.empty((block, num_ranks), dtype=np.bool_)
    cells = np.empty((2, block, num_ranks), dtype=np.float64)
    values = np.empty(num_ranks, dtype=np.float64)
    deviation = np.empty(num_ranks, dtype=np.float64)
    margin = 1e-6
    for b_lo in range(s_lo, s_hi, block):
        b_hi = min(b_lo + block, s_hi)
        for r in range(num_ranks):
            for s in range(b_lo, b_hi):
                present[s - b_lo, r] = (bits[r, s] & PRESENT) != 0
                cells[0, s - b_lo, r] = loss[r, s]
                cells[1, s - b_lo, r] = local_norm[r, s]
        for s in range(b_lo, b_hi):
            for field in range(2):
                n = 0
                overflow = False
                for r in range(num_ranks):
                    if present[s - b_lo, r]:
                        v = cells[field, s - b_lo, r]
                        if np.isinf(v):
                            overflow = True
                        elif v == v:
                            values[n] = v
                            n += 1
                if overflow:
                    events[s] |= EV_OUTLIER
                    break
                if n == 0:
                    continue
                med = _median(values, n)
                for i in range(n):
                    deviation[i] = abs(values[i] - med)
                mad = _median(deviation, n)
                scale = 1.4826 * mad + 1e-6 * abs(med) + 1e-30
                hit = False
                for i in range(n):
                    if deviation[i] > scale * threshold * (1.0 - margin) and deviation[i] > abs(med) * (1.0 - margin):
                        hit = True
                        break
                if hit:
                    events[s] |= EV_OUTLIER
                    break
