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
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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
    except (OSError, ValueError, AttributeError):  # not a real file (a test runner's buffer)
        pass


err = _Console(stderr=True, highlight=False, soft_wrap=False, emoji=False)


def stdout_closed() -> None:
    """The reader of stdout went away: send the rest of stdout to the null device, quietly.

    Python ignores SIGPIPE, so the next write (or the flush at exit) would raise
    ``BrokenPipeError`` and print "Exception ignored"; pointing file descriptor 1 at
    ``/dev/null`` makes every later write and flush succeed.
    """
    _discard(sys.stdout)


def write_stdout(text: str) -> bool:
    """Write ``text`` to stdout and flush; False (and stdout silenced) when its reader went away."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        stdout_closed()
        return False
    return True


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
    except BrokenPipeError:  # nobody reads stderr any more (`2>&1 | head -1`): the exit status still says it
        _discard(sys.stderr)
