"""Writing a file whole or not at all: the one atomic write of the package.

Every file sdc-forensics writes for someone else to read is written into a temporary file beside
its target (same directory, so same file system), flushed and ``fsync``'ed, then moved into place
in one step, so a reader (or a run killed mid-write, or a machine crash after the move) never
sees half a file:

* :func:`write_atomic` replaces the target: the trace's ``manifest.json``, checkpoint notes and
  bucket layouts, the demo's per-rank reports;
* :func:`write_new_file` never replaces a file without ``force``: every command that writes an
  output file (``export -o``, ``report -o``, ``certify --certificate-out``). The existence check
  before the work (``cli/common.check_new_output``) is not enough, because a replay can take
  minutes and a file can appear meanwhile.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, TypeVar

T = TypeVar("T")


def _write_beside(target: Path, write: Callable[[TextIO], T]) -> tuple[Path, T]:
    """``write(handle)`` into a new temporary file beside ``target``, flushed and fsync'ed;
    ``(its path, what write returned)``. Removed again if writing fails."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # exclusive: never a file (or link) already there
    handle = open(tmp, "x", newline="", encoding="utf-8")
    try:
        with handle:
            result = write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, result


def write_atomic(target: str | os.PathLike, text: str) -> Path:
    """Replace ``target`` with ``text`` (UTF-8) whole or not at all; returns ``target``.

    A temporary file beside it is written and ``fsync``'ed, then ``os.replace``'d onto it: a
    reader sees the old content or the new, never a mixture, and a failure leaves ``target``
    untouched and no temporary file behind.
    """
    target = Path(target)
    tmp, _ = _write_beside(target, lambda handle: handle.write(text))
    try:
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def write_new_file(target: str | os.PathLike, force: bool, write: Callable[[TextIO], T], *, flag: str = "-o") -> T:
    """Write a text file whole or not at all: ``write(handle)`` into a temporary file beside
    ``target``, then moved into place; returns what ``write`` returned.

    Without ``force`` the move never replaces a file (a hard link, which fails if one appeared
    since ``check_new_output``); on any failure the temporary file is removed and ``target`` is
    untouched.

    Raises:
        UsageError: ``target`` exists and ``force`` is False (names ``flag``).
    """
    from sdc_forensics.errors import UsageError

    target = Path(target)
    exists = UsageError(f"{flag} {target} exists: choose another path, or pass --force to overwrite it")
    tmp, result = _write_beside(target, write)
    try:
        if force:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise exists from None
            # a file system without hard links
            except OSError:
                if target.exists():
                    raise exists from None
                os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return result
