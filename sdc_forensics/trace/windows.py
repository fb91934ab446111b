"""Step windows: ``(steps x ranks)`` tables of STEP records, built from the rank files by cursors.

:meth:`Trace.step_windows <sdc_forensics.trace.reader.Trace.step_windows>` is the public entry;
this module holds the scan. Each rank file (one per rank and attempt) has a cursor; records
before it are done. A window starts at the next step that some rank recorded and ends before the
first step that no rank recorded (or after ``window`` steps), so the work and the memory follow
the records the files hold, never the span their step numbers declare: two records at steps 0
and 2^53 make two one-step windows, not 2^43 empty ones. A dense file (valid STEP records of
consecutive steps, nothing else) is indexed by arithmetic; any other is searched in chunks.

numpy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from sdc_forensics.trace import format as F

CHUNK_RECORDS = 1 << 16
_STEP = int(F.Kind.STEP)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepWindow:
    """STEP records of the consecutive steps ``steps[0] .. steps[-1]`` for all ranks.

    Attributes:
        steps: ``(S,)`` int64 step numbers, consecutive; at least one rank recorded each.
        present: ``(S, R)`` bool, a valid STEP record exists.
        attempt: ``(S, R)`` int32, the attempt each cell was taken from (-1 if absent).
        superseded: ``(S, R)`` bool, an earlier attempt also recorded this cell.
        records: ``(S, R)`` structured records (zeros where absent).
    """

    steps: np.ndarray
    present: np.ndarray
    attempt: np.ndarray
    superseded: np.ndarray
    records: np.ndarray


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Part:
    """What a cursor holds for one window: records ``[start, end)`` of its file."""

    start: int
    end: int
    # (end - start,) step of each record
    steps: np.ndarray
    # (end - start,) bool: valid record of any kind (bounds the next window)
    usable: np.ndarray
    # (end - start,) bool: valid STEP record of a step in the window's range
    wanted: np.ndarray


class _Cursor:
    """Scan position in one rank file."""

    def __init__(self, rank_file, mask: np.ndarray, dense_first: int | None) -> None:
        self.file = rank_file
        self.recs = rank_file.records
        self.mask = mask
        self.dense_first = dense_first
        self.index = 0

    @property
    def remaining(self) -> int:
        return len(self.recs) - self.index

    def next_step(self, pos: int) -> int | None:
        """The first recorded step >= ``pos`` from the cursor on (skipping what is before it)."""
        n = len(self.recs)
        if self.dense_first is not None:
            self.index = min(max(pos - self.dense_first, self.index, 0), n)
            return None if self.index >= n else self.dense_first + self.index
        probe = 256
        while self.index < n:
            end = min(n, self.index + probe)
            steps = self.recs["step"][self.index : end]
            hits = np.flatnonzero(
                self.mask[self.index : end] & (self.recs["kind"][self.index : end] == _STEP) & (steps >= pos)
            )
            if hits.size:
                self.index += int(hits[0])
                return int(steps[hits[0]])
            self.index = end
            probe = min(probe * 8, CHUNK_RECORDS)
        return None

    def peek(self, lo: int, hi: int) -> _Part | slice:
        """Records from the cursor up to the first valid one of a step >= ``hi`` (not consumed).

        Returns a slice of record indices for a dense file, else a :class:`_Part`.
        """
        if self.dense_first is not None:
            return slice(
                max(lo - self.dense_first, self.index), max(min(hi - self.dense_first, len(self.recs)), self.index)
            )
        n, end, probe = len(self.recs), self.index, 4096
        while end < n:
            chunk = min(n, end + probe)
            beyond = np.flatnonzero((self.recs["step"][end:chunk] >= hi) & self.mask[end:chunk])
            if beyond.size:
                end += int(beyond[0])
                break
            end = chunk
            probe = min(probe * 2, CHUNK_RECORDS)
        recs, usable = self.recs[self.index : end], self.mask[self.index : end]
        steps = recs["step"]
        wanted = usable & (recs["kind"] == _STEP) & (steps >= lo) & (steps < hi)
        return _Part(start=self.index, end=end, steps=steps, usable=usable, wanted=wanted)

    def advance(self, part: _Part | slice, step_hi: int) -> None:
        """Move past every record of a step < ``step_hi`` in ``part``."""
        if isinstance(part, slice):
            self.index = min(max(step_hi - self.dense_first, self.index), len(self.recs))
            return
        beyond = np.flatnonzero(part.usable & (part.steps >= step_hi))
        self.index = part.start + int(beyond[0]) if beyond.size else part.end


def iter_windows(
    files: Sequence[tuple[object, np.ndarray, int | None]],
    *,
    num_ranks: int,
    dtype: np.dtype,
    lo: int,
    hi: int,
    window: int,
) -> Iterator[StepWindow]:
    """Yield the windows of steps ``lo..hi`` (inclusive) that hold records.

    Args:
        files: ``(rank_file, valid mask, dense first step or None)`` per rank file, any order;
            files of ranks >= ``num_ranks`` are skipped.
        num_ranks: columns of every table (the manifest's world size).
        dtype: the (possibly reduced) record dtype of the tables; its fields in record order.
        lo, hi: inclusive step bounds.
        window: the most steps one table holds (``window x num_ranks`` cells).
    """
    names = list(dtype.names)
    # later attempts are filled last, so they win a cell both recorded
    ordered = sorted((f for f in files if f[0].rank < num_ranks), key=lambda f: (f[0].attempt, f[0].rank))
    cursors = [_Cursor(rank_file, mask, dense) for rank_file, mask, dense in ordered]
    pos = lo
    while pos <= hi:
        starts = [s for s in (c.next_step(pos) for c in cursors) if s is not None and s <= hi]
        if not starts:
            return
        w_lo = min(starts)
        # a window never holds more steps than the files hold records: no table by declared span
        span = min(window, hi + 1 - w_lo, sum(c.remaining for c in cursors))
        parts = [c.peek(w_lo, w_lo + span) for c in cursors]
        occupied = np.zeros(span, dtype=bool)
        for cursor, part in zip(cursors, parts):
            if isinstance(part, slice):
                occupied[part.start + cursor.dense_first - w_lo : part.stop + cursor.dense_first - w_lo] = True
            else:
                occupied[part.steps[part.wanted] - w_lo] = True
        # up to the first step nobody recorded
        num_steps = span if occupied.all() else int(np.argmin(occupied))
        w_hi = w_lo + num_steps
        # Filled rank-major so each rank's records land in one contiguous copy; returned as (S, R) views.
        table = np.zeros((num_ranks, num_steps), dtype=dtype)
        present = np.zeros((num_ranks, num_steps), dtype=bool)
        attempt = np.full((num_ranks, num_steps), -1, dtype=np.int32)
        superseded = np.zeros((num_ranks, num_steps), dtype=bool)
        for cursor, part in zip(cursors, parts):
            row, recs = cursor.file.rank, cursor.recs
            # index by arithmetic: no search, no checks
            if isinstance(part, slice):
                first = cursor.dense_first
                lo_i, hi_i = part.start, min(part.stop, w_hi - first)
                if hi_i > lo_i:
                    cols = slice(lo_i + first - w_lo, hi_i + first - w_lo)
                    superseded[row, cols] |= present[row, cols]
                    table[row, cols] = recs[lo_i:hi_i][names]
                    present[row, cols] = True
                    attempt[row, cols] = cursor.file.attempt
            else:
                take = part.wanted & (part.steps < w_hi)
                selected = recs[part.start : part.end]
                if take.all() and len(take) == num_steps and part.steps[0] == w_lo and (np.diff(part.steps) == 1).all():
                    # the common case: one STEP record per step, nothing else
                    cols = slice(0, num_steps)
                else:
                    selected = selected[take]
                    cols = (selected["step"] - w_lo).astype(np.int64)
                superseded[row, cols] |= present[row, cols]
                # one C-level copy of the selected fields
                table[row, cols] = selected[names]
                present[row, cols] = True
                attempt[row, cols] = cursor.file.attempt
            cursor.advance(part, w_hi)
        yield StepWindow(
            steps=np.arange(w_lo, w_hi, dtype=np.int64),
            present=present.T,
            attempt=attempt.T,
            superseded=superseded.T,
            records=table.T,
        )
        pos = w_hi
