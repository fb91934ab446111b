"""The ledger file: where it lives, appending a record safely, reading every record it can trust.

``TRACE_DIR/ledger.jsonl`` by default (:func:`ledger_path`); a command given ``--ledger PATH``
uses that file instead (a read-only trace directory, an archived trace, a ledger kept apart).
One record per line (``ledger/record.py``); the file only ever grows.

Appending (:func:`append_record`): the file is opened ``O_APPEND`` (never through a link), an
exclusive ``flock`` is taken, a newline is prepended if the file does not end with one (the
torn tail of a writer killed mid-record then stays a line of its own and the new record is
whole), the line is written with one ``write`` (repeated only for a short write, still under
the lock), ``fsync``'ed, and the lock released. Two writers (two followers, a follower and a
``bisect``) therefore never interleave, and a killed writer leaves at most its own record torn
at the tail (the kernel drops its lock). On file systems where ``flock`` is not coherent
across machines (some NFS setups), give each machine its own ``--ledger``.

Reading (:func:`read_ledger`) never raises on what the file holds: under a shared lock (so
that a record being appended is not mistaken for a torn one), line by line, each line at most
:data:`MAX_RECORD_BYTES`, at most :data:`MAX_LINES` lines; every line that cannot be used
(torn, not JSON, unknown version, checksum mismatch, a field out of range, a duplicate) becomes
one line in ``notes`` and is never used. A missing ledger is an empty one; an unreadable one
is an empty one with a note: the ledger can only save work, never stop a command.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import stat
from pathlib import Path

from sdc_forensics.errors import UNCHECKED_PARSE_ERRORS, LedgerWriteError
from sdc_forensics.ledger.record import IntervalRecord, LedgerRecordError, decode_record, encode_record
from sdc_forensics.untrusted import load_json

LEDGER_NAME = "ledger.jsonl"
#: A line longer than this is ignored (records the tool writes are a few KiB).
MAX_RECORD_BYTES = 1 << 18
#: Lines read at most (a checkpoint interval per line: far beyond any run).
MAX_LINES = 1_000_000
#: Ignored-record lines kept; more are counted in one last line.
MAX_NOTES = 50


@dataclasses.dataclass(frozen=True, kw_only=True)
class LedgerContents:
    """What :func:`read_ledger` could trust.

    Attributes:
        path: the ledger file read.
        records: the valid records, in file order (duplicates of a ``record_id`` dropped).
        notes: one line per ignored record or problem, for people (bounded).
    """

    path: Path
    records: tuple[IntervalRecord, ...] = ()
    notes: tuple[str, ...] = ()


def ledger_path(trace_dir: str | os.PathLike, override: str | os.PathLike | None = None) -> Path:
    """The ledger of ``trace_dir``: ``override`` (``--ledger PATH``) if given, else ``TRACE_DIR/ledger.jsonl``."""
    return Path(override) if override is not None else Path(trace_dir) / LEDGER_NAME


def append_record(path: str | os.PathLike, record: IntervalRecord) -> None:
    """Append ``record`` to the ledger at ``path`` (created if absent), whole, durably, and
    never interleaved with another writer's record.

    Raises:
        LedgerWriteError: the file cannot be created or written (a read-only trace directory,
            a full disk, a link or a non-file in its place); the message says to pass
            ``--ledger PATH``. Nothing else the caller did depends on it.
    """
    path = Path(path)
    line = encode_record(record)
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _unwritable(path, OSError("not a regular file"))
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            # a torn tail stays its own (ignored) line
            line = b"\n" + line
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        if size == 0:
            _fsync_dir(path.parent)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    finally:
        # releases the lock
        os.close(fd)


def _unwritable(path: Path, exc: OSError) -> LedgerWriteError:
    reason = exc.strerror or str(exc)
    return LedgerWriteError(
        f"cannot append to the ledger {path} ({reason}); pass --ledger PATH to keep it on a writable "
        "file system (the trace and checkpoints are never written)"
    )


def _fsync_dir(folder: Path) -> None:
    """Make a new file's directory entry durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_ledger(path: str | os.PathLike) -> LedgerContents:
    """Every record of the ledger at ``path`` that can be trusted as written; never raises on content.

    A record is returned only when it is a whole line of valid JSON of a known version whose
    checksum matches and whose every field is in range; anything else is one line in ``notes``.
    Whether a valid record still applies to the trace is :func:`ledger.reuse.reusable_records`'s question.
    """
    path = Path(path)
    notes = _Notes(path)
    try:
        fd = os.open(
            path,
            os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
            # a FIFO in its place never blocks
        )
    except FileNotFoundError:
        return LedgerContents(path=path)
    except OSError as exc:
        return LedgerContents(
            path=path, notes=(f"{path}: the ledger cannot be read ({exc.strerror or exc}); nothing is reused from it",)
        )
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return LedgerContents(
                path=path, notes=(f"{path}: the ledger is not a regular file; nothing is reused from it",)
            )
        try:
            # wait for a writer's record to be whole
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:
            # a file system without flock: a record being appended may read as a torn tail
            pass
        records = _read_lines(handle, notes)
    return LedgerContents(path=path, records=tuple(records), notes=notes.lines())


def _read_lines(handle, notes: "_Notes") -> list[IntervalRecord]:
    records: list[IntervalRecord] = []
    first_line_of: dict[str, int] = {}
    for number in range(1, MAX_LINES + 1):
        line = handle.readline(MAX_RECORD_BYTES + 1)
        if not line:
            return records
        if len(line) > MAX_RECORD_BYTES:
            # skip the rest of it, a bounded piece at a time
            while line and not line.endswith(b"\n"):
                line = handle.readline(MAX_RECORD_BYTES)
            notes.add(number, f"longer than {MAX_RECORD_BYTES} bytes")
            continue
        if not line.endswith(b"\n"):
            notes.add(
                number,
                f"a torn record at the end of the file ({len(line)} bytes without an end of line: a write was cut short)",
            )
            return records
        if not line.strip():
            continue
        try:
            record = decode_record(load_json(line), "record")
        except LedgerRecordError as exc:
            notes.add(number, str(exc).removeprefix("record: "))
            continue
        except ValueError as exc:
            notes.add(number, f"not valid JSON ({exc}): a torn or damaged record")
            continue
        # a check missing in decode_record: still never trusted
        except UNCHECKED_PARSE_ERRORS as exc:
            notes.add(number, f"malformed ({type(exc).__name__})")
            continue
        if record.record_id in first_line_of:
            notes.add(number, f"a second copy of the record of line {first_line_of[record.record_id]}")
            continue
        first_line_of[record.record_id] = number
        records.append(record)
    notes.add(MAX_LINES + 1, f"the ledger has more than {MAX_LINES} lines; the rest is not read")
    return records


class _Notes:
    """Ignored-record lines, at most :data:`MAX_NOTES`, then a count."""

    def __init__(self, path: Path) -> None:
        self.path, self.kept, self.dropped = path, [], 0

    def add(self, line_number: int, why: str) -> None:
        if len(self.kept) < MAX_NOTES:
            self.kept.append(f"{self.path}:{line_number}: ledger record ignored: {why}")
        else:
            self.dropped += 1

    def lines(self) -> tuple[str, ...]:
        more = (f"{self.path}: {self.dropped} more ledger records ignored",) if self.dropped else ()
        return (*self.kept, *more)
