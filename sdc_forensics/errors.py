"""The package's exceptions.

One base class, a few specific subclasses. Every message says what is wrong and how to fix
it; only the CLI turns them into one line on stderr and an exit code (see ``cli/main.py``).
"""

from __future__ import annotations


class SdcError(Exception):
    """Base class of every error sdc-forensics raises on purpose."""

    exit_code = 3


class UsageError(SdcError):
    """The caller asked for something that cannot be done as asked (bad flag, bad spec)."""

    exit_code = 2


class InvalidInputError(SdcError):
    """An input file or directory is unreadable, malformed, or not what it claims to be."""

    exit_code = 3


class TraceError(InvalidInputError):
    """A trace directory cannot be used: no manifest, unknown version, not a trace."""


class CheckpointError(InvalidInputError):
    """A checkpoint is unreadable or structurally malformed."""


class RecipeError(SdcError):
    """A replay recipe cannot be imported or does not follow the recipe protocol."""

    exit_code = 3


class SdcAlarm(SdcError):
    """Raised inside training when an online check fires and the policy is ``raise``.

    Attributes:
        step: the optimizer step at which the check fired.
        rank: the global rank found at fault (or -1 when the check cannot localise it).
        host: the host name of that rank, when known.
        check: the name of the check (``nonfinite``, ``audit``, ``weights``, ``allreduce``).
    """

    exit_code = 1

    def __init__(self, message: str, *, step: int, rank: int, host: str = "", check: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.host = host
        self.check = check
