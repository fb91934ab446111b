"""Read a ``torch.distributed.checkpoint`` (DCP) directory without a process group or a pickle run.

Layout (``FileSystemWriter``)::

    DIR/.metadata            pickled ``Metadata``: state_dict_metadata (FQN -> tensor dtype, size,
                             chunks (offsets, sizes) | bytes object) and storage_data
                             (MetadataIndex(fqn, chunk offset) -> _StorageInfo(relative_path,
                             offset, length, transform_descriptors))
    DIR/__R_I.distcp         concatenated items; a tensor chunk is one ``torch.save`` of that
                             chunk at [offset, offset + length)

``.metadata`` is a plain pickle, so it is unpickled here with an allow-list of the DCP metadata
classes, torch dtypes, ``torch.Size`` and ``pathlib`` paths; anything else is refused. Checks:
the metadata exists and loads; every tensor's chunks lie inside it, do not overlap and cover
it exactly (sum of chunk volumes = numel); every chunk and every bytes item has a storage entry
whose file exists inside DIR and holds the byte range; no storage transforms (compression) are
used. Tensors are read one at a time: each chunk with ``torch.load(weights_only=True)`` from a
view of a read-only map of its ``.distcp`` file, assembled into the full tensor.

Cost is bounded by the files (``limits.py``), every check linear or ``n log n`` in the metadata:
at most ``max_tensors`` tensors and ``MAX_DIMS`` dimensions; each tensor's chunk list its own
(a list shared by many tensors would be walked once per tensor: a bomb); the items of one file
never share bytes (DCP writes each once) and each chunk's bytes fit in its item, so assembling a
tensor never allocates more than the files hold; the tiling check is the corner-parity test
(:func:`_check_coverage`), not a comparison of every pair of chunks (20,000 one-element chunks
took minutes). Data files are resolved before they are mapped: one that links out of DIR (and
out of every ``--allow-root``) is refused. A compressed member inside an item is checked against
its declared size and ``max_inflate_bytes`` before it is inflated.

Over 400 lines on purpose: the ``.metadata`` unpickler, the storage-item resolver and the shard
readers are one reader of one format, each trusting only what the previous part checked.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import pathlib
import pickle
import pickletools
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sdc_forensics.checkpoint.base import (
    PLAIN_DTYPES,
    CheckpointReader,
    FileIssue,
    MappedFile,
    TensorInfo,
    unsupported_tensor,
)
from sdc_forensics.checkpoint.limits import (
    MAX_DIMS,
    TENSORS_HINT,
    ReadLimits,
    check_inside,
    inflate_member,
    resolve,
    why_not_a_file,
)
from sdc_forensics.errors import CheckpointError

METADATA_NAME = ".metadata"
#: Corners the tiling check may toggle for one tensor (chunks x 2^split dimensions).
_MAX_CORNERS = 1 << 24


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only what a DCP ``.metadata`` legitimately contains.

    Naming only allow-listed globals is not enough: a pickle's BUILD on a class it may name sets
    class attributes (``PosixPath.is_relative_to = PosixPath`` defeated the check that data files
    lie inside the checkpoint, for the whole process). Every global handed out is remembered with
    its attributes, and :meth:`load` puts back and refuses any that the pickle changed.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._handed: dict[int, tuple[Any, dict]] = {}

    def load(self):
        try:
            return super().load()
        finally:
            changed = [_restore(obj, before) for obj, before in self._handed.values()]
            changed = [name for name in changed if name]
            if changed:
                raise pickle.UnpicklingError(
                    f"the pickle changes attributes of {', '.join(changed[:3])} (a crafted file); changes undone"
                )

    def find_class(self, module: str, name: str):
        found = self._allowed(module, name)
        if id(found) not in self._handed:
            self._handed[id(found)] = (found, _attributes(found))
        return found

    def _allowed(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata":
            from torch.distributed.checkpoint import metadata

            found = getattr(metadata, name, None)
            # its own classes, nothing it imported
            if isinstance(found, type) and found.__module__ == module:
                return found
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            return _StorageInfo
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


#: what a pickle could set on a function it may name (its own attributes live in ``__dict__``)
_FUNCTION_SLOTS = ("__defaults__", "__kwdefaults__", "__code__")


def _attributes(obj: Any) -> dict:
    """What a pickle's BUILD could change on ``obj``: its own attributes (a class's or function's)."""
    own = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    return {"dict": own, **{slot: getattr(obj, slot) for slot in _FUNCTION_SLOTS if hasattr(obj, slot)}}


def _restore(obj: Any, before: dict) -> str:
    """Put ``obj``'s attributes back as :func:`_attributes` found them; its name if any had changed, else ""."""
    now = _attributes(obj)
    same = now.keys() == before.keys() and all(now[k] is before[k] for k in now if k != "dict")
    old, new = before["dict"], now["dict"]
    same = same and old.keys() == new.keys() and all(new[k] is old[k] for k in old)
    if same:
        return ""
    for key in set(new) - set(old):
        with contextlib.suppress(AttributeError, TypeError):
            delattr(obj, key)
    for key, value in old.items():
        if new.get(key, _MISSING) is not value:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(obj, key, value)
    for slot in _FUNCTION_SLOTS:
        if slot in before and getattr(obj, slot) is not before[slot]:
            setattr(obj, slot, before[slot])
    return getattr(obj, "__qualname__", type(obj).__name__)


class DcpReader(CheckpointReader):
    """A DCP checkpoint directory. Structure and coverage are checked in the constructor.

    Args:
        directory: the checkpoint directory.
        limits: what reading it may cost, where links may lead (default: ``limits.current_limits()``).
    """

    format = "dcp"

    def __init__(self, directory: str | Path, *, limits: ReadLimits | None = None) -> None:
        directory = Path(directory)
        super().__init__(directory, directory)
        self._limits = resolve(limits)
        meta_path = directory / METADATA_NAME
        if not meta_path.is_file():
            raise CheckpointError(
                f"{directory} has no {METADATA_NAME}: not a complete torch.distributed.checkpoint directory "
                "(the save was interrupted, or this is another format)"
            )
        check_inside(meta_path, self.root, self._limits, "metadata")
        self.metadata = _load_metadata(meta_path, self._limits)
        self._files: dict[str, MappedFile] = {}
        self._issues: list[FileIssue] = []
        self._bytes_checked = False
        try:
            self._plan = self._check()
        except CheckpointError:
            self.close()
            raise

    def _mapped(self, relative_path: str) -> MappedFile:
        if relative_path not in self._files:
            self._files[relative_path] = MappedFile(self.root / relative_path)
        return self._files[relative_path]

    def _check(self) -> dict[str, list[tuple[Any, Any]]]:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

        storage = getattr(self.metadata, "storage_data", None)
        state = getattr(self.metadata, "state_dict_metadata", None)
        if not isinstance(storage, dict) or not isinstance(state, dict):
            raise CheckpointError(f"{self.root}/{METADATA_NAME} lacks storage_data or state_dict_metadata: damaged")
        # file -> (offset, end, item name) of its items
        items: dict[str, list[tuple[int, int, str]]] = {}
        for index, info in storage.items():
            rel = str(getattr(info, "relative_path", ""))
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{self.root}: item {index.fqn!r} uses storage transforms {info.transform_descriptors}, which this reader does not support"
                )
            # each file checked once, however many items name it
            if rel not in items:
                self._check_file(rel, index.fqn)
                items[rel] = []
            size = self._files[rel].size
            if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
                raise CheckpointError(
                    f"{self.root}: item {index.fqn!r} needs bytes {info.offset}..{info.offset + info.length} of {rel}, "
                    f"which has {size}: the file is truncated"
                )
            if info.length:
                offset = getattr(index, "offset", None)
                items[rel].append(
                    (
                        info.offset,
                        info.offset + info.length,
                        f"{index.fqn[:80]!r}" + (f" at {tuple(offset)}" if offset is not None else ""),
                    )
                )
        for rel, spans in items.items():
            spans.sort()
            for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
                if start < end:
                    raise CheckpointError(
                        f"{self.root}: items {first} and {second} share bytes {start}..{end} of {rel}; DCP writes each item "
                        "once: the metadata is damaged or crafted"
                    )
        plan: dict[str, list[tuple[Any, Any]]] = {}
        for fqn, meta in state.items():
            if isinstance(meta, BytesStorageMetadata):
                if MetadataIndex(fqn) not in storage:
                    raise CheckpointError(f"{self.root}: bytes item {fqn!r} has no storage entry in {METADATA_NAME}")
                continue
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{self.root}: {fqn!r} has unknown metadata type {type(meta).__name__}")
            plan[fqn] = [(chunk, storage.get(MetadataIndex(fqn, torch.Size(chunk.offsets)))) for chunk in meta.chunks]
            _check_coverage(self.root, fqn, tuple(meta.size), plan[fqn])
            itemsize = meta.properties.dtype.itemsize
            for chunk, info in plan[fqn]:
                if math.prod(chunk.sizes) * itemsize > info.length:
                    raise CheckpointError(
                        f"{self.root}: the chunk of {fqn!r} at offsets {tuple(chunk.offsets)} holds {math.prod(chunk.sizes) * itemsize} bytes "
                        f"of {meta.properties.dtype}, more than the {info.length} bytes of its item: the metadata is damaged or crafted"
                    )
        return plan

    def _check_file(self, rel: str, fqn: str) -> None:
        """A data file named by the metadata: inside DIR (links resolved), existing; then mapped."""
        if not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(
                f"{self.root}: item {fqn!r} is stored in {rel[:200]!r}, outside the checkpoint directory"
            )
        path = self.root / rel
        try:
            found = path.is_file()
        # ENAMETOOLONG, EACCES
        except OSError as exc:
            raise CheckpointError(
                f"{self.root}: file {rel[:200]!r} named by the metadata for {fqn!r} cannot be looked up ({exc.strerror})"
            ) from None
        if not found:
            raise CheckpointError(
                f"{self.root}: file {rel} named by the metadata for {fqn!r} {why_not_a_file(path)}: the checkpoint is incomplete"
            )
        check_inside(path, self.root, self._limits, "data file")
        self._mapped(rel)

    @property
    def files(self) -> tuple[Path, ...]:
        names = {METADATA_NAME} | {str(info.relative_path) for info in self.metadata.storage_data.values()}
        return tuple(self.root / name for name in sorted(names))

    def maps(self) -> dict[Path, MappedFile]:
        return {self.root / rel: mapped for rel, mapped in self._files.items()}

    def infos(self) -> list[TensorInfo]:
        state = self.metadata.state_dict_metadata
        out = []
        for fqn, chunks in self._plan.items():
            meta = state[fqn]
            files = sorted({str(info.relative_path) for _, info in chunks})
            out.append(
                TensorInfo(
                    key=fqn,
                    dtype=str(meta.properties.dtype).removeprefix("torch."),
                    shape=tuple(meta.size),
                    file=",".join(files),
                )
            )
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self._bytes_checked:
            self._bytes_checked = True
            self._check_bytes_items()
        state = self.metadata.state_dict_metadata
        for fqn, chunks in self._plan.items():
            meta = state[fqn]
            if len(chunks) == 1 and tuple(chunks[0][0].sizes) == tuple(meta.size):
                yield fqn, self._read_chunk(fqn, chunks[0][0], chunks[0][1], meta.properties.dtype)
                continue
            full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            for chunk, info in chunks:
                part = self._read_chunk(fqn, chunk, info, meta.properties.dtype)
                index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                full[index] = part
            yield fqn, full

    def _item_bytes(self, info) -> io.BytesIO:
        """The stored bytes of one item (a chunk or a bytes item), copied out of the mapped file."""
        view = self._mapped(str(info.relative_path)).buffer()[info.offset : info.offset + info.length]
        try:
            return io.BytesIO(view)
        finally:
            view.release()

    def _read_chunk(self, fqn: str, chunk, info, dtype: torch.dtype) -> torch.Tensor:
        data = self._item_bytes(info)
        self._check_crc(f"chunk of {fqn!r}", f"the chunk of {fqn!r} at offsets {tuple(chunk.offsets)}", info, data)
        try:
            # torch warns about a pickle protocol other than its own on stderr: the error line says what is wrong
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tensor = torch.load(data, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure means this item is unreadable
            raise CheckpointError(
                f"{self.root}: chunk of {fqn!r} in {info.relative_path} cannot be read ({type(exc).__name__}): damaged"
            ) from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(chunk.sizes) or tensor.dtype != dtype:
            raise CheckpointError(
                f"{self.root}: chunk of {fqn!r} in {info.relative_path} does not match its metadata (shape or dtype)"
            )
        why = unsupported_tensor(tensor)
        if why is not None:
            raise CheckpointError(
                f"{self.root}: chunk of {fqn!r} in {info.relative_path} is {why}: it cannot be verified"
            )
        return tensor

    def _check_bytes_items(self) -> None:
        """Every bytes item (a step count, an optimizer's param_groups, a scheduler's state) is a small
        torch.save zip too: its CRC-32 says whether its bytes changed; it is never unpickled here."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        for fqn, meta in self.metadata.state_dict_metadata.items():
            if not isinstance(meta, BytesStorageMetadata):
                continue
            info = self.metadata.storage_data[MetadataIndex(fqn)]
            self._check_crc(f"bytes item {fqn!r}", f"the bytes item {fqn!r}", info, self._item_bytes(info))

    def _check_crc(self, item: str, named: str, info, data: io.BytesIO) -> None:
        """An item is a small torch.save zip: its members' CRC-32 say whether its bytes changed.
        A compressed member is checked against its declared size and the limit before inflating.

        Args:
            item: the item in an error line (``chunk of 'w'``); named: in a finding (``the chunk of 'w' at offsets (0,)``).
        """
        where = f"{self.root}: {item} in {info.relative_path}"
        try:
            with zipfile.ZipFile(data) as archive:
                for member in archive.infolist():
                    if member.compress_type == zipfile.ZIP_STORED:
                        # raises BadZipFile on a CRC mismatch
                        archive.read(member)
                    elif not inflate_member(archive, member, self._limits, where)[0]:
                        raise zipfile.BadZipFile(f"Bad CRC-32 for file {member.filename!r}")
        # a flipped byte in a member name flagged UTF-8
        except UnicodeDecodeError as exc:
            raise CheckpointError(
                f"{where} has a zip entry name {exc.object[:80]!r} that is not valid UTF-8: its bytes are damaged"
            ) from None
        except (zlib.error, EOFError, ValueError, struct.error, NotImplementedError, RuntimeError, OSError) as exc:
            raise CheckpointError(
                f"{where} is not a readable torch.save archive ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        except zipfile.BadZipFile as exc:
            if "CRC" not in str(exc):
                raise CheckpointError(f"{where} is not a torch.save archive ({str(exc)[:200]})") from None
            self._issues.append(
                FileIssue(
                    file=str(info.relative_path),
                    detail=f"zip CRC-32 of {named} does not match: its bytes changed after saving",
                )
            )
        data.seek(0)

    def file_issues(self) -> list[FileIssue]:
        return list(self._issues)

    def step(self) -> int | None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        meta = self.metadata.state_dict_metadata.get("step")
        if isinstance(meta, BytesStorageMetadata):
            info = self.metadata.storage_data[MetadataIndex("step")]
            try:
                data = self._item_bytes(info)
                # no member inflated beyond the limit by torch.load
                with zipfile.ZipFile(data) as archive:
                    for member in archive.infolist():
                        if member.compress_type != zipfile.ZIP_STORED:
                            inflate_member(archive, member, self._limits, str(self.root))
                data.seek(0)
                value = torch.load(data, weights_only=True)
            except Exception:  # noqa: BLE001 - an unreadable step is simply unknown
                return None
            return value if isinstance(value, int) and not isinstance(value, bool) else None
        return None

    def close(self) -> None:
        for mapped in self._files.values():
            mapped.close()
        self._files = {}


def _load_metadata(meta_path: Path, limits: ReadLimits):
    try:
        with open(meta_path, "rb") as fh:
            data = fh.read()
        # lengths checked first: a bytearray8 claiming exabytes made CPython's
        for _ in pickletools.genops(data):
            # unpickler print "SystemError: deallocated bytearray..." to stderr
            pass
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - only allow-listed classes are built; any failure means "damaged metadata"
        # (UnpicklingError, EOFError, a RuntimeError from TensorProperties.__setstate__, RecursionError, ...)
        text = " ".join(str(exc).split())[:200]
        raise CheckpointError(
            f"{meta_path} cannot be loaded safely ({type(exc).__name__}: {text}): damaged or not DCP metadata"
        ) from None
    if type(metadata).__name__ != "Metadata":
        raise CheckpointError(f"{meta_path} does not hold DCP Metadata (found {type(metadata).__name__})")
    _check_types(meta_path, metadata, limits)
    return metadata


_MISSING = object()
_INT64_MAX = (1 << 63) - 1


def _dims(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of at most ``MAX_DIMS`` integers in 0..2^63-1 (a torch.Size, tuple or list), else None."""
    if (
        not isinstance(value, (tuple, list))
        or len(value) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _INT64_MAX for d in value)
    ):
        return None
    return tuple(value)


def _check_types(meta_path: Path, metadata, limits: ReadLimits) -> None:
    """Every field the reader uses has the type and range DCP writes, or :class:`CheckpointError`.

    The unpickler only builds allow-listed classes, but their fields can hold anything (a string
    offset, a None chunk list, a missing attribute); this is checked once here, at the parse
    boundary, so the checks and reads after it never meet a wrong type.
    """
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    def bad(what: str, expected: str, value: Any) -> CheckpointError:
        found = "nothing" if value is _MISSING or value is None else f"a value of type {type(value).__name__}"
        return CheckpointError(
            f"{meta_path}: {what} must be {expected}, found {found}: the metadata is damaged or not DCP's"
        )

    dims = f"a tuple of at most {MAX_DIMS} integers in 0..2^63-1"
    state = getattr(metadata, "state_dict_metadata", _MISSING)
    storage = getattr(metadata, "storage_data", _MISSING)
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{meta_path} lacks storage_data or state_dict_metadata: damaged")
    if len(state) > limits.max_tensors:
        raise CheckpointError(
            f"{meta_path} lists {len(state)} items, more than {limits.max_tensors}; raise {TENSORS_HINT} if you trust the file"
        )
    chunk_lists: set[int] = set()
    for fqn, meta in state.items():
        if not isinstance(fqn, str):
            raise bad("a state_dict_metadata key", "a string", fqn)
        if isinstance(meta, BytesStorageMetadata):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{meta_path}: {fqn!r} has unknown metadata type {type(meta).__name__}")
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if (
            not isinstance(dtype, torch.dtype) or dtype not in PLAIN_DTYPES
            # a quantized dtype crashes torch when read as bits
        ):
            raise bad(f"the dtype of {fqn!r}", "a plain torch dtype (not quantized)", dtype)
        size = _dims(getattr(meta, "size", None))
        if size is None or math.prod(d for d in size if d) > _INT64_MAX:
            raise bad(
                f"the size of {fqn!r}", dims + " with a product that fits in 64 bits", getattr(meta, "size", None)
            )
        chunks = getattr(meta, "chunks", None)
        if not isinstance(chunks, list):
            raise bad(f"the chunk list of {fqn!r}", "a list", chunks)
        if id(chunks) in chunk_lists:
            raise CheckpointError(
                f"{meta_path}: {fqn!r} shares its chunk list with another tensor; DCP writes one per tensor: crafted metadata"
            )
        chunk_lists.add(id(chunks))
        for chunk in chunks:
            if not isinstance(chunk, ChunkStorageMetadata):
                raise bad(f"a chunk of {fqn!r}", "a ChunkStorageMetadata", chunk)
            for name in ("offsets", "sizes"):
                if _dims(getattr(chunk, name, None)) is None:
                    raise bad(f"the {name} of a chunk of {fqn!r}", dims, getattr(chunk, name, None))
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
            raise bad("a storage_data key", "a MetadataIndex with a string fqn", index)
        if (
            getattr(index, "offset", None) is not None and _dims(index.offset) is None
            # a chunk's offsets: how chunks find their item
        ):
            raise bad(f"the offset of storage key {index.fqn[:80]!r}", dims + " or nothing", index.offset)
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, (str, pathlib.PurePath)):
            raise bad(f"the file name of item {index.fqn!r}", "a string", rel)
        for name in ("offset", "length"):
            value = getattr(info, name, None)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _INT64_MAX:
                raise bad(f"the {name} of item {index.fqn!r}", "an integer in 0..2^63-1", value)
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not isinstance(transforms, (list, tuple)):
            raise bad(f"the storage transforms of item {index.fqn!r}", "a list or nothing", transforms)


def _check_coverage(root: Path, fqn: str, size: tuple[int, ...], chunks) -> None:
    """Chunks must lie in the tensor, not overlap, and cover all of it; linear in the chunks.

    With every chunk inside the tensor and their volumes summing to its numel, they tile it
    exactly when, counting each non-empty chunk's 2^d corners modulo 2, the corners left are
    exactly the tensor's own: the corner parities fix ``g mod 2``, where ``g(x)`` counts the
    chunks holding element ``x`` (a d-fold prefix sum of them); so ``g`` is odd on the tensor,
    hence >= 1, and sums to numel, hence is 1 everywhere. Dimensions that no chunk splits are
    left out (a chunk spans all of them), so d is 1 or 2 in practice; chunks x 2^d corners are
    bounded by ``_MAX_CORNERS``.
    """
    boxes = []
    for chunk, info in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + s > d for o, s, d in zip(offsets, sizes, size))
        ):
            raise CheckpointError(
                f"{root}: a chunk of {fqn!r} (offsets {offsets}, sizes {sizes}) lies outside its size {size}"
            )
        if info is None:
            raise CheckpointError(
                f"{root}: the chunk of {fqn!r} at offsets {offsets} has no storage entry: the metadata is incomplete"
            )
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    total = math.prod(size)
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != total:
        raise CheckpointError(
            f"{root}: the chunks of {fqn!r} cover {covered} of its {total} elements: the checkpoint is incomplete"
            if covered < total
            else f"{root}: the chunks of {fqn!r} hold {covered} elements for its {total}: chunks overlap or repeat, which "
            "DCP never writes (damaged or crafted metadata)"
        )
    split = [d for d in range(len(size)) if any(o[d] or s[d] != size[d] for o, s in boxes)]
    if not total or not split:
        # nothing to cover, or one chunk spanning the whole tensor (volumes sum to numel)
        return
    if len(boxes) << len(split) > _MAX_CORNERS:
        raise CheckpointError(
            f"{root}: {fqn!r} is split into {len(boxes)} chunks along {len(split)} dimensions, too many to check "
            f"({len(boxes)} x 2^{len(split)} corners > {_MAX_CORNERS}): not a layout DCP writes"
        )
    # the common case (FSDP, dim-0 shards): sorted intervals name the overlap
    if len(split) == 1:
        d = split[0]
        spans = sorted((o[d], o[d] + s[d], o) for o, s in boxes)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise CheckpointError(
                    f"{root}: chunks of {fqn!r} at offsets {first} and {second} overlap: the metadata is inconsistent"
                )
            if start > end:
                raise CheckpointError(
                    f"{root}: the chunks of {fqn!r} leave {end}..{start} of dimension {d} uncovered and overlap elsewhere: "
                    "the metadata is inconsistent"
                )
        return
    corners: set[tuple[int, ...]] = set()
    for o, s in boxes:
        corners.symmetric_difference_update(itertools.product(*((o[d], o[d] + s[d]) for d in split)))
    if corners != set(itertools.product(*((0, size[d]) for d in split))):
        raise CheckpointError(
            f"{root}: chunks of {fqn!r} overlap (their corners do not tile its size {size}): the metadata is inconsistent"
        )
