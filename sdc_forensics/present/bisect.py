"""Renderers of a :class:`BisectResult`: rich text for people, the ``bisect --json`` document for programs.

The text goes to the stderr console of ``cli/output.py``; the JSON document (sorted keys,
``schema_version``) goes to stdout through ``output.emit_json``. Neither changes the result.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from sdc_forensics.forensics.evidence import Evidence
from sdc_forensics.forensics.decision import Status
from sdc_forensics.forensics.verdict import BisectResult, Verdict
from sdc_forensics.present.text import new_table, ranks_text
from sdc_forensics.trace.ends import STOPPED_EARLY

_STYLE = {Verdict.CLEAN: "bold green", Verdict.CORRUPTION: "bold red", Verdict.INCONCLUSIVE: "bold yellow"}
_STATUS_STYLE = {Status.CLEAN: "green", Status.UNVERIFIED: "yellow", Status.TAINTED: "red", Status.CORRUPT: "bold red"}


def bisect_document(result: BisectResult) -> dict[str, Any]:
    """The ``--json`` document of ``bisect`` (``schema_version`` is added by the emitter)."""
    return result.to_json()


def render_bisect(result: BisectResult, console) -> None:
    """Print the human summary: verdict, suspects, checkpoints, what was replayed and why."""
    style = _STYLE[result.verdict]
    headline = f"[{style}]{result.verdict.value.upper()}[/]"
    if result.first_divergent_step is not None:
        headline += f"  first divergent step {result.first_divergent_step} (θ_{result.first_divergent_step} clean, θ_{result.first_divergent_step + 1} not)"
    console.print(headline)
    console.print(f"[dim]{escape(result.scope)}[/]")
    stopped = [line for line in result.damage if line.startswith(STOPPED_EARLY)]  # trace.ends.RunEnd.describe()
    for line in stopped:
        console.print(f"[bold yellow]{escape(line[0].upper() + line[1:])}[/]")
    if result.suspects:
        table = new_table(console, "Suspects", ("rank", "host", "gpu", "location", "steps", "recurrence", "recommendation"))
        for s in result.suspects:
            table.add_row("all (collective)" if s.rank is None else str(s.rank), escape(s.host or "-"), escape(s.gpu or "-"),
                          s.location.value, ", ".join(map(str, s.steps)), "recurring" if s.recurring else "one event",
                          escape(s.recommendation))
        console.print(table)
        evidence_table(console, [e for s in result.suspects for e in s.evidence], "Evidence chain")
    elif [e for e in result.evidence if not e.is_hint]:
        evidence_table(console, [e for e in result.evidence if not e.is_hint], "Evidence")
    hints = [e for e in result.evidence if e.is_hint]
    if hints:
        console.print(f"[dim]{len(hints)} statistical hint(s), not a verdict: " + "; ".join(f"step {e.step} rank {ranks_text(e.ranks)}" for e in hints[:5]) + "[/]")
    if result.checkpoints:
        table = new_table(console, "Checkpoints", ("step", "status", "reasons", "path"))
        for c in result.checkpoints:
            table.add_row(str(c.step), f"[{_STATUS_STYLE[c.status]}]{c.status.value}[/]", escape("; ".join(c.reasons[:3])), escape(c.path))
        console.print(table)
    last = result.last_clean_checkpoint
    console.print(f"Resume from: [bold]{escape(last.path)}[/] (step {last.step}, {last.status.value})" if last else "Resume from: [yellow]no checkpoint certified clean[/]")
    replay = result.replayed
    if replay.windows:
        console.print(f"Replayed on {escape(replay.device or '?')}, comparison {replay.comparison}"
                      + (f", all-reduce order {replay.reduction_order}" if replay.reduction_order else "") + ":")
        for w in replay.windows:
            if w.last < w.start:
                console.print(f"  nothing from checkpoint {w.start} (its first step could not be replayed; see the notes): {escape(w.reason)}")
            else:
                span = f"step {w.start}" if w.last == w.start else f"steps {w.start}..{w.last}"
                console.print(f"  {span} from checkpoint {w.start} ({w.comparison}): {escape(w.reason)}")
    for note in (*replay.notes, *result.notes):
        console.print(f"[dim]note: {escape(note)}[/]")
    for line in result.settle:
        console.print(f"[yellow]to settle:[/] {escape(line)}")
    for line in [d for d in result.damage if d not in stopped][:5]:
        console.print(f"[yellow]trace damage:[/] {escape(line)}")


def evidence_table(console, evidence: list[Evidence], title: str) -> None:
    """Print ``evidence`` as a table (one row per step, kind, ranks and source)."""
    table = new_table(console, title, ("step", "kind", "ranks", "location", "expected", "found", "source", "strength"), overflow="fold")
    seen = set()
    for e in evidence:
        key = (e.step, e.kind, e.ranks, e.source)
        if key in seen:
            continue
        seen.add(key)
        table.add_row(str(e.step), e.kind.value, ranks_text(e.ranks), e.location.value, escape(e.expected), escape(e.found), e.source,
                      e.strength.value)
    console.print(table)

