"""Read a ``torch.save`` checkpoint (``.pt``/``.pth``/``.bin``) without ever running its pickle.

``torch.save`` writes a zip archive (members stored uncompressed)::

    PREFIX/data.pkl       the pickled object; tensors are persistent ids naming a storage
    PREFIX/data/K         raw bytes of storage K, 64-byte aligned in the file
    PREFIX/byteorder, PREFIX/version, PREFIX/.format_version, ...
    central directory     one entry per member, each with the CRC-32 of its bytes

Checks, in order (a failure raises :class:`CheckpointError`, one line):

1. the file is a zip archive with a central directory (a truncated file has none; a raw or
   legacy pickle is refused: it is never unpickled);
2. every member lies inside the file and has a local header where the directory says;
3. ``data.pkl`` is scanned opcode by opcode, without executing it: every global it references
   must be on torch's ``weights_only`` allow-list (a ``__reduce__`` payload naming ``os.system``
   or ``builtins.open`` is refused here, naming the global, as :class:`PickleRefused`: the
   file may be intact, it is just not loadable safely, and a checkpoint folder lists it as not
   verifiable rather than damaged);
4. ``torch.load(weights_only=True, mmap=True)`` builds the object: tensors are views of a
   private read-only-in-practice map of the file, not copies.

CRC-32 of each member is recomputed over the map. A mismatch in ``data.pkl`` or another
metadata member is structural (exit 3); in a ``data/K`` storage member the file is still
readable and the mismatch is reported as a :class:`FileIssue` (content corruption, exit 1),
next to the per-tensor digests that say which tensor changed.
"""

from __future__ import annotations

import pickletools
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sdc_forensics.checkpoint.base import FileIssue, MappedFile, SingleFileReader, TensorInfo, unsupported_tensor
from sdc_forensics.errors import CheckpointError
from sdc_forensics.statedict import flatten_state

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
_WEIGHTS_ONLY_REFUSAL = "Weights only load failed"


class PickleRefused(CheckpointError):
    """The file is intact as far as can be told, but loading it would need a pickle global outside
    the ``weights_only`` allow-list (or a legacy raw pickle): it is not loaded, so not verified.

    Attributes:
        refused: the globals that were refused (empty for a legacy pickle).
    """

    def __init__(self, message: str, refused: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.refused = refused
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def _allowed_globals() -> set[str] | None:
    """``module.name`` of every global ``weights_only`` loading accepts; None if unknown."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
    except ImportError:  # a future torch moved it: rely on weights_only alone
        return None
    allowed = set(_get_allowed_globals())
    for obj in torch.serialization.get_safe_globals():
        obj = obj[0] if isinstance(obj, tuple) else obj
        allowed.add(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
    return allowed


def pickle_globals(data: bytes) -> list[str]:
    """Every global (``module.name``) a pickle references, found without unpickling it.

    ``STACK_GLOBAL`` takes its module and name from the two values pushed before it, directly
    or through the memo; both are followed here. A global whose name cannot be resolved this
    way is reported as ``<unresolved>`` (and refused by the caller).
    """
    found: list[str] = []
    pushed: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in _STRING_OPS:
                pushed.append(arg if isinstance(arg, str) else arg.decode("latin-1") if isinstance(arg, bytes) else arg)
            elif name in ("MEMOIZE",):
                memo[len(memo)] = pushed[-1] if pushed else None
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = pushed[-1] if pushed else None
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                pushed.append(memo.get(int(arg)))
            elif name == "GLOBAL":
                found.append(str(arg).replace(" ", "."))
                pushed.append(None)
            elif name == "STACK_GLOBAL":
                module, attr = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)
                found.append(f"{module}.{attr}" if isinstance(module, str) and isinstance(attr, str) else "<unresolved>")
                pushed.append(None)
            elif name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4"):
                found.append(f"<{name} opcode>" if name != "INST" else str(arg).replace(" ", "."))
            else:
                pushed.append(None)
    except ValueError as exc:
        raise CheckpointError(f"the pickle is malformed ({exc})") from None
    return found


class TorchReader(SingleFileReader):
    """A ``torch.save`` zip checkpoint. Structure and the pickle scan happen in the constructor.

    Args:
        path: the checkpoint file.
        root: the directory its name is relative to (default: its own).

    Raises:
        PickleRefused: loading would run a pickle global outside the allow-list (or a legacy pickle).
        CheckpointError: the file is truncated, damaged or not a ``torch.save`` archive.
    """

    format = "torch"

    def __init__(self, path: str | Path, *, root: Path | None = None) -> None:
        path = Path(path)
        super().__init__(path, root if root is not None else path.parent)
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist or is not a file; pass a torch.save checkpoint")
        self._file = MappedFile(path)
        self._issues: list[FileIssue] = []
        self._payload: Any = None
        try:
            self._check_archive()
            self._payload = self._load()
            try:
                self._flat = flatten_state(self._payload)
            except RecursionError:
                raise CheckpointError(f"{path}: its state is nested deeper than Python can walk: damaged or not a training checkpoint") from None
            for key, tensor in self._flat.items():
                why = unsupported_tensor(tensor)
                if why is not None:
                    raise CheckpointError(f"{path}: tensor {key[:80]!r} is {why}: it cannot be verified; re-save the state as dense CPU tensors")
        except CheckpointError:
            self._file.close()
            raise

    def _check_archive(self) -> None:
        path, buf = self.path, self._file.buffer()
        head = bytes(buf[:2])
        try:
            archive = zipfile.ZipFile(path)  # opened read-only
        except UnicodeDecodeError as exc:  # a flipped byte in a member name flagged UTF-8
            raise CheckpointError(
                f"{path}: the zip entry name {exc.object[:80]!r} is not valid UTF-8: the archive's directory is damaged"
            ) from None
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, struct.error, EOFError, NotImplementedError) as exc:
            if head[:1] == b"\x80":
                raise PickleRefused(
                    f"{path} is a raw (legacy) pickle, not a torch.save zip archive; it is refused because loading it would "
                    "run its pickle: re-save it with torch.save from a trusted environment"
                ) from None
            raise CheckpointError(f"{path} is not a complete torch.save zip archive ({exc}): truncated or not a torch checkpoint") from None
        with archive:
            members = archive.infolist()
            pkl = [m for m in members if m.filename.endswith("/data.pkl") and m.filename.count("/") == 1]
            if len(pkl) != 1:
                raise CheckpointError(f"{path} is a zip archive but not a torch.save checkpoint (no single PREFIX/data.pkl member)")
            self._prefix = pkl[0].filename[: -len("data.pkl")]
            for member in members:
                data = self._member_bytes(archive, member)
                if zlib.crc32(data) & 0xFFFFFFFF != member.CRC:
                    rel = member.filename[len(self._prefix) :]
                    if rel.startswith("data/"):
                        self._issues.append(FileIssue(file=self.relative(path), detail=f"zip CRC-32 of storage member {member.filename} does not match: its bytes changed after saving"))
                    else:
                        raise CheckpointError(f"{path}: zip CRC-32 of member {member.filename} does not match: the archive is damaged")
            self._check_pickle(bytes(self._member_bytes(archive, pkl[0])))

    def _member_bytes(self, archive: zipfile.ZipFile, member: zipfile.ZipInfo):
        """A member's stored bytes as a view of the map (read through zipfile if compressed)."""
        size, buf = self._file.size, self._file.buffer()
        start = member.header_offset  # zipfile adds the offset of the archive in the file: negative when bytes are missing at the start
        if start < 0:
            raise CheckpointError(
                f"{self.path}: member {member.filename} would start {-start} byte(s) before the file: bytes are missing at its start"
            )
        if start + _LOCAL_HEADER.size > size:
            raise CheckpointError(f"{self.path}: member {member.filename} starts beyond the end of the file: the archive is truncated")
        fields = _LOCAL_HEADER.unpack(buf[start : start + _LOCAL_HEADER.size])
        if fields[0] != b"PK\x03\x04":
            raise CheckpointError(f"{self.path}: member {member.filename} has no local header at offset {start}: the archive is damaged")
        data_start = start + _LOCAL_HEADER.size + fields[9] + fields[10]
        if data_start + member.compress_size > size:
            raise CheckpointError(f"{self.path}: member {member.filename} extends beyond the end of the file: the archive is truncated")
        if member.compress_type == zipfile.ZIP_STORED:
            return buf[data_start : data_start + member.compress_size]
        try:
            with archive.open(member) as fh:
                return fh.read()
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
            # RuntimeError: an encrypted member; NotImplementedError: an unknown compression method
            raise CheckpointError(f"{self.path}: member {member.filename} cannot be decompressed ({type(exc).__name__}: {exc})") from None

    def _check_pickle(self, data: bytes) -> None:
        allowed = _allowed_globals()
        if allowed is None:
            return
        try:
            refs = pickle_globals(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None
        refused = sorted({g for g in refs if g not in allowed})
        if refused:
            raise PickleRefused(
                f"{self.path}: its pickle references {', '.join(refused[:5])}, which weights-only loading does not allow; "
                "refusing to load it (it could run code). Only load it if you trust its origin.",
                tuple(refused),
            )

    def _load(self) -> Any:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's deprecation notes (TypedStorage, pickle protocol) are not the user's concern
                return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many types; all mean "unreadable"
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            if first_line.startswith(_WEIGHTS_ONLY_REFUSAL):  # the allow-list was unknown to the scan
                raise PickleRefused(
                    f"{self.path}: torch.load(weights_only=True) refuses its pickle; refusing to load it (it could run code). "
                    "Only load it if you trust its origin."
                ) from None
            raise CheckpointError(
                f"{self.path}: torch.load(weights_only=True) failed ({type(exc).__name__}: {first_line[:200]}): damaged or unsupported"
            ) from None

    @property
    def payload(self) -> Any:
        """The loaded object (tensors are mmap-backed)."""
        return self._payload

    def infos(self) -> list[TensorInfo]:
        name = self.relative(self.path)
        return [TensorInfo(key=k, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), file=name) for k, t in self._flat.items()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._flat.items()

    def step(self) -> int | None:
        value = self._payload.get("step") if isinstance(self._payload, dict) else None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    def file_issues(self) -> list[FileIssue]:
        return list(self._issues)

    def close(self) -> None:
        self._flat = {}
        self._payload = None
        self._file.close()
