"""Pick the reader for a path: a safetensors file, an HF index, a ``torch.save`` file, or a
checkpoint folder (a DCP directory, an HF index's directory, a folder with one model file).

Detection looks at names first and then at the first bytes (a zip archive is a ``torch.save``
file whatever its suffix; an 8-byte length followed by ``{`` is safetensors), so a renamed file
is still read with the right reader and an unknown one is refused with a line saying what was
expected. A directory is always opened as a :class:`~sdc_forensics.checkpoint.folder.FolderReader`:
its model checkpoint (:func:`main_format`) plus every other file below it (``folder.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from sdc_forensics.checkpoint.base import CheckpointReader
from sdc_forensics.checkpoint.folder import FolderReader
from sdc_forensics.checkpoint.kinds import (  # noqa: F401 - re-exported: the names every reader of formats uses
    LEGACY_TORCH_MODEL as LEGACY_TORCH_MODEL,
    MAIN_SAFETENSORS as MAIN_SAFETENSORS,
    NOTHING_TO_READ as NOTHING_TO_READ,
    TORCH_SUFFIXES as TORCH_SUFFIXES,
    detect_format,
    main_format as main_format,
    open_file,
    sniff_file as sniff_file,
)
from sdc_forensics.checkpoint.limits import ReadLimits
from sdc_forensics.errors import reader


@reader
def open_checkpoint(
    path: str | os.PathLike, *, populate: bool = False, limits: ReadLimits | None = None
) -> CheckpointReader:
    """Open ``path`` with the right reader; structure is checked before this returns.

    Args:
        path: a checkpoint file or directory (a directory: every file below it is accounted for).
        populate: pre-fault memory maps of safetensors files (faster when reading everything).
        limits: what reading may cost, where links may lead (default: ``limits.current_limits()``).

    Returns:
        A :class:`CheckpointReader` (close it, or use it as a context manager).

    Raises:
        CheckpointError: the path is unreadable, of unknown format, malformed, beyond the limits,
            or a link out of its directory (and every allowed root).
    """
    path = Path(path)
    if path.is_dir():
        return FolderReader(path, populate=populate, limits=limits)
    kind = detect_format(path)
    return open_file(path, kind, populate=populate, limits=limits)
