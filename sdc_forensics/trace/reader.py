"""Read a trace directory: manifest, rank files, damage, and vectorised step windows.

Files are memory-mapped read-only and never changed. Records are validated (magic and
checksum) in chunks with numpy; a torn tail or a corrupted record is reported as
:class:`Damage` and never used. :meth:`Trace.step_windows` streams ``(steps x ranks)`` tables
of STEP records, window by window, so memory is bounded by the window, not by the trace.
For a step recorded by several attempts (a resumed run), the latest attempt wins, and the
window says which attempt each cell came from.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sdc_forensics.errors import TraceError
from sdc_forensics.trace import format as F
from sdc_forensics.trace.manifest import Manifest, read_manifest

_FILE_RE = re.compile(r"^rank-(\d{5})\.attempt-(\d{3})\.sdct$")
CHUNK_RECORDS = 1 << 16
#: Damage kinds after which the trace's evidence about replicas cannot be trusted in full
#: (a record unread, a rank or steps absent): checkpoints are then ``unverified``, not clean.
UNTRUSTED_DAMAGE = frozenset({"bad_checksum", "bad_header", "missing_rank", "missing_steps"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Damage:
    """One problem found in a trace. ``record_index`` is -1 when it concerns a whole file."""

    kind: str  # torn_tail | bad_checksum | bad_header | missing_rank | missing_steps | foreign_record
    rank: int
    attempt: int = -1
    record_index: int = -1
    detail: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFile:
    """One rank file, memory-mapped. ``records`` holds only complete records (not validated)."""

    path: Path
    rank: int
    attempt: int
    records: np.ndarray
    torn_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepWindow:
    """STEP records of steps ``steps[0] .. steps[-1]`` for all ranks.

    Attributes:
        steps: ``(S,)`` int64 step numbers.
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


def step_threads(records: np.ndarray) -> np.ndarray:
    """Intra-op CPU thread count each STEP record's step ran with (``aux_value``); 0 = unknown.

    Args:
        records: structured records of any shape, e.g. ``StepWindow.records`` (``(S, R)``);
            they need the ``aux_value`` field (and ``kind``, if present, masks other kinds to 0).

    Returns:
        int64 array of ``records.shape``: 0 for traces written before the count was recorded,
        absent cells, non-STEP records and anything not a positive finite count.
    """
    value = np.asarray(records["aux_value"], dtype=np.float64)
    ok = np.isfinite(value) & (value >= 1) & (value < 2**31)
    if "kind" in records.dtype.names:
        ok &= np.asarray(records["kind"]) == int(F.Kind.STEP)
    return np.where(ok, np.rint(np.where(ok, value, 0.0)), 0).astype(np.int64)


class Trace:
    """An open trace directory. Use :meth:`open`."""

    def __init__(self, path: Path, manifest: Manifest, files: list[RankFile], damage: list[Damage]) -> None:
        self.path = path
        self.manifest = manifest
        self.files = files
        self._damage = damage
        self._validated = False
        self._valid: dict[tuple[int, int], np.ndarray] = {}
        self._dense: dict[tuple[int, int], int | None] = {}

    @classmethod
    def open(cls, trace_dir: str | os.PathLike) -> "Trace":
        """Open ``trace_dir``; raises :class:`TraceError` if it is not a usable trace."""
        path = Path(trace_dir)
        manifest = read_manifest(path)
        k = manifest.fingerprint.sketch_k
        dtype = F.record_dtype(k)
        files: list[RankFile] = []
        damage: list[Damage] = []
        for entry in sorted(path.iterdir()):
            match = _FILE_RE.match(entry.name)
            if not match:
                continue
            rank, attempt = int(match.group(1)), int(match.group(2))
            rank_file, problem = _open_rank_file(entry, rank, attempt, manifest, dtype)
            if problem:
                damage.append(problem)
            if rank_file is not None:
                files.append(rank_file)
        if not files:
            raise TraceError(f"{path} has a manifest but no readable rank files (rank-*.attempt-*.sdct)")
        ranks_seen = {f.rank for f in files}
        for rank in range(manifest.world_size):
            if rank not in ranks_seen:
                damage.append(Damage(kind="missing_rank", rank=rank, detail=f"no file for rank {rank}"))
        return cls(path, manifest, files, damage)

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def sketch_k(self) -> int:
        return self.manifest.fingerprint.sketch_k

    def valid_mask(self, rank_file: RankFile) -> np.ndarray:
        """``(N,)`` bool: records of this file whose magic and checksum are right.

        Raises:
            TraceError: a record with a right checksum holds a step outside ``0..MAX_STEP``: no
                damage does that (the checksum says it was written so), the file is foreign or
                crafted, and steps that large would overflow the step arithmetic downstream.
        """
        key = (rank_file.rank, rank_file.attempt)
        if key not in self._valid:
            recs = rank_file.records
            mask = np.empty(len(recs), dtype=bool)
            for start in range(0, len(recs), CHUNK_RECORDS):
                chunk = recs[start : start + CHUNK_RECORDS]
                ok = (F.checksums(chunk) == chunk["checksum"]) & (chunk["magic"] == F.RECORD_MAGIC) & (chunk["rank"] == rank_file.rank)
                steps = chunk["step"]
                wild = np.flatnonzero(ok & ((steps < 0) | (steps > F.MAX_STEP)))
                if wild.size:
                    index = start + int(wild[0])
                    raise TraceError(
                        f"{rank_file.path}: record {index} holds step {int(steps[wild[0]])}, outside 0..{F.MAX_STEP}, with a valid "
                        "checksum: the file was not written by sdc-forensics; remove it from the trace directory or restore it from the run"
                    )
                mask[start : start + len(chunk)] = ok
            self._valid[key] = mask
        return self._valid[key]

    def _dense_first_step(self, rank_file: RankFile) -> int | None:
        """First step when the file is dense (only valid STEP records, steps consecutive), else None.

        A dense file is indexed by arithmetic (record ``i`` holds step ``first + i``); a file with
        other record kinds, gaps or damage is read through the cursor search.
        """
        key = (rank_file.rank, rank_file.attempt)
        if key not in self._dense:
            recs, first = rank_file.records, None
            if len(recs) and self.valid_mask(rank_file).all():
                first = int(recs["step"][0])
                for start in range(0, len(recs), CHUNK_RECORDS):
                    chunk = recs[start : start + CHUNK_RECORDS]
                    expected = np.arange(first + start, first + start + len(chunk), dtype=np.int64)
                    if (chunk["kind"] != int(F.Kind.STEP)).any() or (chunk["step"] != expected).any():
                        first = None
                        break
            self._dense[key] = first
        return self._dense[key]

    def damage(self) -> list[Damage]:
        """Every problem found: file-level ones, bad records, and steps missing on some ranks."""
        if not self._validated:
            for rank_file in self.files:
                bad = np.flatnonzero(~self.valid_mask(rank_file))
                for index in bad[:1000]:
                    self._damage.append(
                        Damage(
                            kind="bad_checksum",
                            rank=rank_file.rank,
                            attempt=rank_file.attempt,
                            record_index=int(index),
                            detail=f"record {index} of {rank_file.path.name} fails its checksum; ignored",
                        )
                    )
            self._damage.extend(self._missing_steps())
            self._validated = True
        return list(self._damage)

    def _missing_steps(self) -> list[Damage]:
        missing: dict[int, list[int]] = {}
        for window in self.step_windows(fields=()):
            any_present = window.present.any(axis=1)  # (S,)
            holes = window.present[any_present] == False  # noqa: E712  (S', R)
            steps = window.steps[any_present]
            for rank in np.flatnonzero(holes.any(axis=0)):
                missing.setdefault(int(rank), []).extend(int(s) for s in steps[holes[:, rank]])
        return [
            Damage(
                kind="missing_steps",
                rank=rank,
                detail=f"{len(steps)} step(s) recorded by other ranks are missing: {step_ranges(steps)}",
            )
            for rank, steps in sorted(missing.items())
            if rank < self.world_size
        ]

    def records(self, kind: F.Kind | None = None, rank: int | None = None) -> np.ndarray:
        """All valid records (of ``kind``, of ``rank``) across files, in (attempt, rank, index) order.

        Meant for the rare kinds (AUDIT, CHECKPOINT, ALARM); use :meth:`step_windows` for STEP.
        """
        parts = []
        for rank_file in sorted(self.files, key=lambda f: (f.attempt, f.rank)):
            if rank is not None and rank_file.rank != rank:
                continue
            mask = self.valid_mask(rank_file)
            if kind is not None:
                mask = mask & (rank_file.records["kind"] == int(kind))
            parts.append(np.asarray(rank_file.records[mask]))
        if not parts:
            return np.zeros(0, dtype=F.record_dtype(self.sketch_k))
        return np.concatenate(parts)

    def step_range(self) -> tuple[int, int] | None:
        """``(first, last)`` step of any valid STEP record, or None.

        Rank files are in step order, so only each file's first and last valid STEP records are
        read (no full scan).
        """
        lo, hi = None, None
        for rank_file in self.files:
            recs = rank_file.records
            mask = self.valid_mask(rank_file)
            for index in _first_step_record(recs, mask), _first_step_record(recs, mask, reverse=True):
                if index is None:
                    continue
                step = int(recs["step"][index])
                lo = step if lo is None else min(lo, step)
                hi = step if hi is None else max(hi, step)
        return None if lo is None else (lo, hi)

    def step_windows(
        self,
        window: int = 1024,
        start: int | None = None,
        stop: int | None = None,
        fields: tuple[str, ...] | None = None,
    ) -> Iterator[StepWindow]:
        """Yield :class:`StepWindow` tables of ``window`` steps covering ``[start, stop]``.

        Args:
            window: steps per table; memory is ``window x ranks x record bytes``.
            start, stop: inclusive step bounds (default: the whole trace).
            fields: record fields to copy into the tables (default: all). Asking for fewer is
                faster and smaller; ``step`` and ``rank`` are always included.
        """
        bounds = self.step_range()
        if bounds is None:
            return
        lo = bounds[0] if start is None else max(start, bounds[0])
        hi = bounds[1] if stop is None else min(stop, bounds[1])
        num_ranks = self.world_size
        full = F.record_dtype(self.sketch_k)
        wanted = set(full.names if fields is None else ("step", "rank", *fields))
        names = [name for name in full.names if name in wanted]  # record order: assignment is by position
        dtype = np.dtype([(name, full.fields[name][0]) for name in names])
        ordered = sorted(self.files, key=lambda f: (f.attempt, f.rank))
        cursors = {(f.rank, f.attempt): 0 for f in ordered}
        for w_lo in range(lo, hi + 1, window):
            w_hi = min(w_lo + window, hi + 1)
            num_steps = w_hi - w_lo
            # Filled rank-major so each rank's records land in one contiguous copy; returned as
            # (S, R) views.
            table = np.zeros((num_ranks, num_steps), dtype=dtype)
            present = np.zeros((num_ranks, num_steps), dtype=bool)
            attempt = np.full((num_ranks, num_steps), -1, dtype=np.int32)
            superseded = np.zeros((num_ranks, num_steps), dtype=bool)
            for rank_file in ordered:
                if rank_file.rank >= num_ranks:
                    continue
                key = (rank_file.rank, rank_file.attempt)
                row = rank_file.rank
                dense_first = self._dense_first_step(rank_file)
                if dense_first is not None:  # index by arithmetic: no search, no checks
                    lo_i = max(w_lo - dense_first, 0)
                    hi_i = min(w_hi - dense_first, len(rank_file.records))
                    if hi_i > lo_i:
                        cols = slice(lo_i + dense_first - w_lo, hi_i + dense_first - w_lo)
                        superseded[row, cols] |= present[row, cols]
                        table[row, cols] = rank_file.records[lo_i:hi_i][names]
                        present[row, cols] = True
                        attempt[row, cols] = rank_file.attempt
                    continue
                recs, cursors[key] = self._take_until(rank_file, cursors[key], w_hi)
                steps = recs["step"]
                if (
                    len(recs) == num_steps
                    and steps[0] == w_lo
                    and steps[-1] == w_hi - 1
                    and (recs["kind"] == int(F.Kind.STEP)).all()
                    and (np.diff(steps) == 1).all()
                ):  # the common case: one STEP record per step, nothing else
                    superseded[row] |= present[row]
                    table[row] = recs[names]  # one C-level copy of the selected fields
                    present[row] = True
                    attempt[row] = rank_file.attempt
                    continue
                recs = recs[(recs["kind"] == int(F.Kind.STEP)) & (steps >= w_lo) & (steps < w_hi)]
                cols = (recs["step"] - w_lo).astype(np.int64)
                superseded[row, cols] |= present[row, cols]
                table[row, cols] = recs[names]
                present[row, cols] = True
                attempt[row, cols] = rank_file.attempt
            yield StepWindow(
                steps=np.arange(w_lo, w_hi, dtype=np.int64),
                present=present.T,
                attempt=attempt.T,
                superseded=superseded.T,
                records=table.T,
            )

    def _take_until(self, rank_file: RankFile, cursor: int, step_hi: int) -> tuple[np.ndarray, int]:
        """Valid records from ``cursor`` up to the first with step >= ``step_hi``; new cursor."""
        recs = rank_file.records
        mask = self.valid_mask(rank_file)
        end, probe = cursor, 4096
        while end < len(recs):
            chunk_steps = recs["step"][end : end + probe]
            beyond = np.flatnonzero((chunk_steps >= step_hi) & mask[end : end + probe])
            if beyond.size:
                end += int(beyond[0])
                break
            end += len(chunk_steps)
            probe = min(probe * 2, CHUNK_RECORDS)
        keep = mask[cursor:end]
        return (recs[cursor:end] if keep.all() else recs[cursor:end][keep]), end

    def microbatch_ids(self, record: np.void, rank_records: np.ndarray | None = None) -> np.ndarray:
        """The microbatch IDs of a STEP or AUDIT record (int64)."""
        count = int(record["microbatch_count"])
        if int(record["flags"]) & F.Flag.CONTIGUOUS_IDS:
            return np.arange(int(record["microbatch_first"]), int(record["microbatch_first"]) + count, dtype=np.int64)
        ids_recs = self.records(F.Kind.IDS, rank=int(record["rank"]))
        ids_recs = ids_recs[(ids_recs["step"] == record["step"]) & (ids_recs["attempt"] == record["attempt"])]
        per = F.ids_per_record(self.sketch_k)
        payload = np.ascontiguousarray(ids_recs).view(np.uint8).reshape(len(ids_recs), -1)[:, 32 : 32 + 8 * per]
        return np.ascontiguousarray(payload).view("<i8").reshape(-1)[:count]


def _first_step_record(recs: np.ndarray, mask: np.ndarray, reverse: bool = False) -> int | None:
    """Index of the first (or last) valid STEP record, probing from one end."""
    size = len(recs)
    probe = 64
    while True:
        lo, hi = (max(0, size - probe), size) if reverse else (0, min(size, probe))
        hits = np.flatnonzero(mask[lo:hi] & (recs["kind"][lo:hi] == int(F.Kind.STEP)))
        if hits.size:
            return lo + int(hits[-1] if reverse else hits[0])
        if hi - lo >= size:
            return None
        probe *= 8


def _open_rank_file(path: Path, rank: int, attempt: int, manifest: Manifest, dtype: np.dtype):
    size = path.stat().st_size
    if size < F.HEADER_SIZE:
        return None, Damage(kind="bad_header", rank=rank, attempt=attempt, detail=f"{path.name} is shorter than its header")
    header = np.fromfile(path, dtype=F.HEADER_DTYPE, count=1)
    ok = (
        header["magic"][0] == F.FILE_MAGIC
        and F.checksums(header)[0] == header["checksum"][0]
        and int(header["format_version"][0]) == F.FORMAT_VERSION
        and int(header["record_size"][0]) == dtype.itemsize
        and int(header["rank"][0]) == rank
    )
    if not ok:
        return None, Damage(
            kind="bad_header", rank=rank, attempt=attempt,
            detail=f"{path.name} has a damaged or foreign header (version/record size/rank do not match the manifest); file ignored",
        )
    body = size - F.HEADER_SIZE
    count = body // dtype.itemsize
    torn = body - count * dtype.itemsize
    if count:
        # a plain ndarray view of the read-only map: slicing a np.memmap subclass is slow
        records = np.memmap(path, dtype=dtype, mode="r", offset=F.HEADER_SIZE, shape=(count,)).view(np.ndarray)
    else:
        records = np.zeros(0, dtype=dtype)
    rank_file = RankFile(path=path, rank=rank, attempt=attempt, records=records, torn_bytes=torn)
    problem = None
    if torn:
        problem = Damage(
            kind="torn_tail", rank=rank, attempt=attempt, record_index=count,
            detail=f"{path.name} ends with {torn} bytes of an incomplete record (process killed mid-write?); "
            f"the {count} complete records before it are used",
        )
    return rank_file, problem


def step_ranges(values, sep: str = "-") -> str:
    """``0-3, 7, 9-12`` for a set of steps (at most 10 ranges written out)."""
    values = sorted(set(values))
    out, start, prev = [], None, None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}" if start == prev else f"{start}{sep}{prev}")
            start = prev = v
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}{sep}{prev}")
    text = ", ".join(out[:10])
    return text + (f", … ({len(out) - 10} more ranges)" if len(out) > 10 else "")
