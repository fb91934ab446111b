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

Cost is linear in the header and bounded: the text is decoded straight from the map (one copy);
a header naming ``"data_offsets"`` more than ``ReadLimits.max_tensors`` times is refused before
it is parsed (a valid 99 MB header can list 1.5 M empty tensors), and the parse itself stops
as soon as it passes that many entries (keys spelt with JSON escapes); each entry becomes a
compact tuple as soon as it is parsed. An object that repeats a key is refused (which entry would count is undefined).

Nothing is parsed with the ``safetensors`` library: the parse is small, and doing it here lets
every defect be named precisely without ever loading a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch

from sdc_forensics.checkpoint.base import MappedFile, SingleFileReader, TensorInfo, typed_view
from sdc_forensics.checkpoint.limits import TENSORS_HINT, ReadLimits, check_inside, resolve
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
    # written by safetensors >= 0.5; their torch dtypes are newer than torch 2.3 (the oldest accepted)
    **{
        code: (getattr(torch, name), size)
        for code, name, size in (("C64", "complex64", 8), ("F8_E8M0", "float8_e8m0fnu", 1))
        if hasattr(torch, name)
    },
}
#: dtypes safetensors defines that are not read here (sub-byte floats, packed two or more to a byte): a file
#: holding one is intact as far as can be told, and its content is not verified (not "unknown", not damaged)
PACKED_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2"})


#: every dtype code safetensors (0.8) defines
_SAFETENSORS_DTYPES = frozenset(
    {
        "BOOL",
        "F4",
        "F6_E2M3",
        "F6_E3M2",
        "U8",
        "I8",
        "F8_E5M2",
        "F8_E4M3",
        "F8_E8M0",
        "I16",
        "U16",
        "F16",
        "BF16",
        "I32",
        "U32",
        "F32",
        "C64",
        "F64",
        "I64",
        "U64",
    }
)


class SafetensorsReader(SingleFileReader):
    """One safetensors file. Structure is checked in the constructor.

    Args:
        path: the ``.safetensors`` file.
        root: directory that names are relative to (default: the file's directory).
        populate: pre-fault the mapping (worth it when every tensor will be read).
        limits: what reading it may cost, where links may lead (default: ``limits.current_limits()``).
    """

    format = "safetensors"

    def __init__(
        self, path: str | Path, *, root: Path | None = None, populate: bool = False, limits: ReadLimits | None = None
    ) -> None:
        path = Path(path)
        super().__init__(path, root if root is not None else path.parent)
        limits = resolve(limits)
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist or is not a file; pass a .safetensors file")
        check_inside(path, self.root, limits)
        self._file = MappedFile(path, populate=populate)
        try:
            self.metadata, self._entries, self.data_start = _parse(path, self._file, limits.max_tensors)
        except CheckpointError:
            self._file.close()
            raise

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._entries)

    def infos(self) -> list[TensorInfo]:
        rel = self.relative(self.path)
        return [
            TensorInfo(key=name, dtype=_NAMES[code], shape=shape, file=rel)
            for name, (code, shape, _) in self._entries.items()
        ]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by name, a zero-copy view of the map when its offset is aligned."""
        if name not in self._entries:
            raise CheckpointError(f"{self.path} has no tensor named {name!r}")
        code, shape, (begin, end) = self._entries[name]
        return typed_view(self._file.bytes[self.data_start + begin : self.data_start + end], DTYPES[code][0], shape)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        data = self._file.bytes
        for name, (code, shape, (begin, end)) in self._entries.items():
            yield name, typed_view(data[self.data_start + begin : self.data_start + end], DTYPES[code][0], shape)

    def step(self) -> int | None:
        value = self.metadata.get("step")
        return int(value) if isinstance(value, str) and value.isdigit() else None


_SPEC_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_CODES = {code: code for code in DTYPES}
_NAMES = {code: str(dtype).removeprefix("torch.") for code, (dtype, _) in DTYPES.items()}


class _Spec(tuple):
    """``(dtype, shape, data_offsets)`` of one header entry, its JSON lists made plain tuples."""

    __slots__ = ()


class _Header:
    """``object_pairs_hook`` of the header parse: an object with exactly the three keys of a tensor
    entry becomes a :class:`_Spec` (its lists plain tuples: JSON makes no tuples, so neither can be
    mistaken for anything else), checked later with its name; every other object a dict. Raises
    as soon as more than ``max_tensors`` entries were parsed."""

    def __init__(self, path: Path, max_tensors: int) -> None:
        self.path, self.max_tensors, self.count = path, max_tensors, 0

    def __call__(self, pairs: list[tuple[str, object]]):
        obj = dict(pairs)
        if len(pairs) == 3 and obj.keys() == _SPEC_KEYS:
            self.count += 1
            if self.count > self.max_tensors:
                raise CheckpointError(
                    f"{self.path}: the header lists more than {self.max_tensors} tensors; raise {TENSORS_HINT} if you trust the file"
                )
            code, shape, offsets = obj["dtype"], obj["shape"], obj["data_offsets"]
            # one shared string per dtype
            code = _CODES.get(code, code) if type(code) is str else code
            return _Spec(
                (
                    code,
                    tuple(shape) if isinstance(shape, list) else shape,
                    tuple(offsets) if isinstance(offsets, list) else offsets,
                )
            )
        if len(obj) != len(pairs):
            seen: set[str] = set()
            repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
            raise CheckpointError(
                f"{self.path}: the header repeats the key {repeated[:80]!r} in one object: damaged or crafted"
            )
        return obj


def _parse(path: Path, mapped: MappedFile, max_tensors: int):
    """Validate the header and the layout; ``(metadata, entries, data_start)``, entries mapping
    each name to its ``(dtype code, shape, (begin, end))`` in file order."""
    size = mapped.size
    buf = mapped.buffer()
    if size < 8:
        raise CheckpointError(
            f"{path} is {size} bytes, too short for a safetensors header (8-byte length): truncated or not safetensors"
        )
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > size - 8:
        raise CheckpointError(
            f"{path}: header length {header_len} is larger than the file ({size} bytes): truncated or not safetensors"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path}: header length {header_len} exceeds the 100 MB safetensors limit: not a valid file"
        )
    try:
        # one copy, straight from the map
        text = str(buf[8 : 8 + header_len], "utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{path}: the header is not valid UTF-8 JSON (not UTF-8: {exc.reason} at byte {exc.start}): "
            "the file is damaged or not safetensors"
        ) from None
    keys = text.count(
        '"data_offsets"'
        # at least one per entry as writers spell it: refuse a huge header before parsing it
    )
    if keys > max_tensors:
        raise CheckpointError(
            f'{path}: the header names "data_offsets" {keys} times: more than the {max_tensors} tensors allowed; '
            f"raise {TENSORS_HINT} if you trust the file"
        )
    try:
        header = load_json(
            text,
            object_pairs_hook=_Header(path, max_tensors),
            # ValueError: bad JSON, deep nesting, 5,000-digit integers
        )
    except ValueError as exc:
        raise CheckpointError(
            f"{path}: the header is not valid UTF-8 JSON ({exc}): the file is damaged or not safetensors"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is JSON but not an object: the file is damaged or not safetensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + header_len
    data_len = size - data_start
    for name, spec in header.items():
        _entry(path, name, spec, data_len)
    _check_tiling(path, header, data_len)
    return metadata, header, data_start


def _entry(path: Path, name: str, spec, data_len: int) -> None:
    """Raise :class:`CheckpointError` unless ``spec`` is a well-formed entry inside the data buffer."""
    # made by _Header for an object with exactly the three keys
    if not isinstance(spec, _Spec):
        raise CheckpointError(f"{path}: tensor {name[:80]!r} needs exactly dtype, shape and data_offsets in the header")
    code, shape, offsets = spec
    if isinstance(code, str) and code in PACKED_DTYPES | _SAFETENSORS_DTYPES - DTYPES.keys():
        from sdc_forensics.checkpoint.torch_reader import TensorNotReadable

        raise TensorNotReadable(
            f"{path}: tensor {name[:80]!r} has dtype {code}, which safetensors writes and sdc-forensics does not read "
            "as bits yet: its content is not verified"
        )
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name[:80]!r} has unknown dtype {describe(code)} (known: {', '.join(DTYPES)})"
        )
    if type(shape) is not tuple or not all(
        is_int(d) and 0 <= d <= _INT64_MAX
        for d in shape
        # a JSON list, made a tuple
    ):
        raise CheckpointError(
            f"{path}: tensor {name[:80]!r} has an invalid shape {_describe(shape)} (a list of integers in 0..2^63-1)"
        )
    # torch multiplies every dimension, zeros last or not
    if math.prod(d for d in shape if d) > _INT64_MAX:
        raise CheckpointError(
            f"{path}: tensor {name[:80]!r} has shape dimensions whose product overflows 64 bits: the header is damaged"
        )
    if (
        type(offsets) is not tuple
        or len(offsets) != 2
        or not all(is_int(o) and 0 <= o <= _INT64_MAX for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise CheckpointError(
            f"{path}: tensor {name[:80]!r} has invalid data_offsets {_describe(offsets)} (two integers, begin <= end)"
        )
    itemsize = DTYPES[code][1]
    begin, end = offsets
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name[:80]!r} is {code} of shape {shape}, which is {expected} bytes, "
            f"but its data_offsets span {end - begin} bytes: the header is inconsistent"
        )
    if end > data_len:
        raise CheckpointError(
            f"{path}: tensor {name[:80]!r} needs bytes {begin}..{end} of the data buffer, which holds only {data_len} bytes "
            f"({end - data_len} missing): the file is truncated or the offsets are out of range"
        )


def _describe(value) -> str:
    """:func:`describe` of a header value (a list the parse made a tuple shown as the list it was)."""
    return describe(list(value) if type(value) is tuple else value)


def _check_tiling(path: Path, entries: dict, data_len: int) -> None:
    """Sorted ranges must tile ``[0, data_len)``: no overlap, no gap, nothing after the last."""
    cursor = 0
    previous = None
    # by (begin, end)
    for name in sorted(entries, key=lambda name: entries[name][2]):
        begin, end = entries[name][2]
        if begin < cursor:
            raise CheckpointError(
                f"{path}: tensors {previous[:80]!r} and {name[:80]!r} overlap (bytes {begin}..{cursor} of the data buffer): the header is inconsistent"
            )
        if begin > cursor:
            raise CheckpointError(
                f"{path}: bytes {cursor}..{begin} of the data buffer belong to no tensor: the header is inconsistent"
            )
        cursor, previous = end, name
    if cursor != data_len:
        raise CheckpointError(
            f"{path}: {data_len - cursor} bytes after the last tensor belong to no tensor: the file has trailing data or a wrong header"
        )
