"""Read a trace directory: manifest, rank files, damage, and vectorised step windows.

Files are memory-mapped read-only and never changed. Records are validated (magic and
checksum) by the compiled kernels of ``trace/scan.py`` on large traces, else in chunks with
numpy; a torn tail or a corrupted record is reported as :class:`Damage` and never used. :meth:`Trace.step_windows` streams ``(steps x ranks)`` tables
of STEP records, window by window, so memory is bounded by the window, not by the trace.
For a step recorded by several attempts (a resumed run), the latest attempt wins, and the
window says which attempt each cell came from; the lineage ends at the latest attempt's last step.

Over 400 lines on purpose: the one reader of the trace format (``format.py``): file validation,
damage and the step windows share one view of a rank file's records.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sdc_forensics.errors import TraceError, reader, reader_class
from sdc_forensics.trace import format as F
from sdc_forensics.trace import scan
from sdc_forensics.trace.manifest import MANIFEST_NAME, Manifest, read_manifest

# ``step_ranges`` is written in trace/spans.py (trace/ends.py needs it below this module); imported from here too
from sdc_forensics.trace.spans import step_ranges as step_ranges
from sdc_forensics.trace.windows import StepWindow, iter_windows

_FILE_RE = re.compile(r"^rank-(\d{5})\.attempt-(\d{3})\.sdct$")
CHUNK_RECORDS = 1 << 16
#: More ranks of the manifest's world size may lack a rank file than this (and than have one)
#: only in a manifest that is not this directory's: ``Trace.open`` refuses it.
MAX_MISSING_RANKS = 64
_UNSET = object()
#: Damage kinds after which the trace's evidence about replicas cannot be trusted in full
#: (a record unread, a rank or steps absent): checkpoints are then ``unverified``, not clean.
UNTRUSTED_DAMAGE = frozenset({"bad_checksum", "bad_header", "missing_rank", "missing_steps"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Damage:
    """One problem found in a trace. ``record_index`` is -1 when it concerns a whole file."""

    # stopped_early | torn_tail | bad_checksum | bad_header | missing_rank | missing_steps | foreign_record
    kind: str
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
    #: the world size its header holds (0: not known, a file built in memory)
    header_world_size: int = 0


@reader
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


@reader_class
class Trace:
    """An open trace directory. Use :meth:`open`."""

    def __init__(self, path: Path, manifest: Manifest, files: list[RankFile], damage: list[Damage]) -> None:
        self.path = path
        self.manifest = manifest
        self.files = files
        self._damage = damage
        self._validated = False
        # None: every record valid
        self._valid: dict[tuple[int, int], np.ndarray | None] = {}
        self._dense: dict[tuple[int, int], int | None] = {}
        self._summary: dict[tuple[int, int], scan.FileSummary] = {}
        self._kernels = _UNSET
        self._end = None
        self._notes = None

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
        files, foreign = _check_header_world_size(path, manifest.world_size, files)
        damage += foreign
        ranks_seen = {f.rank for f in files}
        _check_world_size(path, manifest.world_size, {r for r in ranks_seen if r < manifest.world_size})
        for rank in range(manifest.world_size):
            if rank not in ranks_seen:
                damage.append(Damage(kind="missing_rank", rank=rank, detail=f"no file for rank {rank}"))
        return cls(path, manifest, files, damage)

    def checkpoint_notes(self) -> list:
        """The run's checkpoint notes (``trace.checkpoints.read_checkpoint_notes``), read once."""
        if self._notes is None:
            from sdc_forensics.trace.checkpoints import read_checkpoint_notes

            self._notes = read_checkpoint_notes(self.path)
        return list(self._notes)

    def as_of(self, attempt: int) -> "Trace":
        """The trace as it stood while ``attempt`` was the latest: its rank files, notes and
        attempts, none of a later one. A resumed run's earlier attempt is judged on this view: the
        steps a later attempt re-executed are read from ``attempt``'s own records."""
        from sdc_forensics.trace.checkpoints import read_checkpoint_notes

        manifest = dataclasses.replace(
            self.manifest, attempts=tuple(a for a in self.manifest.attempts if a.attempt <= attempt)
        )
        view = Trace(
            self.path,
            manifest,
            [f for f in self.files if f.attempt <= attempt],
            [d for d in self._damage if d.attempt <= attempt],
        )
        view._notes = read_checkpoint_notes(self.path, max_attempt=attempt)
        return view

    @classmethod
    def of(cls, trace: "Trace | str | os.PathLike") -> "Trace":
        """``trace`` itself when it is open already, else :meth:`open` it: a command opens the trace
        once and hands it down to every stage."""
        return trace if isinstance(trace, Trace) else cls.open(trace)

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def sketch_k(self) -> int:
        return self.manifest.fingerprint.sketch_k

    def valid_mask(self, rank_file: RankFile) -> np.ndarray:
        """``(N,)`` bool: records of this file whose magic and checksum are right.

        Computed once per file (by the compiled kernel of ``trace/scan.py`` where available,
        else by numpy in chunks); kept only for a file with bad records: for a clean file a
        read-only broadcast ``True`` view is returned, so memory does not grow with the trace.

        Raises:
            TraceError: a record with a right checksum holds a step outside ``0..MAX_STEP``: no
                damage does that (the checksum says it was written so), the file is foreign or
                crafted, and steps that large would overflow the step arithmetic downstream.
        """
        key = (rank_file.rank, rank_file.attempt)
        if key not in self._valid:
            if self.kernels() is not None:
                mask, summary = scan.validate(rank_file.records, rank_file.rank)
                if summary.wild_index >= 0:
                    _raise_wild(rank_file, summary.wild_index)
                self._summary[key] = summary
            else:
                mask = self._valid_mask_numpy(rank_file)
            self._valid[key] = None if mask.all() else mask
        mask = self._valid[key]
        return np.broadcast_to(np.True_, (len(rank_file.records),)) if mask is None else mask

    def kernels(self):
        """The compiled scan kernels this trace is read with, or None for numpy (decided once per
        trace, by ``SDC_FORENSICS_KERNELS`` and the trace's size: ``trace/scan.py``)."""
        if self._kernels is _UNSET:
            self._kernels = scan.kernels_for(sum(len(f.records) for f in self.files))
        return self._kernels

    def _validate_all(self) -> None:
        """Validate every file not yet validated, on threads when the compiled kernels run
        (they release the GIL); errors are raised as :meth:`valid_mask` raises them, first file first."""
        todo = [f for f in self.files if (f.rank, f.attempt) not in self._valid]
        if self.kernels() is None or len(todo) < 2:
            return
        results = scan.map_files(lambda f: scan.validate(f.records, f.rank), todo)
        for rank_file, (mask, summary) in zip(todo, results):
            if summary.wild_index >= 0:
                _raise_wild(rank_file, summary.wild_index)
            key = (rank_file.rank, rank_file.attempt)
            self._summary[key] = summary
            self._valid[key] = None if mask.all() else mask

    def file_summary(self, rank_file: RankFile) -> "scan.FileSummary | None":
        """What the compiled validation learnt about the file (None on the numpy path)."""
        self.valid_mask(rank_file)
        return self._summary.get((rank_file.rank, rank_file.attempt))

    @staticmethod
    def _valid_mask_numpy(rank_file: RankFile) -> np.ndarray:
        recs = rank_file.records
        mask = np.empty(len(recs), dtype=bool)
        for start in range(0, len(recs), CHUNK_RECORDS):
            chunk = recs[start : start + CHUNK_RECORDS]
            ok = (
                (F.checksums(chunk) == chunk["checksum"])
                & (chunk["magic"] == F.RECORD_MAGIC)
                & (chunk["rank"] == rank_file.rank)
            )
            steps = chunk["step"]
            wild = np.flatnonzero(ok & ((steps < 0) | (steps > F.MAX_STEP)))
            if wild.size:
                _raise_wild(rank_file, start + int(wild[0]))
            mask[start : start + len(chunk)] = ok
        return mask

    # also called by trace/scan.py
    @reader
    def _dense_first_step(self, rank_file: RankFile) -> int | None:
        """First step when the file is dense (only valid STEP records, steps consecutive), else None.

        A dense file is indexed by arithmetic (record ``i`` holds step ``first + i``); a file with
        other record kinds, gaps or damage is read through the cursor search.
        """
        key = (rank_file.rank, rank_file.attempt)
        if key not in self._dense:
            recs, first = rank_file.records, None
            summary = self.file_summary(rank_file)
            if summary is not None:
                self._dense[key] = int(recs["step"][0]) if summary.dense else None
                return self._dense[key]
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
                self.valid_mask(rank_file)
                if self._valid[(rank_file.rank, rank_file.attempt)] is None:
                    # every record valid
                    continue
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
            end = self.run_end()
            # first: renderers that show a few damage lines show this one
            if end.stopped_early:
                self._damage.insert(
                    0,
                    Damage(
                        kind="stopped_early",
                        rank=end.stopped_ranks[0] if len(end.stopped_ranks) == 1 else -1,
                        attempt=end.attempt,
                        detail=end.describe(),
                    ),
                )
            self._damage.extend(self._missing_steps(end.stopped_early))
            self._validated = True
        return list(self._damage)

    def run_end(self):
        """How the latest attempt ended: :class:`~sdc_forensics.trace.ends.RunEnd` (cached)."""
        if self._end is None:
            from sdc_forensics.trace.ends import run_end

            self._end = run_end(self)
        return self._end

    def _missing_steps(self, stopped_early: bool) -> list[Damage]:
        """Holes: steps some ranks recorded and others did not. When the run stopped early, the
        steps after a rank's last one are where it stopped (the ``stopped_early`` entry), not holes."""
        missing: dict[int, list[int]] = {}
        # (R,) last step each rank recorded
        last_present = np.full(self.world_size, -1, dtype=np.int64)
        bounds = self.step_range()
        fast = scan.StepScan.open(self, bounds[0], bounds[1], 1024, full=False) if bounds is not None else None
        for window in fast if fast is not None else self.step_windows(fields=()):
            # (S,)
            any_present = window.present.any(axis=1)
            holes = window.present[any_present] == False  # noqa: E712  (S', R)
            steps = window.steps[any_present]
            seen = window.present.any(axis=0)
            last_present[seen] = window.steps[window.present.shape[0] - 1 - np.argmax(window.present[::-1], axis=0)][
                seen
            ]
            for rank in np.flatnonzero(holes.any(axis=0)):
                missing.setdefault(int(rank), []).extend(int(s) for s in steps[holes[:, rank]])
        if stopped_early:
            missing = {
                rank: [s for s in steps if last_present[rank] < 0 or s < last_present[rank]]
                for rank, steps in missing.items()
            }
            missing = {rank: steps for rank, steps in missing.items() if steps}
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
            summary = self.file_summary(rank_file)
            if kind is not None and summary is not None and not summary.count(int(kind)):
                # the validation counted this file's records by kind: none of this one
                continue
            if kind is not None:
                mask = mask & (rank_file.records["kind"] == int(kind))
            parts.append(np.asarray(rank_file.records[mask]))
        if not parts:
            return np.zeros(0, dtype=F.record_dtype(self.sketch_k))
        return np.concatenate(parts)

    def step_range(self, attempt: int | None = None) -> tuple[int, int] | None:
        """``(first, last)`` step of any valid STEP record (of ``attempt``'s files only, when given), or None.

        Without ``attempt``, the latest lineage's: a resumed run's steps end where its latest attempt's
        do (:meth:`lineage_end`); an earlier attempt's steps after that followed a state the run
        left behind, and are judged with that attempt (``Trace.as_of``), never as the run's next steps.

        Rank files are in step order, so only each file's first and last valid STEP records are
        read (no full scan).
        """
        bounds = self._step_range(attempt)
        if attempt is not None or bounds is None:
            return bounds
        end = self.lineage_end()
        if end is None or end >= bounds[1]:
            return bounds
        return None if end < bounds[0] else (bounds[0], end)

    def lineage_end(self) -> int | None:
        """The last step of a resumed run's latest lineage: its latest attempt's last recorded step
        (None: one attempt, or the latest recorded no step yet, so no earlier record follows one of
        its own)."""
        attempts = self.manifest.attempts
        if len(attempts) < 2:
            return None
        own = self._step_range(max(attempts, key=lambda a: a.attempt).attempt)
        return own[1] if own is not None else None

    def _step_range(self, attempt: int | None) -> tuple[int, int] | None:
        lo, hi = None, None
        self._validate_all()
        for rank_file in self.files:
            if attempt is not None and rank_file.attempt != attempt:
                continue
            recs = rank_file.records
            mask = self.valid_mask(rank_file)
            summary = self.file_summary(rank_file)
            if summary is not None:
                ends = (summary.first_step_index, summary.last_step_index) if summary.first_step_index >= 0 else ()
            else:
                ends = _first_step_record(recs, mask), _first_step_record(recs, mask, reverse=True)
            for index in ends:
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
        """Yield :class:`StepWindow` tables of at most ``window`` consecutive steps covering the
        recorded steps of ``[start, stop]``.

        Steps that no rank recorded are skipped: a window starts at a recorded step and ends
        before the first step nobody recorded, so time and memory follow the records in the
        files, never the span their step numbers declare (``trace/windows.py``).

        Args:
            window: the most steps per table; memory is at most ``window x ranks x record bytes``.
            start, stop: inclusive step bounds (default: the whole trace).
            fields: record fields to copy into the tables (default: all). Asking for fewer is
                faster and smaller; ``step`` and ``rank`` are always included.
        """
        bounds = self.step_range()
        if bounds is None or window < 1:
            return
        lo = bounds[0] if start is None else max(start, bounds[0])
        hi = bounds[1] if stop is None else min(stop, bounds[1])
        full = F.record_dtype(self.sketch_k)
        wanted = set(full.names if fields is None else ("step", "rank", *fields))
        # record order: assignment is by position
        names = [name for name in full.names if name in wanted]
        dtype = np.dtype([(name, full.fields[name][0]) for name in names])
        files = [(f, self.valid_mask(f), self._dense_first_step(f)) for f in self.files]
        yield from iter_windows(files, num_ranks=self.world_size, dtype=dtype, lo=lo, hi=hi, window=window)

    def microbatch_ids(self, record: np.void, rank_records: np.ndarray | None = None) -> np.ndarray:
        """The microbatch IDs of a STEP or AUDIT record (int64). :class:`TraceError` when some are
        lost (their IDS records fail their checksum or were cut off: :meth:`has_microbatch_ids`)."""
        count = int(record["microbatch_count"])
        if int(record["flags"]) & F.Flag.CONTIGUOUS_IDS:
            return np.arange(int(record["microbatch_first"]), int(record["microbatch_first"]) + count, dtype=np.int64)
        ids_recs = self._ids_records(record)
        if len(ids_recs) * F.ids_per_record(self.sketch_k) < count:
            rank, attempt = int(record["rank"]), int(record["attempt"])
            name = next((f.path.name for f in self.files if (f.rank, f.attempt) == (rank, attempt)), "its trace file")
            raise TraceError(
                f"{self.path / name}: rank {rank}'s microbatch IDs of step {int(record['step'])} are lost (the records "
                f"that held them fail their checksum or were cut off), so its inputs cannot be fetched again; replay "
                "the steps before it, or restore the file from the run"
            )
        per = F.ids_per_record(self.sketch_k)
        payload = np.ascontiguousarray(ids_recs).view(np.uint8).reshape(len(ids_recs), -1)[:, 32 : 32 + 8 * per]
        return np.ascontiguousarray(payload).view("<i8").reshape(-1)[:count]

    def has_microbatch_ids(self, record: np.void) -> bool:
        """Whether every microbatch ID of a STEP or AUDIT record is readable (see :meth:`microbatch_ids`)."""
        if int(record["flags"]) & F.Flag.CONTIGUOUS_IDS:
            return True
        return len(self._ids_records(record)) * F.ids_per_record(self.sketch_k) >= int(record["microbatch_count"])

    def _ids_records(self, record: np.void) -> np.ndarray:
        ids_recs = self.records(F.Kind.IDS, rank=int(record["rank"]))
        return ids_recs[(ids_recs["step"] == record["step"]) & (ids_recs["attempt"] == record["attempt"])]


def _raise_wild(rank_file: RankFile, index: int) -> None:
    step = int(rank_file.records["step"][index])
    raise TraceError(
        f"{rank_file.path}: record {index} holds step {step}, outside 0..{F.MAX_STEP}, with a valid "
        "checksum: the file was not written by sdc-forensics; remove it from the trace directory or restore it from the run"
    )


def _check_header_world_size(path: Path, world_size: int, files: list[RankFile]) -> tuple[list[RankFile], list[Damage]]:
    """Refuse a manifest whose world size the rank files' own headers contradict; ignore, as damage,
    a file whose header alone does (from another run). Returns the files kept and that damage.

    The recorder refuses to resume a trace at another world size, so every rank file's header holds
    the manifest's. A manifest that says 2 beside four files that say 4 made every step's all-reduce
    check read half the ranks and call the collective corrupt (exit 1) on a clean run.
    """
    wrong = [f for f in files if f.header_world_size and f.header_world_size != world_size]
    if wrong and len(wrong) < len(files):
        damage = [
            Damage(
                kind="bad_header",
                rank=f.rank,
                attempt=f.attempt,
                detail=f"{f.path.name}'s header says world size {f.header_world_size}, the manifest {world_size}: a file "
                "from another run; file ignored",
            )
            for f in wrong
        ]
        ignored = {id(f) for f in wrong}
        return [f for f in files if id(f) not in ignored], damage
    if wrong:
        other = sorted({f.header_world_size for f in wrong})
        names = [f.path.name for f in wrong]
        raise TraceError(
            f"{path / MANIFEST_NAME} declares world_size {world_size}, but the rank files' headers say "
            f"{', '.join(map(str, other))} ({names[0]}{' and others' if len(names) > 1 else ''}): the manifest is damaged "
            f"or from another run; restore {MANIFEST_NAME} from the run"
        )
    return files, []


def _check_world_size(path: Path, world_size: int, ranks_with_files: set[int]) -> None:
    """Refuse a manifest whose world size is far beyond the readable rank files present.

    Every step table has a column per rank of the manifest's world size, so a crafted
    ``world_size`` (up to 100,000) next to two rank files would make each table 50,000 times
    larger than the files. More ranks missing than present (and more than
    :data:`MAX_MISSING_RANKS`) leaves nothing to compare across replicas anyway; fewer are
    reported as ``missing_rank`` damage, and the tables stay within ``2 x files + 64`` columns.
    """
    present = len(ranks_with_files)
    missing = world_size - present
    if missing > max(present, MAX_MISSING_RANKS):
        shown = step_ranges(sorted(ranks_with_files)) or "none"
        raise TraceError(
            f"{path / MANIFEST_NAME} declares world_size {world_size}, but only {present} rank(s) have a readable file here "
            f"(ranks {shown}): {missing} ranks are missing, more than are present, so replicas cannot be compared; "
            f"restore {MANIFEST_NAME} from the run, or copy every rank's rank-RRRRR.attempt-AAA.sdct files into the directory"
        )


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
    # a directory or a FIFO under a rank file's name: never written by the recorder
    if not path.is_file():
        return None, Damage(
            kind="bad_header", rank=rank, attempt=attempt, detail=f"{path.name} is not a regular file; ignored"
        )
    size = path.stat().st_size
    if size < F.HEADER_SIZE:
        return None, Damage(
            kind="bad_header", rank=rank, attempt=attempt, detail=f"{path.name} is shorter than its header"
        )
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
            kind="bad_header",
            rank=rank,
            attempt=attempt,
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
    rank_file = RankFile(
        path=path,
        rank=rank,
        attempt=attempt,
        records=records,
        torn_bytes=torn,
        header_world_size=int(header["world_size"][0]),
    )
    problem = None
    if torn:
        problem = Damage(
            kind="torn_tail",
            rank=rank,
            attempt=attempt,
            record_index=count,
            detail=f"{path.name} ends with {torn} bytes of an incomplete record (process killed mid-write?); "
            f"the {count} complete records before it are used",
        )
    return rank_file, problem
