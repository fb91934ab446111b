"""Which kind of checkpoint a path holds, and the reader of one file of each kind.

Below ``checkpoint/formats.py`` (``open_checkpoint``: a file, or a folder) and
``checkpoint/folder.py`` (a folder's files, each opened here): both build on it, so neither
imports the other's pieces (no two-way import). ``formats`` re-exports every name.
"""

from __future__ import annotations

import os
from pathlib import Path

from sdc_forensics.checkpoint.base import CheckpointReader
from sdc_forensics.checkpoint.dcp_reader import METADATA_NAME, DcpReader
from sdc_forensics.checkpoint.hf_index import INDEX_SUFFIX, HfIndexReader, find_index, is_index_name
from sdc_forensics.checkpoint.limits import ReadLimits
from sdc_forensics.checkpoint.safetensors_reader import SafetensorsReader
from sdc_forensics.checkpoint.torch_reader import TorchReader
from sdc_forensics.errors import CheckpointError, reader

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
#: The model file of a folder holding several ``.safetensors`` files, and the legacy HF model file.
MAIN_SAFETENSORS = "model.safetensors"
LEGACY_TORCH_MODEL = "pytorch_model.bin"


@reader
def main_format(directory: Path) -> tuple[str, Path] | None:
    """The model checkpoint a directory holds at its top level, as ``(format, path)``, or None.

    In order: a DCP checkpoint (``.metadata`` or ``*.distcp``: the directory itself), an HF index
    (``*.safetensors.index.json``), one ``.safetensors`` file (``model.safetensors`` when there
    are several), an HF legacy ``pytorch_model.bin``.

    Raises:
        CheckpointError: several index files.
    """
    if (directory / METADATA_NAME).is_file() or any(directory.glob("*.distcp")):
        return "dcp", directory
    index = find_index(directory)
    if index is not None:
        return "hf-index", index
    singles = sorted(p for p in directory.glob("*.safetensors") if p.is_file() or p.is_symlink())
    if len(singles) == 1:
        return "safetensors", singles[0]
    if (directory / MAIN_SAFETENSORS) in singles:
        return "safetensors", directory / MAIN_SAFETENSORS
    if (directory / LEGACY_TORCH_MODEL).is_file():
        return "torch", directory / LEGACY_TORCH_MODEL
    return None


@reader
def detect_format(path: str | os.PathLike) -> str:
    """``safetensors``, ``hf-index``, ``torch``, ``dcp`` or (a directory without one model
    checkpoint at its top) ``folder``; raises :class:`CheckpointError`."""
    path = Path(path)
    if path.is_dir():
        found = main_format(path)
        return found[0] if found is not None else "folder"
    if not path.exists():
        if path.is_symlink():
            # a link whose target is missing, or a loop of links (x -> y -> x)
            raise CheckpointError(f"{path} is a symbolic link that leads to no file (a missing target or a loop)")
        raise CheckpointError(f"{path} does not exist; check the path")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file or directory")
    if is_index_name(path.name):
        return "hf-index"
    if path.suffix == ".distcp":
        # read alone it is a torch.save zip of some items, whose metadata lives beside it
        raise CheckpointError(
            f"{path} is a data file of a torch.distributed.checkpoint directory: verify the directory "
            f"({path.parent}), whose .metadata says what it holds"
        )
    found = sniff_file(path)
    if found is None:
        raise CheckpointError(
            f"{path}: unknown checkpoint format (expected .safetensors, an HF index .json, a torch.save file or a DCP directory)"
        )
    return found


@reader
def sniff_file(path: Path) -> str | None:
    """``torch`` or ``safetensors`` from the first bytes and the suffix of one file, else None."""
    # read-only
    with open(path, "rb") as fh:
        head = fh.read(9)
    if head[:2] == b"PK":
        return "torch"
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in TORCH_SUFFIXES:
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return None


@reader
def open_file(
    path: Path, kind: str, *, root: Path | None = None, populate: bool = False, limits: ReadLimits | None = None
) -> CheckpointReader:
    """The reader of one checkpoint file (or of an HF index and its shards, or a DCP directory).

    Args:
        path: the file (the directory for ``dcp``).
        kind: its format, from :func:`detect_format` or :func:`main_format`.
        root: the directory its name is relative to (default: its own).
        populate: pre-fault memory maps of safetensors files.
        limits: what reading may cost, where links may lead (default: ``limits.current_limits()``).
    """
    if kind == "dcp":
        return DcpReader(path, limits=limits)
    if kind == "hf-index":
        return HfIndexReader(path, populate=populate, limits=limits)
    if kind == "safetensors":
        return SafetensorsReader(path, root=root, populate=populate, limits=limits)
    if kind == "torch":
        return TorchReader(path, root=root, limits=limits)
    raise CheckpointError(f"{path}: no reader for format {kind!r}")


#: What :func:`FolderReader` says when a directory holds nothing it can read as tensors.
NOTHING_TO_READ = (
    f"is a directory without {METADATA_NAME} (DCP), a *{INDEX_SUFFIX} (sharded safetensors), a .safetensors file "
    "or any torch.save file; pass the checkpoint file itself"
)
