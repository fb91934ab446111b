"""Read a ``.safetensors`` file with its structure checked, tensors as views of a read-only mmap.

Byte layout (little-endian)::

    0        u8           N, the header length in bytes
    8        N bytes      UTF-8 JSON object: {"__metadata__": {str: str} (optional),
                           NAME: {"dtype": "F32", "shape": [d0, d1, ...], "data_offsets": [BEGIN, END]}, ...}
    8 + N    data         the byte buffer; tensor NAME is data[BEGIN:END], row-major

Checks, each raising :class:`CheckpointError` with one line: the file holds the 8-byte length;
``N`` fits in the file (and is at most 100 MB, the limit of the safetensors library); the header
is a JSON object of well-formed entries with a known dtype; ``END - BEGIN`` equals
``prod(shape) * itemsize``; every range lies inside the data buffer; and the ranges, sorted,
tile the buffer exactly (no overlap, no gap, no trailing bytes). A truncated file fails the
range check and says how many bytes are missing.

Nothing is parsed with the ``safetensors`` library: the parse is small, and doing it here lets
every defect be named precisely without ever loading a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from sdc_forensics.checkpoint.base import MappedFile, SingleFileReader, TensorInfo, typed_view
from sdc_forensics.errors import CheckpointError
from sdc_forensics.untrusted import describe, is_int, load_json

MAX_HEADER_BYTES = 100_000_000
_INT64_MAX = (1 << 63) - 1

#: safetensors dtype code -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "U16": (torch.uint16, 2),
    "U32": (torch.uint32, 4),
    "U64": (torch.uint64, 8),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}


class SafetensorsReader(SingleFileReader):
    """One safetensors file. Structure is checked in the constructor.

    Args:
        path: the ``.safetensors`` file.
        root: directory that names are relative to (default: the file's directory).
        populate: pre-fault the mapping (worth it when every tensor will be read).
    """

    format = "safetensors"

    def __init__(self, path: str | Path, *, root: Path | None = None, populate: bool = False) -> None:
        path = Path(path)
        super().__init__(path, root if root is not None else path.parent)
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist or is not a file; pass a .safetensors file")
        self._file = MappedFile(path, populate=populate)
        try:
            self.metadata, self._entries, self.data_start = _parse(path, self._file)
        except CheckpointError:
            self._file.close()
            raise

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return [name for name, _, _, _ in self._entries]

    def infos(self) -> list[TensorInfo]:
        rel = self.relative(self.path)
        return [TensorInfo(key=name, dtype=str(dtype).removeprefix("torch."), shape=shape, file=rel) for name, dtype, shape, _ in self._entries]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by name, a zero-copy view of the map when its offset is aligned."""
        for entry_name, dtype, shape, (begin, end) in self._entries:
            if entry_name == name:
                raw = self._file.bytes[self.data_start + begin : self.data_start + end]
                return typed_view(raw, dtype, shape)
        raise CheckpointError(f"{self.path} has no tensor named {name!r}")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        data = self._file.bytes
        for name, dtype, shape, (begin, end) in self._entries:
            yield name, typed_view(data[self.data_start + begin : self.data_start + end], dtype, shape)

    def step(self) -> int | None:
        value = self.metadata.get("step")
        return int(value) if isinstance(value, str) and value.isdigit() else None


def _parse(path: Path, mapped: MappedFile):
    """Validate the header and the layout; ``(metadata, entries, data_start)``."""
    size = mapped.size
    buf = mapped.buffer()
    if size < 8:
        raise CheckpointError(f"{path} is {size} bytes, too short for a safetensors header (8-byte length): truncated or not safetensors")
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > size - 8:
        raise CheckpointError(
            f"{path}: header length {header_len} is larger than the file ({size} bytes): truncated or not safetensors"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {header_len} exceeds the 100 MB safetensors limit: not a valid file")
    try:
        header = load_json(buf[8 : 8 + header_len])  # ValueError for bad UTF-8/JSON, deep nesting, 5,000-digit integers
    except ValueError as exc:
        raise CheckpointError(f"{path}: the header is not valid UTF-8 JSON ({exc}): the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is JSON but not an object: the file is damaged or not safetensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + header_len
    data_len = size - data_start
    entries = [_entry(path, name, spec, data_len) for name, spec in header.items()]
    _check_tiling(path, entries, data_len)
    return metadata, entries, data_start


def _entry(path: Path, name: str, spec, data_len: int):
    if not isinstance(spec, dict) or set(spec) - {"dtype", "shape", "data_offsets"} or len(spec) != 3:
        raise CheckpointError(f"{path}: tensor {name!r} needs exactly dtype, shape and data_offsets in the header")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {describe(code)} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(is_int(d) and 0 <= d <= _INT64_MAX for d in shape):
        raise CheckpointError(f"{path}: tensor {name!r} has an invalid shape {describe(shape)} (a list of integers in 0..2^63-1)")
    if math.prod(d for d in shape if d) > _INT64_MAX:  # torch multiplies every dimension, zeros last or not
        raise CheckpointError(f"{path}: tensor {name!r} has shape dimensions whose product overflows 64 bits: the header is damaged")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) and 0 <= o <= _INT64_MAX for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {describe(offsets)} (two integers, begin <= end)")
    dtype, itemsize = DTYPES[code]
    begin, end = offsets
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} is {code} of shape {tuple(shape)}, which is {expected} bytes, "
            f"but its data_offsets span {end - begin} bytes: the header is inconsistent"
        )
    if end > data_len:
        raise CheckpointError(
            f"{path}: tensor {name!r} needs bytes {begin}..{end} of the data buffer, which holds only {data_len} bytes "
            f"({end - data_len} missing): the file is truncated or the offsets are out of range"
        )
    return name, dtype, tuple(shape), (begin, end)


def _check_tiling(path: Path, entries, data_len: int) -> None:
    """Sorted ranges must tile ``[0, data_len)``: no overlap, no gap, nothing after the last."""
    cursor = 0
    previous = None
    for name, _, _, (begin, end) in sorted(entries, key=lambda e: (e[3][0], e[3][1])):
        if begin < cursor:
            raise CheckpointError(
                f"{path}: tensors {previous!r} and {name!r} overlap (bytes {begin}..{cursor} of the data buffer): the header is inconsistent"
            )
        if begin > cursor:
            raise CheckpointError(f"{path}: bytes {cursor}..{begin} of the data buffer belong to no tensor: the header is inconsistent")
        cursor, previous = end, name
    if cursor != data_len:
        raise CheckpointError(
            f"{path}: {data_len - cursor} bytes after the last tensor belong to no tensor: the file has trailing data or a wrong header"
        )
