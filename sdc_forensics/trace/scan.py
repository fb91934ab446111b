"""The compiled trace scan: record checksums and step windows by numba loops, numpy as fallback.

:mod:`~sdc_forensics.trace.reader` and :mod:`~sdc_forensics.triage.trace_only` call this module;
``docs/trace-scan.md`` says why it is built this way. Two loops over the rank files' raw words
(``scan_kernels.py``):

* :func:`validate` checks every record (checksum, magic, rank) and summarises the file in the
  same pass: its first and last STEP records, whether it is dense (only STEP records of
  consecutive steps) or at least ordered (steps never go back), and how many records of each
  kind it holds.
* :class:`StepScan` walks ``window``-step windows of ``(steps x ranks)`` cells without copying
  records into tables: per cell only a few bits, the weights digest and where the record is;
  per step the sums the checks need. A row-kernel then runs the replica-weight vote exactly and
  flags the steps where a check may fire; triage re-reads only those steps through the numpy
  checks (:meth:`StepScan.exact_window`), so its evidence is the numpy path's, byte for byte.

numba is optional at run time. ``SDC_FORENSICS_KERNELS`` chooses: ``auto`` (default) compiles
for traces of at least :data:`AUTO_MIN_RECORDS` records (below that numpy is done before numba
has loaded its cache: about 0.5 s, and a few seconds for the very first compile on a machine),
``on`` for any trace, ``off`` (also ``0``, ``no``, ``false``, ``numpy``) never. Without numba,
or turned off, every caller takes its numpy path. Files whose records go back in step (never
written by the recorder) always take the numpy path.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Iterator

import numpy as np

from sdc_forensics.trace import format as F
from sdc_forensics.trace.windows import StepWindow

log = logging.getLogger(__name__)

#: Environment variable that turns the compiled kernels off (``off``, ``0``, ``no``, ``false``, ``numpy``).
KERNELS_ENV = "SDC_FORENSICS_KERNELS"
_OFF = frozenset({"off", "0", "no", "false", "numpy"})
_ON = frozenset({"on", "1", "yes", "true", "numba"})
NUMBA = "numba"
NUMPY = "numpy"
#: Under ``auto``, traces of fewer records (all rank files together) take the numpy path.
AUTO_MIN_RECORDS = 1 << 20


def _mode() -> str:
    value = os.environ.get(KERNELS_ENV, "").strip().lower()
    return "off" if value in _OFF else "on" if value in _ON else "auto"


def kernels_enabled() -> bool:
    """False when ``SDC_FORENSICS_KERNELS`` turns the compiled kernels off."""
    return _mode() != "off"


@functools.lru_cache(maxsize=1)
def _import_kernels():
    try:
        from sdc_forensics.trace import scan_kernels
    # numba missing or broken: the numpy path does the same work
    except ImportError as exc:
        log.info("trace scan: numba unavailable (%s); using numpy", exc)
        return None
    return scan_kernels


def kernels():
    """The compiled kernels module, or None (numba missing, or turned off by the environment)."""
    return _import_kernels() if kernels_enabled() else None


def kernels_for(num_records: int):
    """The kernels for a trace of ``num_records`` records, or None (see the module doc)."""
    mode = _mode()
    if mode == "off" or (mode == "auto" and num_records < AUTO_MIN_RECORDS):
        return None
    return _import_kernels()


def scan_path(num_records: int = AUTO_MIN_RECORDS) -> str:
    """``numba`` or ``numpy``: the path a scan of ``num_records`` records started now would take."""
    return NUMBA if kernels_for(num_records) is not None else NUMPY


#: Threads for the kernels that split cleanly (files; disjoint step ranges): numba releases the GIL.
THREADS = max(1, min(4, os.cpu_count() or 1))


_POOL: dict[int, object] = {}


def _pool():
    """This process's thread pool (a forked child gets its own: the parent's threads are not in it)."""
    from concurrent.futures import ThreadPoolExecutor

    pid = os.getpid()
    if pid not in _POOL:
        _POOL.clear()
        _POOL[pid] = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="sdc-scan")
    return _POOL[pid]


def _on_threads(kernel, num_steps: int, *args) -> None:
    """``kernel(*args, s_lo, s_hi)`` over ``[0, num_steps)`` split across :data:`THREADS` threads."""
    parts = min(THREADS, max(1, num_steps // 64))
    bounds = [num_steps * i // parts for i in range(parts + 1)]
    if parts == 1:
        kernel(*args, 0, num_steps)
        return
    for future in [_pool().submit(kernel, *args, lo, hi) for lo, hi in zip(bounds, bounds[1:])]:
        future.result()


def map_files(function, items: list) -> list:
    """``[function(item) for item in items]`` on :data:`THREADS` threads (for nogil kernels)."""
    if THREADS == 1 or len(items) < 2:
        return [function(item) for item in items]
    return list(_pool().map(function, items))


# ---------------------------------------------------------------------------------------------
# Record validation


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileSummary:
    """What :func:`validate` learnt about one rank file (positions are record indices)."""

    num_records: int
    num_bad: int
    # first valid record whose step is outside 0..MAX_STEP, -1 if none
    wild_index: int
    # first valid STEP record, -1 if none
    first_step_index: int
    last_step_index: int
    # every record a valid STEP record, steps consecutive
    dense: bool
    # valid records' steps never decrease, valid STEP records' steps increase
    ordered: bool
    # valid records of kind 0..6, then of any other kind
    kind_counts: tuple[int, ...]

    def count(self, kind: int) -> int:
        """Valid records of ``kind``."""
        return self.kind_counts[kind] if 0 <= kind < len(self.kind_counts) - 1 else self.kind_counts[-1]


def _words(records: np.ndarray) -> np.ndarray:
    """``(N, record words)`` uint64 view of structured records (no copy)."""
    return records.view(np.uint64).reshape(len(records), records.dtype.itemsize // 8)


def validate(records: np.ndarray, rank: int) -> tuple[np.ndarray, FileSummary]:
    """Validity of every record of one rank file, and its :class:`FileSummary` (compiled kernel).

    Args:
        records: the file's complete records, a contiguous structured array.
        rank: the rank its name says (a record of another rank is invalid).

    Returns:
        ``(mask (N,) bool, summary)``; the mask equals the numpy path's
        (``format.checksums(r) == r["checksum"]``, magic, rank).
    """
    K = _import_kernels()
    assert K is not None, "validate() needs the compiled kernels"
    words = _words(records)
    mask = np.empty(len(records), dtype=bool)
    summary = np.zeros(K.SUMMARY_SIZE, dtype=np.int64)
    if len(records):
        K.validate(words, F._weights(words.shape[1] - 1), rank, F.MAX_STEP, mask, summary)
    return mask, FileSummary(
        num_records=len(records),
        num_bad=int(summary[K.S_BAD]),
        wild_index=int(summary[K.S_WILD]) if len(records) else -1,
        first_step_index=int(summary[K.S_FIRST_STEP_INDEX]) if len(records) else -1,
        last_step_index=int(summary[K.S_LAST_STEP_INDEX]) if len(records) else -1,
        dense=bool(summary[K.S_DENSE]),
        ordered=bool(summary[K.S_ORDERED]) or not len(records),
        kind_counts=tuple(int(c) for c in summary[K.S_KINDS :]),
    )


# ---------------------------------------------------------------------------------------------
# Step windows


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScanWindow:
    """The cells of steps ``w_lo .. w_lo + S - 1`` (steps nobody recorded are empty rows).

    Attributes:
        w_lo: first step.
        bits: ``(R, S)`` uint8 cell bits (``scan_kernels.PRESENT``, ``GRADS``, ``WEIGHTS``,
            ``SUPERSEDED``), rank-major as the files fill them.
        cells: ``(R, S)`` int64 ``(file index << 40) | record index`` where present.
        events: ``(S,)`` uint8 ``scan_kernels.EV_*``: the checks that may fire at each step.
        pre_diverged: ``(R, S)`` bool, replica divergence before each step.
        pre_last: ``(S,)`` int64, the last weights-checked step before each weight-event step (-1: none).
    """

    w_lo: int
    bits: np.ndarray
    cells: np.ndarray
    events: np.ndarray
    pre_diverged: np.ndarray
    pre_last: np.ndarray

    @property
    def present(self) -> np.ndarray:
        """``(S, R)`` bool (a view), as :attr:`StepWindow.present`."""
        return ((self.bits & 1) != 0).T

    @property
    def steps(self) -> np.ndarray:
        return np.arange(self.w_lo, self.w_lo + self.bits.shape[1], dtype=np.int64)


class _File:
    __slots__ = ("rank_file", "words", "f32", "f64", "mask", "all_valid", "dense_first", "index", "next")

    def __init__(self, rank_file, mask: np.ndarray, summary: FileSummary, dense_first: int | None) -> None:
        recs = rank_file.records
        self.rank_file = rank_file
        self.words = _words(recs)
        self.f32 = recs.view(np.float32).reshape(len(recs), recs.dtype.itemsize // 4)
        self.f64 = recs.view(np.float64).reshape(len(recs), recs.dtype.itemsize // 8)
        self.all_valid = summary.num_bad == 0
        self.mask = np.zeros(1, dtype=bool) if self.all_valid else np.ascontiguousarray(mask, dtype=bool)
        self.dense_first = -1 if dense_first is None else dense_first
        self.index = 0
        self.next = -1


class StepScan:
    """Windows of cells over steps ``lo..hi`` of a trace (see the module doc). Use :meth:`open`.

    After iterating: :attr:`num_checked` (steps whose replica weights were compared),
    :attr:`superseded` (cells an earlier attempt also recorded), :attr:`has_gradients`,
    :attr:`first_step` (first step recorded in the range, None if none).
    """

    def __init__(self, trace, files: list[_File], lo: int, hi: int, window: int, full: bool) -> None:
        self.trace = trace
        self.files = files
        self.lo, self.hi, self.window, self.full = lo, hi, window, full
        #: a robust z-score above which outlier hints are flagged; None: no outlier flags
        self.outlier_z: float | None = None
        self.num_ranks = trace.world_size
        self.k = trace.sketch_k
        self._state = np.array([-1, -1, 0, 0, 0], dtype=np.int64)
        self._diverged = np.zeros(self.num_ranks, dtype=bool)
        grad_dtype = trace.manifest.fingerprint.grad_dtype
        from sdc_forensics.fingerprint import tolerance

        self._rel_tol = tolerance.relative_tolerance(grad_dtype, self.num_ranks) if full else 0.0
        self._mean = trace.manifest.reduction == "mean"

    @classmethod
    def open(cls, trace, lo: int, hi: int, window: int, *, full: bool = True) -> "StepScan | None":
        """A scan of steps ``lo..hi`` (inclusive), or None where the numpy path must be taken
        (kernels off or missing, or a file whose steps go back).

        Args:
            full: gather what triage checks; False: only which cells are present (for holes).
        """
        K = trace.kernels()
        if K is None:
            return None
        files = []
        for rank_file in trace.files:
            if rank_file.rank >= trace.world_size or not len(rank_file.records):
                continue
            mask = trace.valid_mask(rank_file)
            summary = trace.file_summary(rank_file)
            if summary is None or not summary.ordered:
                return None
            files.append(_File(rank_file, mask, summary, trace._dense_first_step(rank_file)))
        # latest attempt first: the first file to fill a cell holds it, later ones mark it superseded
        files.sort(key=lambda f: (-f.rank_file.attempt, f.rank_file.rank))
        for f in files:
            if f.dense_first >= 0:
                f.index = min(max(lo - f.dense_first, 0), len(f.words))
                f.next = f.dense_first + f.index if f.index < len(f.words) else -1
            else:
                f.index, f.next = (int(v) for v in K.next_step(f.words, f.mask, f.all_valid, 0, lo))
        return cls(trace, files, lo, hi, window, full)

    @property
    def num_checked(self) -> int:
        return int(self._state[2])

    @property
    def superseded(self) -> int:
        return int(self._state[3])

    @property
    def has_gradients(self) -> bool:
        return bool(self._state[4] > 0)

    @property
    def first_step(self) -> int | None:
        return None if self._state[1] < 0 else int(self._state[1])

    def __iter__(self) -> Iterator[ScanWindow]:
        K = _import_kernels()
        R, k, full = self.num_ranks, self.k, self.full
        dummy_u64 = np.zeros((1, 1), dtype=np.uint64)
        dummy_sk = np.zeros((1, 4, 1), dtype=np.float64)
        dummy_f64 = np.zeros((1, 1), dtype=np.float64)
        dummy_f32 = np.zeros((1, 1), dtype=np.float32)
        while True:
            starts = [f.next for f in self.files if 0 <= f.next <= self.hi]
            if not starts:
                return
            w_lo = min(starts)
            w_hi = min(w_lo + self.window, self.hi + 1)
            S = w_hi - w_lo
            # rank-major: each file fills a contiguous run
            bits = np.zeros((R, S), dtype=np.uint8)
            cells = np.empty((R, S), dtype=np.int64)
            wdig = np.empty((R, S), dtype=np.uint64) if full else dummy_u64
            hints = full and self.outlier_z is not None
            if hints:
                loss = np.zeros((R, S), dtype=np.float64)
                local_norm = np.zeros((R, S), dtype=np.float32)
            else:
                loss, local_norm = dummy_f64, dummy_f32
            active = [(code, f) for code, f in enumerate(self.files) if 0 <= f.next < w_hi]
            # threads split the files by rank (a rank's attempts stay in one thread, latest first);
            # each has its own per-step sums, merged below (cells are per rank: never shared)
            groups = [[(c, f) for c, f in active if f.rank_file.rank % THREADS == t] for t in range(THREADS)]
            groups = [g for g in groups if g] or [[]]

            def run(group):
                racc = np.zeros((S, K.NUM_ACC), dtype=np.float64)
                racc[:, K.A_MIN_RN] = np.inf
                if full:
                    sk = np.zeros((S, 4, k), dtype=np.float64)
                    sk[:, 2] = -np.inf
                    sk[:, 3] = np.inf
                else:
                    sk = dummy_sk
                rdig = np.zeros(S, dtype=np.uint64)
                out = np.zeros(2, dtype=np.int64)
                for code, f in group:
                    K.gather(
                        f.words,
                        f.f32,
                        f.f64,
                        f.mask,
                        f.all_valid,
                        f.dense_first,
                        f.index,
                        w_lo,
                        w_hi,
                        f.rank_file.rank,
                        code << K.CELL_SHIFT,
                        k,
                        full,
                        hints,
                        bits,
                        wdig,
                        cells,
                        racc,
                        sk,
                        rdig,
                        loss,
                        local_norm,
                        out,
                    )
                    f.index, f.next = int(out[0]), int(out[1])
                return racc, sk, rdig

            racc, sk, rdig = _merge(K, map_files(run, groups) if len(groups) > 1 else [run(groups[0])], full)
            events = np.empty(S, dtype=np.uint8)
            pre_diverged = np.empty((R, S), dtype=bool) if full else np.zeros((1, 1), dtype=bool)
            pre_last = np.empty(S, dtype=np.int64)
            K.rows(
                w_lo,
                bits,
                wdig,
                racc,
                sk,
                self._rel_tol,
                self._mean,
                full,
                self._state,
                self._diverged,
                events,
                pre_diverged,
                pre_last,
            )
            # triage gives no outlier hints below 4 ranks
            if hints and R >= 4:
                _on_threads(K.outlier_rows, S, bits, loss, local_norm, float(self.outlier_z), events)
            yield ScanWindow(
                w_lo=w_lo, bits=bits, cells=cells, events=events, pre_diverged=pre_diverged, pre_last=pre_last
            )

    def exact_window(self, window: ScanWindow, rows: np.ndarray, fields: tuple[str, ...]) -> StepWindow:
        """The :class:`StepWindow` of ``rows`` of ``window`` with ``fields``, exactly as
        :meth:`Trace.step_windows` builds it (the numpy checks run on it)."""
        K = _import_kernels()
        full = F.record_dtype(self.k)
        wanted = set(("step", "rank", *fields))
        # record order: assignment is by position
        names = [name for name in full.names if name in wanted]
        dtype = np.dtype([(name, full.fields[name][0]) for name in names])
        # (E, R)
        bits = window.bits[:, rows].T
        present = (bits & K.PRESENT) != 0
        table = np.zeros(bits.shape, dtype=dtype)
        attempt = np.full(bits.shape, -1, dtype=np.int32)
        cells = window.cells[:, rows].T
        codes = np.where(present, cells >> K.CELL_SHIFT, -1)
        for code in np.unique(codes[present]):
            take = codes == code
            f = self.files[int(code)]
            table[take] = f.rank_file.records[cells[take] & ((1 << K.CELL_SHIFT) - 1)][names]
            attempt[take] = f.rank_file.attempt
        return StepWindow(
            steps=window.w_lo + np.asarray(rows, dtype=np.int64),
            present=present,
            attempt=attempt,
            superseded=(bits & K.SUPERSEDED) != 0,
            records=table,
        )


def _merge(K, parts: list, full: bool):
    """One thread's per-step sums, from several threads' ``(racc, sk, rdig)``."""
    racc, sk, rdig = parts[0]
    for other_racc, other_sk, other_rdig in parts[1:]:
        both = (racc[:, K.A_RDIG_SEEN] != 0) & (other_racc[:, K.A_RDIG_SEEN] != 0)
        differ = both & (rdig != other_rdig)
        rdig = np.where(racc[:, K.A_RDIG_SEEN] != 0, rdig, other_rdig)
        for column in (K.A_PRESENT, K.A_GRADS, K.A_SUM_LN, K.A_SUM_LN2):
            racc[:, column] += other_racc[:, column]
        for column in (K.A_NF_LOCAL, K.A_NF_REDUCED, K.A_NF_WEIGHTS, K.A_ODD, K.A_RDIG_SEEN, K.A_RDIG_DIFF):
            racc[:, column] = np.maximum(racc[:, column], other_racc[:, column])
        racc[:, K.A_RDIG_DIFF] = np.maximum(racc[:, K.A_RDIG_DIFF], differ)
        racc[:, K.A_MIN_RN] = np.fmin(racc[:, K.A_MIN_RN], other_racc[:, K.A_MIN_RN])
        if full:
            sk[:, 0:2] += other_sk[:, 0:2]
            sk[:, 2] = np.maximum(sk[:, 2], other_sk[:, 2])
            sk[:, 3] = np.minimum(sk[:, 3], other_sk[:, 3])
    return racc, sk, rdig
