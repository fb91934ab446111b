"""Small helpers every text renderer shares: tables that suit terminals and logs, and values
written for people (never a Python repr).

On a terminal a table is rich's box; elsewhere (a log, ``2>file``) it is plain columns with a
header line, cells whole (``cli/output.py`` never wraps or cuts there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rich import box
from rich.table import Table


def new_table(console, title: str, columns: Iterable[str], **column_options) -> Table:
    """A table for ``console``: boxed on a terminal, plain aligned columns otherwise.

    Args:
        console: the rich console it will be printed on.
        title: the title (rich markup allowed).
        columns: the column headers.
        column_options: passed to every ``add_column`` (e.g. ``overflow="fold"``).
    """
    if console.is_terminal:
        table = Table(title=title, title_justify="left")
    else:
        table = Table(
            title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, safe_box=True
        )
    for column in columns:
        table.add_column(column, no_wrap=not console.is_terminal, **column_options)
    return table


def count_text(count: int, noun: str, plural: str | None = None) -> str:
    """``1 thread``, ``2 threads`` (``plural`` for irregular nouns)."""
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"


def rate_text(num_bytes: int, seconds: float) -> str:
    """A read rate with a unit that keeps two or three significant digits: ``1.4 GB/s``,
    ``37 MB/s``, ``820 kB/s``; ``-`` when the time is too short to measure."""
    if seconds <= 0:
        return "-"
    rate = num_bytes / seconds
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= scale:
            value = rate / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{rate:.0f} B/s"


def ranks_text(ranks: Iterable[int]) -> str:
    """``2``, ``1, 3``, or ``all`` (for no rank in particular)."""
    ranks = list(ranks)
    return ", ".join(str(r) for r in ranks) if ranks else "all"


def pairs_text(values: Mapping | None) -> str:
    """``key=value key=value`` (sorted keys), ``-`` when empty."""
    if not values:
        return "-"
    return " ".join(f"{key}={_scalar(value)}" for key, value in sorted(values.items()))


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "-"
    if isinstance(value, Mapping):
        return "{" + pairs_text(value) + "}"
    if isinstance(value, (list, tuple)):
        return ",".join(_scalar(v) for v in value)
    return str(value)


def evidence_rows(evidence) -> list[tuple]:
    """The evidence table's rows (step, kind, ranks, location, source, strength, expected, found, detail), as the
    HTML and Markdown reports both print them."""
    return [
        (
            e.step,
            e.kind.value,
            ", ".join(map(str, e.ranks)) or "all",
            e.location.value,
            e.source,
            e.strength.value,
            e.expected,
            e.found,
            e.detail,
        )
        for e in evidence
    ]
