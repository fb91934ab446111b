"""Where a noted checkpoint's file is, and which checkpoint-looking files no note names.

File-level helpers for ``bisect``/``certify``; nothing here decides about a run (that is
``decide/decision.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sdc_forensics.trace.checkpoints import CheckpointNote, climbs_then_descends


def locate_checkpoint(
    note: CheckpointNote,
    checkpoints: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    base_dir: str | os.PathLike | None = None,
) -> Path | None:
    """The file of ``note``, or None if not found.

    Looked for, in this order:

    1. ``checkpoints`` given (``--checkpoints DIR``, or a list of paths): by file name there, and
       nowhere else;
    2. the path the recorder noted relative to the trace directory (``path_from_trace``), which
       survives moving the trace and its checkpoints together, even renamed;
    3. the path the job wrote, when it is absolute and exists;
    4. the path the job wrote, relative to ``base_dir`` (the trace directory), to its parent,
       and to a farther ancestor where the path goes back down through the trace's own folders,
       nearest first: ``sdc-demo/checkpoints/x.pt`` written by a job run in ``/job`` is found as
       ``/elsewhere/sdc-demo/checkpoints/x.pt`` when the trace is now ``/elsewhere/sdc-demo/trace``,
       whatever the current directory (notes written before ``path_from_trace`` rely on this);
    5. the path the job wrote, relative to the current directory (where the job ran, usually).

    2 comes before 3 and 4, so that a trace archived with its checkpoints is read against its own
    files even where the job's absolute paths now hold a later run's; 4 joins only where the path passes through the trace's own folders,
    because a far ancestor (``/tmp``) can hold another run's ``sdc-demo/checkpoints/`` with the
    same file names (found so, in a shared ``/tmp``).

    A note is hostile input. A written path with a ``..`` component is never joined to anything;
    ``path_from_trace`` may only be ``..`` components then plain names; and whatever a note names
    is used only when it is a regular file or a directory (never a FIFO or a device), opened
    read-only and parsed as hostile like any checkpoint: a note can name a file outside the run,
    as a job's own absolute path can, and verification then finds that it is not the checkpoint
    the note describes.

    Args:
        note: the checkpoint note.
        checkpoints: ``--checkpoints``: a directory (files found by name) or a list of paths.
        base_dir: the trace directory (older callers passed its parent: step 4 still finds the
            job's relative paths then, step 3 does not).
    """
    name = Path(note.path).name
    if isinstance(checkpoints, (str, os.PathLike)):
        candidate = Path(checkpoints) / name
        return candidate if candidate.exists() else None
    if checkpoints is not None:
        for path in checkpoints:
            if Path(path).name == name:
                return Path(path)
        return None
    written = Path(note.path)
    base = Path(os.path.abspath(base_dir)) if base_dir is not None else None
    if base is not None and note.path_from_trace and climbs_then_descends(note.path_from_trace):
        candidate = Path(os.path.normpath(base / note.path_from_trace))
        # as written when that is the same file (paths in reports stay the job's)
        if _usable(candidate):
            return written if _usable(written) and os.path.samefile(written, candidate) else candidate
    if written.is_absolute() and _usable(written):
        return written
    if base is not None:
        if written.parts and not written.is_absolute() and not written.drive and ".." not in written.parts:
            for ancestor in _join_points(base, written):
                candidate = ancestor / written
                if _usable(candidate):
                    return written if _usable(written) and os.path.samefile(written, candidate) else candidate
    return written if not written.is_absolute() and _usable(written) else None


def _usable(path: Path) -> bool:
    """A regular file or a directory (a DCP checkpoint): never a FIFO, a device or a socket, which
    a crafted note could name to make a read hang or consume a device."""
    return path.is_file() or path.is_dir()


def _join_points(trace_dir: Path, written: Path) -> list[Path]:
    """Where a job's relative path may be joined: the trace directory, its parent, and a farther
    ancestor only where the path goes back down through the trace's own folders (``sdc-demo/...``
    joined to ``/elsewhere`` for the trace ``/elsewhere/sdc-demo/trace``). A far ancestor such as
    ``/tmp`` can hold another run's folder of the same name."""
    lineage = (trace_dir, *trace_dir.parents)
    return [a for i, a in enumerate(lineage) if i <= 1 or (len(written.parts) > 1 and a / written.parts[0] in lineage)]


def unnoted_checkpoints(notes: Sequence[CheckpointNote], directory: str | os.PathLike) -> list[Path]:
    """Checkpoint-looking entries of ``directory`` that no note names: saved without the recorder
    seeing it (or its note was lost), so nothing can be certified about them."""
    from sdc_forensics.checkpoint.formats import TORCH_SUFFIXES

    noted = {Path(n.path).name for n in notes}
    out = []
    for entry in sorted(Path(directory).iterdir()):
        if entry.name in noted:
            continue
        looks = entry.is_file() and entry.suffix in (*TORCH_SUFFIXES, ".safetensors")
        looks = looks or (entry.is_dir() and ((entry / ".metadata").exists() or any(entry.glob("*.safetensors"))))
        if looks:
            out.append(entry)
    return out
