"""What reading one untrusted checkpoint may cost, and where its symbolic links may lead.

Verifying a file must cost memory and time bounded by what the file really holds. Every size a
file declares is checked against the file's own bytes before anything is allocated; what cannot
be (a compressed zip member's inflated size, a tensor view whose elements repeat stored bytes, the
number of tensors a header or pickle lists) is checked against a :class:`ReadLimits` value, and a
file beyond it is refused with one line naming the option that raises it.

* ``max_inflate_bytes``: bytes verification may have to process beyond the bytes the file
  holds: a compressed zip member's inflated size, and the bytes by which a ``torch.save``
  file's tensor views exceed its stored data (``zeros(1).expand(2**28)`` is 1 GiB from 4 bytes).
* ``max_tensors``: tensors one file may list (a safetensors header, a ``torch.save`` payload,
  a DCP ``.metadata``); the parse stops as soon as the count is passed.
* ``allow_roots``: directories a symbolic link may lead into besides the checkpoint's own root
  (and, inside a ``huggingface_hub`` cache snapshot, its repository's ``blobs/``).
* ``allow_numpy``: numpy arrays and scalars (the numpy RNG state in ``rng_state.pth``) are
  loaded from ``torch.save`` files, by torch's ``weights_only`` unpickler with those globals
  allow-listed; never anything else.

Readers take ``limits=None``, meaning :func:`current_limits`: the value set by
:func:`using_limits` for the running context (the CLI sets it once per command, so ``certify``
and ``bisect`` read checkpoints under the user's limits too), else the defaults.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from sdc_forensics.errors import CheckpointError

#: Default of ``max_inflate_bytes``: 256 MiB. No file ``torch.save``, ``safetensors`` or DCP
#: writes needs any (they store members uncompressed; a tied weight is the same view, counted once).
DEFAULT_MAX_INFLATE_BYTES = 1 << 28
#: Default of ``max_tensors``: far above real files (a shard holds thousands; a 671B-parameter
#: MoE's whole optimizer state ~300,000), far below what a 100 MB header can list (~2 M).
DEFAULT_MAX_TENSORS = 1_000_000
#: Dimensions a tensor may have (torch's own kernels stop at 25; real tensors have < 8).
MAX_DIMS = 64

INFLATE_HINT = "--max-inflate-bytes (or SDC_FORENSICS_MAX_INFLATE_BYTES)"
TENSORS_HINT = "--max-tensors (or SDC_FORENSICS_MAX_TENSORS)"
_HUB_REPO = re.compile(r"^(models|datasets|spaces)--.+")
# compressed members are inflated 1 MiB at a time
_PIECE = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadLimits:
    """What reading one checkpoint file may cost, and where its links may lead (module docstring).

    Attributes:
        max_inflate_bytes: bytes processed beyond the file's own bytes (inflated members, repeated views).
        max_tensors: tensors one file may list.
        allow_roots: extra directories symbolic links may resolve into.
        allow_numpy: load numpy arrays and scalars from ``torch.save`` files (weights-only).
    """

    max_inflate_bytes: int = DEFAULT_MAX_INFLATE_BYTES
    max_tensors: int = DEFAULT_MAX_TENSORS
    allow_roots: tuple[Path, ...] = ()
    allow_numpy: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_inflate_bytes, int) or self.max_inflate_bytes < 0:
            raise ValueError(f"max_inflate_bytes must be an integer >= 0, got {self.max_inflate_bytes!r}")
        if not isinstance(self.max_tensors, int) or self.max_tensors < 1:
            raise ValueError(f"max_tensors must be an integer >= 1, got {self.max_tensors!r}")
        object.__setattr__(self, "allow_roots", tuple(Path(os.path.realpath(root)) for root in self.allow_roots))


_current: contextvars.ContextVar[ReadLimits] = contextvars.ContextVar("sdc_forensics_read_limits", default=ReadLimits())


def current_limits() -> ReadLimits:
    """The limits set by :func:`using_limits` for this context, else the defaults."""
    return _current.get()


def resolve(limits: ReadLimits | None) -> ReadLimits:
    """``limits``, or :func:`current_limits` when None."""
    return limits if limits is not None else _current.get()


@contextlib.contextmanager
def using_limits(limits: ReadLimits) -> Iterator[ReadLimits]:
    """Read every checkpoint opened in this block (without explicit limits) under ``limits``."""
    token = _current.set(limits)
    try:
        yield limits
    finally:
        _current.reset(token)


def size_text(num_bytes: int) -> str:
    """``1.0 GiB``, ``512.0 KiB``, ``12 bytes``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.1f} {unit}"
    return f"{num_bytes} bytes"


# ---------------------------------------------------------------------------------------------
# Symbolic links


def hub_blobs(real_root: Path) -> Path | None:
    """The ``blobs/`` of the ``huggingface_hub`` cache repository that ``real_root`` (resolved)
    lies in, as ``.../models--ORG--NAME/snapshots/REV[/...]``; None elsewhere."""
    parts = real_root.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and _HUB_REPO.match(parts[i - 1]):
            blobs = Path(*parts[:i]) / "blobs"
            return blobs if blobs.is_dir() else None
    return None


def link_bounds(root: Path, limits: ReadLimits) -> tuple[Path, ...]:
    """Resolved directories that files of the checkpoint rooted at ``root`` may resolve into:
    the root itself, its hub cache repository's ``blobs/``, and ``limits.allow_roots``."""
    real = Path(os.path.realpath(root))
    blobs = hub_blobs(real)
    return (real, *((blobs,) if blobs is not None else ()), *limits.allow_roots)


def outside(path: Path, bounds: tuple[Path, ...]) -> Path | None:
    """``path``'s resolved target when it lies outside every bound, else None."""
    target = Path(os.path.realpath(path))
    return None if any(target == bound or target.is_relative_to(bound) for bound in bounds) else target


def link_advice(target: Path) -> str:
    """What to do about a link whose target is outside the checkpoint."""
    return f"pass --allow-root {target.parent} if that directory is trusted, or copy the file into the checkpoint"


def why_not_a_file(path: Path) -> str:
    """What ``path`` is, for a line saying it is not the regular file a checkpoint names: "does not
    exist", "is a directory", "is a symbolic link loop", "is a FIFO, device or socket"."""
    import errno
    import stat

    try:
        info = os.stat(path)
    except ValueError:  # a NUL byte in a crafted name
        return "does not exist (its name holds a NUL byte)"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop"
        if os.path.islink(path):
            return "is a symbolic link to nothing (dangling)"
        return "does not exist"
    if stat.S_ISDIR(info.st_mode):
        return "is a directory, not a file"
    return "is a FIFO, device or socket, not a regular file (never opened)"


def check_inside(path: Path, root: Path, limits: ReadLimits, what: str = "file") -> None:
    """Raise :class:`CheckpointError` before ``path`` is opened when it resolves (through a
    symbolic link, its own or a directory's) outside the checkpoint rooted at ``root``."""
    target = outside(path, link_bounds(root, limits))
    if target is not None:
        raise CheckpointError(
            f"{path}: the checkpoint's {what} resolves to {target}, outside the checkpoint ({Path(os.path.realpath(root))}) "
            f"and every allowed root; it is not read: {link_advice(target)}"
        )


# ---------------------------------------------------------------------------------------------
# Compressed zip members


def inflate_member(
    archive: zipfile.ZipFile, member: zipfile.ZipInfo, limits: ReadLimits, where: str, *, keep: bool = False
) -> tuple[bool, bytes]:
    """Check a compressed zip member without trusting its declared size.

    The declared (inflated) size is checked against ``limits.max_inflate_bytes`` before
    anything is inflated; then the member is inflated 1 MiB at a time. ``zipfile`` stops a member
    at its declared size, so one that would inflate further yields its declared bytes and fails
    its CRC-32; one that inflates to fewer bytes than declared is refused.

    Args:
        archive, member: the open archive and the member.
        limits: the limits.
        where: what to name in messages (the file).
        keep: return the inflated bytes (else ``b""``).

    Returns:
        ``(crc_ok, data)``: whether the CRC-32 of the inflated bytes matches the directory's.

    Raises:
        CheckpointError: declares more than the limit, inflates to fewer bytes than declared, or cannot be inflated.
    """
    declared = member.file_size
    if declared > limits.max_inflate_bytes:
        raise CheckpointError(
            f"{where}: zip member {member.filename} is compressed ({size_text(member.compress_size)}) and declares "
            f"{size_text(declared)} inflated, more than the {size_text(limits.max_inflate_bytes)} allowed; raise {INFLATE_HINT} "
            "if you trust the file"
        )
    crc, total, parts = 0, 0, []
    try:
        with archive.open(member) as fh:
            # checked here, so that a mismatch is a finding, not an exception
            fh._expected_crc = None
            # never past the declared size
            while piece := fh.read(_PIECE):
                total += len(piece)
                crc = zlib.crc32(piece, crc)
                if keep:
                    parts.append(piece)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
        # RuntimeError: an encrypted member; NotImplementedError: an unknown compression method
        raise CheckpointError(
            f"{where}: zip member {member.filename} cannot be decompressed ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if total != declared:
        raise CheckpointError(
            f"{where}: zip member {member.filename} inflates to {total} bytes, not the {declared} it declares: the archive is damaged"
        )
    return (crc & 0xFFFFFFFF) == member.CRC, b"".join(parts)
