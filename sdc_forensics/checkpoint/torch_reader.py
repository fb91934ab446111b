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
   private read-only-in-practice map of the file, not copies;
5. the object is walked once, within a budget, before anything else touches it: at most
   ``max_tensors`` tensors, at most 8 objects visited per pickle opcode (a pickle that refers to
   the same containers over and over is a bomb: cheap to load, endless to walk), key paths of at
   most 64 KiB; and the tensor views may repeat stored bytes (``zeros(1).expand(2**28)``) by at
   most ``max_inflate_bytes`` in all (identical views, such as tied weights, count once and are
   digested once: :meth:`TorchReader.aliases`);
6. every storage lies inside its own member: the map is cut at each member's offset with the
   size the pickle declares, which torch does not compare with the member's, so a short member
   would lend its tensor the bytes after it (:meth:`TorchReader._check_storage_sizes`).

Costs are bounded by the file (``limits.py``): a compressed storage member is refused (torch
would map its compressed bytes as the tensor's); another compressed member is checked against
its declared size and the limit before it is inflated, 1 MiB at a time. With
``ReadLimits.allow_numpy`` the numpy globals of :data:`NUMPY_GLOBALS` are allow-listed for the
scan and for ``torch.load`` (torch's own weights-only unpickler; nothing else is ever allowed).

CRC-32 of each member is recomputed over the map. A mismatch in ``data.pkl`` or another
metadata member is structural (exit 3); in a ``data/K`` storage member the file is still
readable and the mismatch is reported as a :class:`FileIssue` (content corruption, exit 1),
next to the per-tensor digests that say which tensor changed.

Over 400 lines on purpose: the pickle opcode walker, the storage table and the zip/legacy containers
are one reader of one format: split, each part would have to trust state the other half checked.
"""

from __future__ import annotations

import contextlib
import re
import pickletools
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from sdc_forensics.checkpoint.deepspeed_files import PLACEHOLDERS, safe_globals_entries
from sdc_forensics.checkpoint.base import FileIssue, MappedFile, SingleFileReader, TensorInfo, unsupported_tensor
from sdc_forensics.checkpoint.limits import (
    INFLATE_HINT,
    TENSORS_HINT,
    ReadLimits,
    check_inside,
    inflate_member,
    resolve,
    size_text,
)
from sdc_forensics.errors import CheckpointError, reader
from sdc_forensics.statedict import flatten_state

# 30 bytes
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_WEIGHTS_ONLY_REFUSAL = "Weights only load failed"
# objects the payload walk may visit per pickle opcode (shared small tuples legitimately repeat)
_WALK_PER_OPCODE = 8
_WALK_SLACK = 10_000
_MAX_KEY_CHARS = 1 << 16
#: ``--allow-numpy``: what ``np.random.get_state()`` and numpy arrays/scalars pickle to (numpy 1
#: and 2 spellings), as transformers' ``Trainer`` allow-lists them to load ``rng_state.pth``.
NUMPY_GLOBALS = (
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray.scalar",
    "numpy._core.multiarray.scalar",
    "numpy.ndarray",
    "numpy.dtype",
)
NUMPY_HINT = "--allow-numpy"
# numpy's numeric dtypes (no object, string or void dtype class)
_NUMPY_DTYPE_CODES = "?bBhHiIlLqQefdgFDG"


class PickleRefused(CheckpointError):
    """The file is intact as far as can be told, but loading it would need a pickle global outside
    the ``weights_only`` allow-list (or a legacy raw pickle): it is not loaded, so not verified.

    Attributes:
        refused: the globals that were refused (empty for a legacy pickle).
        numpy: every refused global is one ``ReadLimits.allow_numpy`` (``--allow-numpy``) allows.
    """

    def __init__(self, message: str, refused: tuple[str, ...] = (), *, numpy: bool = False, why: str = "") -> None:
        super().__init__(message)
        self.refused = refused
        self.numpy = numpy
        # another reason than a refused global or a legacy pickle (an opcode the loader does not read)
        self.why = why


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


class TensorNotReadable(CheckpointError):
    """The file is intact as far as can be told, but holds a tensor verification cannot read as
    dense bits (quantized, sparse, nested, meta, a packed dtype: ``base.unsupported_tensor``): its
    content is not verified, which says nothing about whether it is damaged."""


def _allowed_globals() -> set[str] | None:
    """``module.name`` of every global ``weights_only`` loading accepts; None if unknown."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals
    # a future torch moved it: rely on weights_only alone
    except ImportError:
        return None
    allowed = set(_get_allowed_globals())
    for obj in torch.serialization.get_safe_globals():
        obj = obj[0] if isinstance(obj, tuple) else obj
        allowed.add(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
    return allowed


def _numpy_safe_globals() -> list:
    """:data:`NUMPY_GLOBALS` and numpy's numeric dtype classes as ``torch.serialization.safe_globals`` entries."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    found: list = [np.ndarray, np.dtype, *(type(np.dtype(code)) for code in _NUMPY_DTYPE_CODES)]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        found += [
            (core.multiarray._reconstruct, f"{module}._reconstruct"),
            (core.multiarray.scalar, f"{module}.scalar"),
        ]
    return found


def _numpy_names() -> set[str]:
    """``module.name`` of everything :func:`_numpy_safe_globals` allows."""
    import numpy as np

    classes = {type(np.dtype(code)) for code in _NUMPY_DTYPE_CODES}
    return set(NUMPY_GLOBALS) | {f"{cls.__module__}.{cls.__qualname__}" for cls in classes}


@reader
def pickle_globals(data: bytes) -> list[str]:
    """Every global (``module.name``) a pickle references, found without unpickling it.

    ``STACK_GLOBAL`` takes its module and name from the two values pushed before it, directly
    or through the memo; both are followed here. A global whose name cannot be resolved this
    way is reported as ``<unresolved>`` (and refused by the caller).
    """
    return _scan_pickle(data)[0]


def _scan_pickle(data: bytes) -> tuple[list[str], int]:
    """``(pickle_globals(data), number of opcodes)``."""
    found: list[str] = []
    pushed: list[Any] = []
    memo: dict[int, Any] = {}
    num_ops = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            num_ops += 1
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
                found.append(
                    f"{module}.{attr}" if isinstance(module, str) and isinstance(attr, str) else "<unresolved>"
                )
                pushed.append(None)
            elif name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4"):
                found.append(f"<{name} opcode>" if name != "INST" else str(arg).replace(" ", "."))
            else:
                pushed.append(None)
    except ValueError as exc:
        raise CheckpointError(f"the pickle is malformed ({str(exc)[:200]})") from None
    return found, num_ops


class TorchReader(SingleFileReader):
    """A ``torch.save`` zip checkpoint. Structure and the pickle scan happen in the constructor.

    Args:
        path: the checkpoint file.
        root: the directory its name is relative to (default: its own).
        limits: what reading it may cost, where links may lead (default: ``limits.current_limits()``).

    Raises:
        PickleRefused: loading would run a pickle global outside the allow-list (or a legacy pickle).
        CheckpointError: the file is truncated, damaged, not a ``torch.save`` archive, beyond the
            limits, or a link out of the checkpoint.
    """

    format = "torch"

    def __init__(self, path: str | Path, *, root: Path | None = None, limits: ReadLimits | None = None) -> None:
        path = Path(path)
        super().__init__(path, root if root is not None else path.parent)
        self._limits = resolve(limits)
        self._aliases: dict[str, str] = {}
        check_inside(path, self.root, self._limits)
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist or is not a file; pass a torch.save checkpoint")
        self._file = MappedFile(path)
        self._issues: list[FileIssue] = []
        self._payload: Any = None
        # where each stored member's bytes start in the file: (name, size)
        self._stored: dict[int, tuple[str, int]] = {}
        try:
            num_ops = self._check_archive()
            self._payload = self._load()
            try:
                self._walk(num_ops)
                self._flat = flatten_state(self._payload)
            except RecursionError:
                raise CheckpointError(
                    f"{path}: its state is nested deeper than Python can walk: damaged or not a training checkpoint"
                ) from None
            for key, tensor in self._flat.items():
                why = unsupported_tensor(tensor)
                if why is not None:
                    raise TensorNotReadable(
                        f"{path}: tensor {key[:80]!r} is {why}: it cannot be verified; re-save the state as dense CPU tensors"
                    )
            self._check_views()
            self._check_storage_sizes()
        except CheckpointError:
            self._file.close()
            raise

    def _check_archive(self) -> int:
        """Structure and CRC-32 of every member, then the pickle scan; the pickle's opcode count."""
        path, buf = self.path, self._file.buffer()
        head = bytes(buf[:2])
        try:
            # opened read-only
            archive = zipfile.ZipFile(path)
        # a flipped byte in a member name flagged UTF-8
        except UnicodeDecodeError as exc:
            raise CheckpointError(
                f"{path}: the zip entry name {exc.object[:80]!r} is not valid UTF-8: the archive's directory is damaged"
            ) from None
        except (
            zipfile.BadZipFile,
            zipfile.LargeZipFile,
            OSError,
            ValueError,
            struct.error,
            EOFError,
            NotImplementedError,
        ) as exc:
            if head[:1] == b"\x80":
                raise PickleRefused(
                    f"{path} is a raw (legacy) pickle, not a torch.save zip archive; it is refused because loading it would "
                    "run its pickle: re-save it with torch.save from a trusted environment"
                ) from None
            raise CheckpointError(
                f"{path} is not a complete torch.save zip archive ({exc}): truncated or not a torch checkpoint"
            ) from None
        with archive:
            members = archive.infolist()
            pkl = [m for m in members if m.filename.endswith("/data.pkl") and m.filename.count("/") == 1]
            if len(pkl) != 1:
                raise CheckpointError(
                    f"{path} is a zip archive but not a torch.save checkpoint (no single PREFIX/data.pkl member)"
                )
            self._prefix = pkl[0].filename[: -len("data.pkl")]
            pickle_bytes = b""
            for member in members:
                rel = member.filename[len(self._prefix) :]
                stored = self._member_bytes(archive, member)
                if stored is not None:
                    crc_ok = zlib.crc32(stored) & 0xFFFFFFFF == member.CRC
                    data = bytes(stored) if member is pkl[0] else b""
                elif rel.startswith("data/"):
                    raise CheckpointError(
                        f"{path}: storage member {member.filename} is compressed; torch.save stores tensors uncompressed and "
                        "torch.load would map the compressed bytes as the tensor: the file was re-zipped or crafted; re-save it with torch.save"
                    )
                # checked against its declared size and the limit, inflated 1 MiB at a time
                else:
                    crc_ok, data = inflate_member(archive, member, self._limits, str(path), keep=member is pkl[0])
                if member is pkl[0]:
                    pickle_bytes = data
                if not crc_ok:
                    if rel.startswith("data/"):
                        self._issues.append(
                            FileIssue(
                                file=self.relative(path),
                                detail=f"zip CRC-32 of storage member {member.filename} does not match: its bytes changed after saving",
                            )
                        )
                    else:
                        raise CheckpointError(
                            f"{path}: zip CRC-32 of member {member.filename} does not match: the archive is damaged"
                        )
            return self._check_pickle(pickle_bytes)

    def _member_bytes(self, archive: zipfile.ZipFile, member: zipfile.ZipInfo):
        """A stored member's bytes as a view of the map; None for a compressed one (whose
        compressed bytes are checked to lie inside the file)."""
        size, buf = self._file.size, self._file.buffer()
        start = (
            member.header_offset
            # zipfile adds the offset of the archive in the file: negative when bytes are missing at the start
        )
        if start < 0:
            raise CheckpointError(
                f"{self.path}: member {member.filename} would start {-start} byte(s) before the file: bytes are missing at its start"
            )
        if start + _LOCAL_HEADER.size > size:
            raise CheckpointError(
                f"{self.path}: member {member.filename} starts beyond the end of the file: the archive is truncated"
            )
        fields = _LOCAL_HEADER.unpack(buf[start : start + _LOCAL_HEADER.size])
        if fields[0] != b"PK\x03\x04":
            raise CheckpointError(
                f"{self.path}: member {member.filename} has no local header at offset {start}: the archive is damaged"
            )
        data_start = start + _LOCAL_HEADER.size + fields[9] + fields[10]
        if data_start + member.compress_size > size:
            raise CheckpointError(
                f"{self.path}: member {member.filename} extends beyond the end of the file: the archive is truncated"
            )
        if member.compress_type == zipfile.ZIP_STORED:
            self._stored[data_start] = (member.filename, member.compress_size)
            return buf[data_start : data_start + member.compress_size]
        return None

    def _check_pickle(self, data: bytes) -> int:
        """Refuse globals outside the allow-list (plus numpy's with ``allow_numpy``); the opcode count."""
        try:
            refs, num_ops = _scan_pickle(data)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.path}: {exc}") from None
        allowed = _allowed_globals()
        if allowed is None:
            return num_ops
        numpy_names = _numpy_names() if self._limits.allow_numpy or any(g not in allowed for g in refs) else set()
        if self._limits.allow_numpy:
            allowed |= numpy_names
        # DeepSpeed's three objects in its optimizer files, read as inert placeholders (deepspeed_files.py)
        allowed |= set(PLACEHOLDERS)
        refused = sorted({g for g in refs if g not in allowed})
        if refused and all(g in numpy_names for g in refused):
            raise PickleRefused(
                f"{self.path}: its pickle holds numpy arrays or scalars ({', '.join(refused[:5])}), outside torch's weights-only "
                f"allow-list; pass {NUMPY_HINT} to load them (the numpy RNG state of a training checkpoint) with torch's weights-only unpickler",
                tuple(refused),
                numpy=True,
            )
        if refused:
            raise PickleRefused(
                f"{self.path}: its pickle references {', '.join(refused[:5])}, which weights-only loading does not allow; "
                "refusing to load it (it could run code): re-save it with tensors and plain Python values only (e.g. vars(args) for an argparse.Namespace, a dict for a dataclass) to verify it; sdc-forensics never runs a checkpoint's pickle",
                tuple(refused),
            )
        return num_ops

    def _load(self) -> Any:
        allow = (
            torch.serialization.safe_globals(_numpy_safe_globals())
            if self._limits.allow_numpy
            else contextlib.nullcontext()
        )
        try:
            with allow, torch.serialization.safe_globals(safe_globals_entries()), warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore"
                    # torch's deprecation notes (TypedStorage, pickle protocol) are not the user's concern
                )
                return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many types; all mean "unreadable"
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            # the allow-list was unknown to the scan
            operand = re.search(r"Unsupported operand (\d+)", str(exc))
            if first_line.startswith(_WEIGHTS_ONLY_REFUSAL) and operand:
                # pickle protocol 4 or 5 (FRAME, 149): no global it names is refused; torch's loader cannot read it
                why = (
                    f"its pickle uses opcode {operand.group(1)}, which torch's weights-only loader does not read (pickle "
                    "protocol 4 or 5); nothing it names is refused, but it is not loaded"
                )
                raise PickleRefused(
                    f"{self.path}: {why}: re-save it with torch.save's default pickle protocol to verify it", why=why
                ) from None
            if first_line.startswith(_WEIGHTS_ONLY_REFUSAL):
                raise PickleRefused(
                    f"{self.path}: torch.load(weights_only=True) refuses its pickle; refusing to load it (it could run code): "
                    "re-save it with tensors and plain Python values only (e.g. vars(args) for an argparse.Namespace, a dict for a dataclass) to verify it; sdc-forensics never runs a checkpoint's pickle"
                ) from None
            raise CheckpointError(
                f"{self.path}: torch.load(weights_only=True) failed ({type(exc).__name__}: {first_line[:200]}): damaged or unsupported"
            ) from None

    def _walk(self, num_ops: int) -> None:
        """Walk the loaded object within a budget before anything else walks it (module docstring, 5)."""
        path, limits = self.path, self._limits
        budget = _WALK_PER_OPCODE * num_ops + _WALK_SLACK
        # (object, length of its flattened key)
        stack: list[tuple[Any, int]] = [(self._payload, 0)]
        visits = tensors = 0
        while stack:
            obj, chars = stack.pop()
            visits += 1
            if visits > budget:
                raise CheckpointError(
                    f"{path}: its pickle refers to the same containers over and over (more than {budget} objects to walk from "
                    f"{num_ops} pickle opcodes): a pickle bomb, not a training checkpoint"
                )
            if chars > _MAX_KEY_CHARS:
                raise CheckpointError(
                    f"{path}: a key path of its state is longer than {_MAX_KEY_CHARS} characters: damaged or crafted"
                )
            if isinstance(obj, torch.Tensor):
                tensors += 1
                if tensors > limits.max_tensors:
                    raise CheckpointError(
                        f"{path} holds more than {limits.max_tensors} tensors; raise {TENSORS_HINT} if you trust the file"
                    )
            elif isinstance(obj, Mapping):
                stack.extend((value, chars + 1 + _key_chars(path, key)) for key, value in obj.items())
            elif isinstance(obj, (list, tuple)):
                stack.extend((value, chars + 1 + len(str(index))) for index, value in enumerate(obj))

    def _check_views(self) -> None:
        """Identical views count once (:meth:`aliases`); distinct views may repeat stored bytes by
        at most ``max_inflate_bytes`` in all. Checked before any view is materialised."""
        views: dict[tuple, str] = {}
        storages: dict[tuple[int, int], int] = {}
        view_bytes = 0
        for key, tensor in self._flat.items():
            storage = tensor.untyped_storage()
            ident = (
                storage.data_ptr(),
                storage.nbytes(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
                tensor.dtype,
            )
            if ident in views:
                self._aliases[key] = views[ident]
                continue
            views[ident] = key
            storages[ident[:2]] = storage.nbytes()
            view_bytes += tensor.numel() * tensor.element_size()
        stored = sum(storages.values())
        if view_bytes - stored > self._limits.max_inflate_bytes:
            key, worst = max(
                self._flat.items(),
                key=lambda kv: kv[1].numel() * kv[1].element_size() - kv[1].untyped_storage().nbytes(),
            )
            raise CheckpointError(
                f"{self.path}: its tensor views repeat stored bytes ({key[:80]!r} is {tuple(worst.shape)} "
                f"{str(worst.dtype).removeprefix('torch.')} over {size_text(worst.untyped_storage().nbytes())} of storage): "
                f"{size_text(view_bytes)} to digest from {size_text(stored)} stored, more than the "
                f"{size_text(self._limits.max_inflate_bytes)} beyond it allowed; raise {INFLATE_HINT} if you trust the file"
            )

    def _check_storage_sizes(self) -> None:
        """Every storage lies inside its own member. ``torch.load(mmap=True)`` maps the file and cuts each
        storage at its member's offset with the size the pickle declares, never comparing it with the
        member's: a member shorter than its storage (crafted, or an archive rebuilt badly) gave a tensor
        the bytes of the zip headers after it, digested and verified (a hostile-file trial). torch maps
        the whole file once, so the storages' addresses are the members' offsets plus one base, found
        from the lowest storage."""
        spans = {}
        for tensor in self._flat.values():
            storage = tensor.untyped_storage()
            if storage.nbytes():
                spans[storage.data_ptr()] = max(spans.get(storage.data_ptr(), 0), storage.nbytes())
        if not spans:
            return
        lowest = min(spans)
        members = {
            start: named for start, named in self._stored.items() if named[0][len(self._prefix) :].startswith("data/")
        }
        base = next(
            (lowest - start for start in members if all(ptr - (lowest - start) in members for ptr in spans)), None
        )
        if base is None:
            raise CheckpointError(
                f"{self.path}: its tensors do not lie at the offsets of its storage members: the archive was rebuilt "
                "or crafted; re-save it with torch.save"
            )
        for ptr, nbytes in sorted(spans.items()):
            name, size = members[ptr - base]
            if nbytes > size:
                raise CheckpointError(
                    f"{self.path}: storage member {name} holds {size} bytes, but the pickle declares {nbytes} for its "
                    "tensors, which would be read from the bytes after it: truncated or crafted; restore the file or "
                    "re-save it with torch.save"
                )

    def aliases(self) -> dict[str, str]:
        """Key -> the first key holding the very same view (a tied weight): digested once."""
        return dict(self._aliases)

    @property
    def payload(self) -> Any:
        """The loaded object (tensors are mmap-backed)."""
        return self._payload

    def infos(self) -> list[TensorInfo]:
        name = self.relative(self.path)
        return [
            TensorInfo(key=k, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), file=name)
            for k, t in self._flat.items()
        ]

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


def _key_chars(path: Path, key: Any) -> int:
    """Length of ``str(key)``, as :func:`~sdc_forensics.statedict.flatten_state` writes it."""
    try:
        return len(str(key))
    # an integer beyond Python's int_max_str_digits
    except ValueError:
        raise CheckpointError(
            f"{path}: a key of its state is an integer too long to print: damaged or crafted"
        ) from None
