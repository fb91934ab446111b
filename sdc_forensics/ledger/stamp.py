"""Cheap checksums of checkpoint files: is this still the file a ledger record examined?

A stamp of one file is its size, its modification time (ns) and the SHA-256 of its first and
last :data:`SAMPLE_BYTES` bytes (the whole file when smaller than twice that). It reads at most
2 MiB per file whatever the checkpoint's size: a full hash of a 100 GB checkpoint costs minutes
of disk bandwidth, which is the cost the ledger exists to avoid, and the content was already
read in full when the interval was replayed (the replay loads the file and compares its weights
with the digest the trace recorded). What a stamp catches: the file replaced by another (a
rerun or a new attempt saving the same name: new mtime, new size or new bytes at the ends), or
truncated. What it does not: bytes rotting in the middle at rest with the mtime unchanged; that
is the job of verifying the checkpoint file itself (``checkpoint/verify.py``), which ``certify``
does for every checkpoint it calls clean, ledger or not. A copy that does not keep modification
times (``cp`` without ``-p``; ``rsync -a`` and ``cp -a`` keep them) makes every stamp differ: the
intervals are replayed again, never trusted on a guess.

A checkpoint folder (DCP, Hugging Face shards) is stamped file by file, sorted by relative
name; links are not followed. Files are opened read-only.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from sdc_forensics.errors import InvalidInputError
from sdc_forensics.ledger.record import MAX_FILES, CheckpointRef, FileStamp, canonical_json
from sdc_forensics.trace.checkpoints import CheckpointNote

SAMPLE_BYTES = 1 << 20


def stamp_file(path: str | os.PathLike, name: str | None = None) -> FileStamp:
    """The stamp of one regular file (``name`` defaults to its file name).

    Raises:
        OSError: it cannot be read.
    """
    path = Path(path)
    # a FIFO in its place never blocks
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        sample = hashlib.sha256()
        if info.st_size <= 2 * SAMPLE_BYTES:
            sample.update(handle.read(2 * SAMPLE_BYTES))
        else:
            sample.update(handle.read(SAMPLE_BYTES))
            handle.seek(info.st_size - SAMPLE_BYTES)
            sample.update(handle.read(SAMPLE_BYTES))
    return FileStamp(
        name=path.name if name is None else name,
        size_bytes=info.st_size,
        mtime_ns=info.st_mtime_ns,
        sample_sha256=sample.hexdigest(),
    )


def stamp_checkpoint(path: str | os.PathLike) -> tuple[FileStamp, ...]:
    """The stamps of a checkpoint: one for a file, one per regular file (sorted) for a folder.

    Raises:
        OSError: a file cannot be read.
        InvalidInputError: a folder holds more than ``MAX_FILES`` files.
    """
    path = Path(path)
    if not path.is_dir():
        return (stamp_file(path),)
    names = []
    for folder, dirs, files in os.walk(path, followlinks=False):
        dirs.sort()
        for file in files:
            full = Path(folder) / file
            if full.is_symlink() or not full.is_file():
                continue
            names.append(full.relative_to(path).as_posix())
            if len(names) > MAX_FILES:
                raise InvalidInputError(f"{path} holds more than {MAX_FILES} files: too many to stamp for the ledger")
    return tuple(stamp_file(path / name, name) for name in sorted(names))


def tensors_digest(note: CheckpointNote) -> str:
    """SHA-256 (hex) of a note's per-tensor digests (``{key: hex16}``, canonical JSON), "" if it lists none.

    With the weights digest it identifies the checkpoint's content as the trace recorded it,
    optimizer state included, which a replay from it loads too.
    """
    return hashlib.sha256(canonical_json(note.tensors).encode("ascii")).hexdigest() if note.tensors else ""


def checkpoint_ref(note: CheckpointNote, path: str | os.PathLike | None) -> CheckpointRef:
    """What a record says about a checkpoint at one end of its interval: the note's path and
    digests, and the stamps of the file found at ``path`` (none when ``path`` is None).

    Raises:
        OSError: the file cannot be read.
        InvalidInputError: a folder holds more than ``MAX_FILES`` files; ``LedgerRecordError``
            (one) when the note has no majority weights digest (nothing from or to it can be
            certified, so no record cites it).
    """
    files = stamp_checkpoint(path) if path is not None else ()
    return CheckpointRef(
        step=note.step,
        path=note.path,
        weights_digest=note.weights_digest,
        tensors_digest=tensors_digest(note),
        files=files,
    )
