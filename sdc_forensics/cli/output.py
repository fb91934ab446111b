"""The one place that owns the consoles: people read stderr, programs read stdout.

Rich tables and progress go to :data:`err`; ``--json`` documents go to stdout through
:func:`emit_json` (sorted keys, a ``schema_version``).

Logs and pipes (docs/json.md, "Output for logs and pipes"):

* When stderr is a terminal, people get rich output sized to it. When it is not (a Slurm log,
  ``2>file``, a pipe), every line is written whole: no wrapping at any width (``COLUMNS`` is
  ignored), table cells never cut or ellipsised, no colour or other ANSI codes.
* When the reader of stdout goes away (``sdc-forensics export T | head -1``), the rest of stdout
  is discarded silently: no traceback, no "Exception ignored", and the command's exit status is
  its own (the verdict's code; 0 for ``export``).
* The same holds for stderr (``sdc-forensics inspect T 2>&1 | head -2``): the rest of what people
  would read is discarded and the exit status is still the command's own. (rich's default is to
  raise ``SystemExit(1)``, "corruption found" in our table, so the status would depend on a pipe.)

stdout belongs to the document (:func:`stdout_reserved`): while a command runs, whatever else
writes to stdout (a recipe's ``print``, training code, a C extension or a subprocess writing file
descriptor 1) goes to stderr; only :func:`write_stdout` and :func:`emit_json` reach the real stdout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from rich.console import Console, ConsoleDimensions


SCHEMA_VERSION = 1

#: The width of "not a terminal": wide enough that no line of ours is ever wrapped or cut.
PLAIN_WIDTH = 1 << 20


class _Console(Console):
    """A rich console on stderr that stops wrapping when stderr is not a terminal.

    The choice is made at each use (``is_terminal`` looks at the stream of the moment), so a test
    runner that swaps ``sys.stderr`` gets the plain behaviour too.
    """

    @property
    def size(self) -> ConsoleDimensions:
        if not self.is_terminal:
            return ConsoleDimensions(PLAIN_WIDTH, 25)
        return super().size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:  # pragma: no cover - rich API symmetry
        self._width, self._height = new_size

    def on_broken_pipe(self) -> None:
        """The reader of stderr went away: discard the rest quietly and let the command finish
        with its own exit status (rich's default raises ``SystemExit(1)``)."""
        self.quiet = True
        _discard(self.file)


def _discard(stream: Any) -> None:
    """Point ``stream``'s file descriptor at the null device, so every later write and flush succeeds."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    # not a real file (a test runner's buffer)
    except (OSError, ValueError, AttributeError):
        pass


err = _Console(stderr=True, highlight=False, soft_wrap=False, emoji=False)

#: While :func:`stdout_reserved` runs: the stream on the real stdout, kept for the document.
_document: TextIO | None = None


def _document_stream() -> TextIO:
    return sys.stdout if _document is None else _document


@contextlib.contextmanager
def stdout_reserved() -> Iterator[None]:
    """Keep stdout for the command's document: everything else written to it goes to stderr.

    A recipe or training code that prints (nanoGPT prints the parameter count when it builds the
    model) would put its lines before the ``--json`` document. Inside this block the real stdout
    is a duplicate of file descriptor 1 that only :func:`write_stdout` and :func:`emit_json` use,
    and descriptor 1 itself points at stderr, so ``print``, C extensions and subprocesses (which
    inherit descriptor 1) all write to stderr. Where stdout is not a real file (click's
    ``CliRunner``) only ``sys.stdout`` is swapped for ``sys.stderr``. Both are put back at the end.
    Nested use is a no-op.
    """
    global _document
    if _document is not None:
        yield
        return
    original = sys.stdout
    try:
        original.flush()
        fd, err_fd = original.fileno(), sys.stderr.fileno()
    # not a real file (a test runner's buffer)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        fd = err_fd = None
    saved = None
    if fd is None:
        _document = original
    else:
        saved = os.dup(fd)
        os.dup2(err_fd, fd)
        _document = open(saved, "w", encoding=getattr(original, "encoding", None) or "utf-8", closefd=False)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = original
        with contextlib.suppress(OSError, ValueError):
            # what user code wrote through Python's stdout: still to stderr
            original.flush()
        if saved is not None:
            with contextlib.suppress(OSError, ValueError):
                # flushes; the descriptor is closed below, after it is put back
                _document.close()
            os.dup2(saved, fd)
            os.close(saved)
        _document = None


def stdout_closed() -> None:
    """The reader of stdout went away: send the rest of stdout to the null device, quietly.

    Python ignores SIGPIPE, so the next write (or the flush at exit) would raise
    ``BrokenPipeError`` and print "Exception ignored"; pointing file descriptor 1 at
    ``/dev/null`` makes every later write and flush succeed.
    """
    _discard(_document_stream())


def write_stdout(text: str) -> bool:
    """Write ``text`` to stdout and flush; False (and stdout silenced) when its reader went away."""
    stream = _document_stream()
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        stdout_closed()
        return False
    return True


def stdout_text() -> TextIO:
    """The stream a command writes its data to (the real stdout, also inside :func:`stdout_reserved`)."""
    return _document_stream()


def emit_json(document: dict[str, Any]) -> None:
    """Print one JSON document with ``schema_version`` on stdout (sorted keys).

    A closed stdout (``| head -1``) is not an error: the rest is discarded and the command goes
    on to its own exit status.
    """
    doc = {"schema_version": SCHEMA_VERSION, **document}
    write_stdout(json.dumps(doc, indent=2, sort_keys=True, default=_default) + "\n")


def _default(value: Any) -> Any:
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(value, "__fspath__"):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def fatal(message: str) -> None:
    """One line on stderr saying what is wrong and what to do (never wrapped, never styled)."""
    try:
        sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
        sys.stderr.flush()
    # nobody reads stderr any more (`2>&1 | head -1`): the exit status still says it
    except BrokenPipeError:
        _discard(sys.stderr)
