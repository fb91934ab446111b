"""Pick the reader for a path: a safetensors file, an HF index (or its directory), a
``torch.save`` file, or a DCP directory.

Detection looks at names first and then at the first bytes (a zip archive is a ``torch.save``
file whatever its suffix; an 8-byte length followed by ``{`` is safetensors), so a renamed file
is still read with the right reader and an unknown one is refused with a line saying what was
expected.
"""

from __future__ import annotations

import os
from pathlib import Path

from sdc_forensics.checkpoint.base import CheckpointReader
from sdc_forensics.checkpoint.dcp_reader import METADATA_NAME, DcpReader
from sdc_forensics.checkpoint.hf_index import INDEX_SUFFIX, HfIndexReader, find_index, is_index_name
from sdc_forensics.checkpoint.safetensors_reader import SafetensorsReader
from sdc_forensics.checkpoint.torch_reader import TorchReader
from sdc_forensics.errors import CheckpointError

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def detect_format(path: str | os.PathLike) -> str:
    """``safetensors``, ``hf-index``, ``torch`` or ``dcp``; raises :class:`CheckpointError`."""
    path = Path(path)
    if path.is_dir():
        if (path / METADATA_NAME).is_file() or any(path.glob("*.distcp")):
            return "dcp"
        if find_index(path) is not None:
            return "hf-index"
        singles = sorted(path.glob("*.safetensors"))
        if len(singles) == 1:
            return "safetensors"
        raise CheckpointError(
            f"{path} is a directory without {METADATA_NAME} (DCP), a *{INDEX_SUFFIX} (sharded safetensors) or a single "
            ".safetensors file; pass the checkpoint file itself"
        )
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; check the path")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file or directory")
    if is_index_name(path.name):
        return "hf-index"
    with open(path, "rb") as fh:  # read-only
        head = fh.read(9)
    if head[:2] == b"PK":
        return "torch"
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in TORCH_SUFFIXES:
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise CheckpointError(f"{path}: unknown checkpoint format (expected .safetensors, an HF index .json, a torch.save file or a DCP directory)")


def open_checkpoint(path: str | os.PathLike, *, populate: bool = False) -> CheckpointReader:
    """Open ``path`` with the right reader; structure is checked before this returns.

    Args:
        path: a checkpoint file or directory.
        populate: pre-fault memory maps of safetensors files (faster when reading everything).

    Returns:
        A :class:`CheckpointReader` (close it, or use it as a context manager).

    Raises:
        CheckpointError: the path is unreadable, of unknown format, or malformed.
    """
    path = Path(path)
    kind = detect_format(path)
    if kind == "dcp":
        return DcpReader(path)
    if kind == "hf-index":
        return HfIndexReader(find_index(path) if path.is_dir() else path, populate=populate)
    if kind == "safetensors":
        target = sorted(path.glob("*.safetensors"))[0] if path.is_dir() else path
        return SafetensorsReader(target, populate=populate)
    return TorchReader(path)
