"""Renderers of one replayed window (``sdc-forensics replay``): text for people, its JSON document."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from sdc_forensics.decide.verdict import Verdict
from sdc_forensics.forensics.replay import ReplayRun
from sdc_forensics.present.bisect import evidence_table
from sdc_forensics.present.text import pairs_text


def replay_document(run: ReplayRun) -> dict[str, Any]:
    """The ``replay --json`` document (docs/json.md; ``schema_version`` is added by the emitter)."""
    result, decided = run.result, run.decision
    return {
        "from": result.start_step,
        "to": result.stop_step,
        "last_replayed": result.last_step,
        "device": result.device,
        "comparison": result.comparison,
        "tolerant_from": result.tolerant_from,
        "reduction_order": result.reduction_order or None,
        "first_divergent_step": result.first_divergent_step,
        "settings": dict(result.settings),
        "notes": list(result.notes),
        "max_residual_ratio": result.max_residual_ratio,
        "evidence": [e.to_json() for e in result.evidence],
        "verdict": decided.verdict.value,
        "settle": list(decided.settle),
        "preflight": None if run.preflight is None else run.preflight.to_json(),
    }


def render_replay(run: ReplayRun, console) -> None:
    """Print one replay window's outcome: matches or diverges, mismatches, settings, what would settle it."""
    result, decided = run.result, run.decision
    if result.first_divergent_step is None:
        status = "[bold green]matches the trace[/]"
    elif decided.verdict is Verdict.INCONCLUSIVE:
        # the decision's reading (an update no rank reproduces is the recipe's, not a fault on every rank)
        status = (
            f"[bold yellow]does not reproduce step {result.first_divergent_step}[/], inconclusive (see 'to settle')"
        )
    else:
        status = f"[bold red]diverges at step {result.first_divergent_step}[/]"
    console.print(
        f"Replay of steps {result.start_step}..{result.last_step} on {escape(result.device)} ({result.comparison}): {status}"
    )
    if decided.evidence:
        evidence_table(console, list(decided.evidence), "Mismatches")
    if result.settings:
        console.print(f"[dim]deterministic settings: {escape(pairs_text(result.settings))}[/]")
    for note in result.notes:
        console.print(f"[dim]note: {escape(note)}[/]")
    for line in run.decision.settle:
        console.print(f"[yellow]to settle:[/] {escape(line)}")
