"""Writing a new output file whole or not at all, never over an existing one without ``force``.

Used by every command that writes a file (``export -o``, ``report -o``, ``certify
--certificate-out``): the existence check before the work (``cli/common.check_new_output``) is not
enough, because a replay can take minutes and a file can appear meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, TypeVar

T = TypeVar("T")


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
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    handle = open(tmp, "x", newline="", encoding="utf-8")  # exclusive: never a file (or link) already there
    try:
        with handle:
            result = write(handle)
        if force:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)
            except FileExistsError:
                raise exists from None
            except OSError:  # a file system without hard links
                if target.exists():
                    raise exists from None
                os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return result
