"""The package's exceptions.

One base class, a few specific subclasses. Every message says what is wrong and how to fix
it; only the CLI turns them into one line on stderr and an exit code (see ``cli/main.py``).

Every reader of untrusted input (trace files, manifests, checkpoint notes, checkpoints,
certificates) raises an :class:`InvalidInputError` for anything it cannot use: its own checks
raise a specific subclass with a fix-it message, and the readers' entry points are marked with
:func:`reader` (functions) or :func:`reader_class` (classes), which turn a Python error that
escaped every check (a ``TypeError`` on a field of the wrong type, a ``KeyError``...) into a
:class:`MalformedInputError`. The CLI maps the class to its exit code (``exit_code``, from ``exitcodes.ExitCode``), so a
new reader needs no list anywhere: mark its entry points.
"""

from __future__ import annotations

import functools
import inspect
import struct
from collections.abc import Callable
from typing import TypeVar

from sdc_forensics.exitcodes import ExitCode

_F = TypeVar("_F", bound=Callable)
_C = TypeVar("_C", bound=type)


class SdcError(Exception):
    """Base class of every error sdc-forensics raises on purpose."""

    exit_code = ExitCode.BAD_INPUT


class UsageError(SdcError):
    """The caller asked for something that cannot be done as asked (bad flag, bad spec)."""

    exit_code = ExitCode.USAGE


class InvalidInputError(SdcError):
    """An input file or directory is unreadable, malformed, or not what it claims to be."""

    exit_code = ExitCode.BAD_INPUT


class MalformedInputError(InvalidInputError):
    """An input file broke a reader in a way none of its checks catches yet.

    Raised by :func:`reader` in place of the Python error that escaped (chained as its cause);
    the message names that error and the innermost sdc-forensics function it passed through, so
    that the missing check can be added at the parse boundary.
    """


class TraceError(InvalidInputError):
    """A trace directory cannot be used: no manifest, unknown version, not a trace."""


class CheckpointError(InvalidInputError):
    """A checkpoint is unreadable or structurally malformed."""


class LedgerWriteError(UsageError):
    """The ledger of examined intervals cannot be written where asked (a read-only trace
    directory, a full disk): the message names the file and says to pass ``--ledger PATH``."""


class RecipeError(SdcError):
    """A replay recipe cannot be imported or does not follow the recipe protocol."""

    exit_code = ExitCode.BAD_INPUT


class SdcAlarm(SdcError):
    """Raised inside training when an online check fires and the policy is ``raise``.

    Attributes:
        step: the optimizer step at which the check fired.
        rank: the global rank found at fault (or -1 when the check cannot localise it).
        host: the host name of that rank, when known.
        check: the name of the check (``nonfinite``, ``audit``, ``weights``, ``allreduce``).
    """

    exit_code = ExitCode.CORRUPTION

    def __init__(self, message: str, *, step: int, rank: int, host: str = "", check: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.host = host
        self.check = check


#: What a parse raises on malformed input that no check caught first (decoding, unpacking,
#: indexing or converting a value of the wrong type or size, nesting beyond Python's stack).
UNCHECKED_PARSE_ERRORS = (
    RecursionError,
    UnicodeDecodeError,
    struct.error,
    OverflowError,
    ValueError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
)


def _malformed(exc: BaseException, func: Callable) -> MalformedInputError:
    """The :class:`MalformedInputError` for ``exc``, naming the innermost package frame it passed
    through (else the reader ``func`` it escaped)."""
    where, tb = f"{func.__module__}.{func.__qualname__}", exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module != __name__ and (module == "sdc_forensics" or module.startswith("sdc_forensics.")):
            where = f"{module}.{tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    text = " ".join(str(exc).split())[:200]
    return MalformedInputError(
        f"an input file is malformed in a way sdc-forensics does not check yet ({type(exc).__name__} in {where}: {text}); "
        "check the file, and please report this with it"
    )


def reader(func: _F) -> _F:
    """Mark ``func`` (a function or generator function) as an entry point of a reader of untrusted input.

    Any of :data:`UNCHECKED_PARSE_ERRORS` escaping it becomes a :class:`MalformedInputError`;
    every :class:`SdcError` (the reader's own checks) passes unchanged. Nested readers convert
    once, innermost first.
    """
    if getattr(func, "__sdc_reader__", False):
        return func
    if inspect.isgeneratorfunction(func):

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return (yield from func(*args, **kwargs))
            except UNCHECKED_PARSE_ERRORS as exc:
                raise _malformed(exc, func) from exc
    else:

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except UNCHECKED_PARSE_ERRORS as exc:
                raise _malformed(exc, func) from exc

    wrapper.__sdc_reader__ = True
    return wrapper  # type: ignore[return-value]


def reader_class(cls: _C) -> _C:
    """Apply :func:`reader` to ``__init__`` and every public method, property, class- and static
    method that ``cls`` itself defines (private helpers are covered by the public entry that
    calls them; one that may catch a parse error of a helper keeps doing so)."""
    for name, value in list(vars(cls).items()):
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(value, property):
            wrapped = property(
                *(None if f is None else reader(f) for f in (value.fget, value.fset, value.fdel)), value.__doc__
            )
        elif isinstance(value, (classmethod, staticmethod)):
            wrapped = type(value)(reader(value.__func__))
        elif inspect.isfunction(value):
            wrapped = reader(value)
        else:
            continue
        setattr(cls, name, wrapped)
    return cls
