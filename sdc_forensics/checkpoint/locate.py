"""Where a noted checkpoint's file is, and which checkpoint-looking files no note names.

File-level helpers for ``bisect``/``certify``; nothing here decides about a run (that is
``forensics/decision.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sdc_forensics.trace.checkpoints import CheckpointNote


def locate_checkpoint(
    note: CheckpointNote,
    checkpoints: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    base_dir: str | os.PathLike | None = None,
) -> Path | None:
    """The file of ``note``: by name in ``checkpoints`` (a directory or a list of paths), else
    the path the job wrote (as is, then relative to ``base_dir``); None if not found."""
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
    if written.exists():
        return written
    if base_dir is not None and not written.is_absolute() and (Path(base_dir) / written).exists():
        return Path(base_dir) / written
    return None


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
