"""What every checkpoint reader provides, and the read-only memory map they share.

A reader checks a checkpoint's *structure* when it is opened (and raises
:class:`~sdc_forensics.errors.CheckpointError` with one line saying what is wrong), then hands
out tensors one at a time, as zero-copy views of a read-only memory map wherever the format
allows, so that a checkpoint larger than memory can be verified. Content (digests, NaN/Inf) is
judged by ``verify.py``, not here.

Files are opened with ``O_RDONLY`` and mapped with ``PROT_READ``: a reader cannot change them.
"""

from __future__ import annotations

import abc
import dataclasses
import mmap
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from sdc_forensics.errors import CheckpointError, reader, reader_class


# slots: a file may list a million
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    """One tensor as the checkpoint's metadata describes it (before reading its bytes).

    Attributes:
        key: the tensor's key (safetensors name, dotted ``flatten_state`` key, or DCP FQN).
        dtype: torch dtype name without the ``torch.`` prefix (``float32``).
        shape: the tensor's shape.
        file: the file (relative to the checkpoint root) that holds its bytes.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileIssue:
    """A problem with one file: damaged bytes that leave it readable (a zip CRC mismatch), or, from
    :meth:`CheckpointReader.unverifiable`, why its content could not be verified."""

    file: str
    detail: str


@reader_class
class MappedFile:
    """A file mapped read-only, exposed as one ``uint8`` torch tensor without copying.

    Args:
        path: the file.
        populate: pre-fault the whole mapping (``MAP_POPULATE``): one system call instead of a
            page fault per 64 KiB when the whole file will be read anyway.
    """

    def __init__(self, path: Path, *, populate: bool = False) -> None:
        self.path = path
        self.size = path.stat().st_size
        self._mmap: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        if self.size == 0:
            self._bytes = torch.empty(0, dtype=torch.uint8)
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self._mmap = mmap.mmap(fd, self.size, flags=flags, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"cannot map {path} for reading ({exc}); check that it is a regular, readable file"
            ) from None
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable; that is the point: nothing writes to it.
            warnings.simplefilter("ignore", UserWarning)
            self._bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)

    @property
    def bytes(self) -> torch.Tensor:
        """The whole file as a read-only ``(size,)`` uint8 tensor (do not write to it)."""
        if self._bytes is None:
            raise CheckpointError(f"{self.path} was already closed; reopen the checkpoint")
        return self._bytes

    def buffer(self) -> memoryview | bytes:
        """The mapping as a read-only memoryview (``b""`` for an empty file)."""
        return memoryview(self._mmap) if self._mmap is not None else b""

    def close(self) -> None:
        """Drop the tensor view and unmap (a view still held elsewhere keeps the map alive)."""
        self._bytes = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            # a caller still holds a view; the GC unmaps it later
            except BufferError:
                pass
            self._mmap = None


@reader
def typed_view(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` (uint8 bytes) reinterpreted as ``dtype`` with ``shape``; zero-copy when aligned."""
    # nothing to view (an empty slice may be misaligned: no copy needed)
    if not raw.numel():
        return torch.empty(shape, dtype=dtype)
    itemsize = dtype.itemsize
    if raw.storage_offset() % itemsize:
        # misaligned in the file: the only case that copies
        raw = raw.clone()
    if dtype == torch.bool:
        return raw.view(torch.bool).view(shape)
    return raw.view(dtype).view(shape)


class CheckpointReader(abc.ABC):
    """An opened, structurally checked checkpoint. Use as a context manager.

    Attributes:
        path: what the user named (file or directory).
        root: the directory that relative file names are relative to.
        format: ``safetensors``, ``hf-index``, ``torch`` or ``dcp``.
    """

    format: str = ""

    def __init_subclass__(cls, **kwargs) -> None:
        """Every reader's constructor and public methods raise :class:`InvalidInputError` for any
        input they cannot parse (``errors.reader_class``): a new format needs no list anywhere."""
        super().__init_subclass__(**kwargs)
        reader_class(cls)

    def __init__(self, path: Path, root: Path) -> None:
        self.path = path
        self.root = root

    @property
    @abc.abstractmethod
    def files(self) -> tuple[Path, ...]:
        """Every file the checkpoint consists of (checksummed by verification)."""

    @abc.abstractmethod
    def infos(self) -> list[TensorInfo]:
        """The tensors the metadata describes, in file order."""

    @abc.abstractmethod
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, tensor)`` one at a time, in :meth:`infos` order; CPU, do not modify them."""

    def maps(self) -> dict[Path, MappedFile]:
        """Files this reader already mapped, so verification can digest them without remapping."""
        return {}

    def step(self) -> int | None:
        """The number of completed steps the checkpoint says it holds, when it says so."""
        return None

    def file_issues(self) -> list[FileIssue]:
        """Readable-but-damaged findings about whole files (default: none)."""
        return []

    def unverifiable(self) -> list[FileIssue]:
        """Files that belong to the checkpoint but whose content could not be verified (default: none)."""
        return []

    def ignored(self) -> tuple[str, ...]:
        """Paths (relative to :attr:`root`) deliberately left out, e.g. download bookkeeping (default: none)."""
        return ()

    def aliases(self) -> dict[str, str]:
        """Key -> an earlier key holding the very same tensor view (a tied weight), digested once (default: none)."""
        return {}

    def relative(self, path: Path) -> str:
        """``path`` relative to :attr:`root` (the name certificates and notes use)."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return path.name

    def close(self) -> None:
        """Release maps and handles (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SingleFileReader(CheckpointReader):
    """A checkpoint that is one mapped file (``self._file``, set by the subclass)."""

    _file: MappedFile

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.path,)

    def maps(self) -> dict[Path, MappedFile]:
        return {self.path: self._file}

    @property
    def mapped(self) -> MappedFile:
        """The file's read-only map (verification digests the whole file through it)."""
        return self._file

    def close(self) -> None:
        self._file.close()


#: dtypes that verification digests and scans; a tensor of another (quantized ``qint8``, packed
#: ``float4_e2m1fn_x2``) cannot be read as plain bits: torch crashes the process on some of them.
PLAIN_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "bits8",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
)


def unsupported_tensor(tensor: torch.Tensor) -> str | None:
    """Why verification cannot read ``tensor`` as dense bits (a meta, sparse, nested or quantized
    tensor, an unusual dtype), or None when it can. Readers refuse such a tensor when they load it."""
    if tensor.is_meta or tensor.device.type != "cpu":
        return f"a tensor on device {tensor.device.type} (no data in the file)"
    if tensor.layout != torch.strided or tensor.is_nested:
        return (
            f"a {'nested' if tensor.is_nested else str(tensor.layout).removeprefix('torch.')} tensor, not a dense one"
        )
    if tensor.is_quantized or tensor.dtype not in PLAIN_DTYPES:
        return f"a tensor of dtype {str(tensor.dtype).removeprefix('torch.')}, which verification does not read"
    return None
