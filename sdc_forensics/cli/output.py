"""The one place that owns the consoles: people read stderr, programs read stdout.

Rich tables and progress go to :data:`err`; ``--json`` documents go to stdout through
:func:`emit_json` (sorted keys, a ``schema_version``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

SCHEMA_VERSION = 1

err = Console(stderr=True, highlight=False, soft_wrap=False)


def emit_json(document: dict[str, Any]) -> None:
    """Print one JSON document with ``schema_version`` on stdout."""
    doc = {"schema_version": SCHEMA_VERSION, **document}
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True, default=_default) + "\n")
    sys.stdout.flush()


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
    sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
    sys.stderr.flush()
