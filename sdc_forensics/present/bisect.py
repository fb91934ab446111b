"""Renderers of a :class:`BisectResult`: rich text for people, the ``bisect --json`` document for programs.

The text goes to the stderr console of ``cli/output.py``; the JSON document (sorted keys,
``schema_version``) goes to stdout through ``output.emit_json``. Neither changes the result.
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from sdc_forensics.exitcodes import analysis_exit, verdict_exit
from sdc_forensics.evidence import Evidence
from sdc_forensics.decide.common_mode import is_unreproduced_update
from sdc_forensics.decide.decision import Status
from sdc_forensics.decide.verdict import BisectResult, LedgerSummary, ReplayedWindow, ReplaySummary, Verdict
from sdc_forensics.present.text import new_table, ranks_text
from sdc_forensics.trace.ends import STOPPED_EARLY

_STYLE = {Verdict.CLEAN: "bold green", Verdict.CORRUPTION: "bold red", Verdict.INCONCLUSIVE: "bold yellow"}
_STATUS_STYLE = {Status.CLEAN: "green", Status.UNVERIFIED: "yellow", Status.TAINTED: "red", Status.CORRUPT: "bold red"}


def bisect_document(result: BisectResult) -> dict[str, Any]:
    """The ``--json`` document of ``bisect`` (docs/json.md, ``docs/schemas/bisect.schema.json``;
    ``schema_version`` is added by the emitter). ``report``'s JSON is this document plus its own."""
    last = result.last_clean_checkpoint
    return {
        "verdict": result.verdict.value,
        "exit_code": int(analysis_exit(result.verdict, result.mode)),
        "first_divergent_step": result.first_divergent_step,
        "divergence_window": None if result.divergence_window is None else list(result.divergence_window),
        "suspects": [s.to_json() for s in result.suspects],
        "last_clean_checkpoint": None
        if last is None
        else {"step": last.step, "path": last.path, "status": last.status.value},
        "checkpoints": [c.to_json() for c in result.checkpoints],
        "replayed": _replayed_document(result.replayed),
        "evidence": [e.to_json() for e in result.evidence if not e.is_hint],
        "hints": [e.to_json() for e in result.evidence if e.is_hint],
        "mode": result.mode,
        "scope": result.scope,
        "settle": list(result.settle),
        "notes": list(result.notes),
        "preflight": None if result.preflight is None else result.preflight.to_json(),
        "trace": {
            "path": result.trace_path,
            "world_size": result.world_size,
            "steps": None if result.step_range is None else list(result.step_range),
            "damage": list(result.damage),
        },
    }


def _replayed_document(replay: ReplaySummary) -> dict[str, Any]:
    doc = {
        "windows": [_window_document(w) for w in replay.windows],
        "device": replay.device,
        "comparison": replay.comparison,
        "steps_replayed": replay.steps_replayed,
        "reduction_order": replay.reduction_order or None,
        "settings": replay.settings,
        "notes": list(replay.notes),
    }
    if replay.ledger is not None:
        doc["ledger"] = ledger_document(replay.ledger)
    return doc


def ledger_document(ledger: LedgerSummary) -> dict[str, Any]:
    """The ``ledger`` object of the JSON documents: what came from the ledger, what was appended (docs/json.md)."""
    return {
        "path": ledger.path,
        "steps_reused": ledger.steps_reused,
        "appended": list(ledger.appended),
        "notes": list(ledger.notes),
        "reused": [
            {"from": w.start, "last": w.last, "records": list(w.record_ids), "reason": w.reason} for w in ledger.reused
        ],
    }


def render_ledger(ledger: LedgerSummary | None, console) -> None:
    """One line per window taken from the ledger, and one for what was appended."""
    if ledger is None:
        return
    for w in sorted(ledger.reused, key=lambda w: w.start):
        span = f"step {w.start}" if w.last == w.start else f"steps {w.start}..{w.last}"
        console.print(f"  {span} from the ledger (exact, clean; record {', '.join(w.record_ids)})")
    if ledger.appended:
        console.print(f"[dim]ledger {escape(ledger.path)}: {len(ledger.appended)} record(s) appended[/]")


def _window_document(window: ReplayedWindow) -> dict[str, Any]:
    return {
        "from": window.start,
        "to": window.stop,
        "last_replayed": window.last,
        "comparison": window.comparison,
        "tolerant_from": window.tolerant_from,
        "reason": window.reason,
        "max_residual_ratio": window.max_residual_ratio,
    }


def _bounded(step: int, evidence) -> str:
    """``step``, or ``M..step`` where the evidence observed there only bounds its fault from step M."""
    onsets = [
        e.earliest_step for e in evidence if e.step == step and e.earliest_step is not None and e.earliest_step < step
    ]
    return f"{min(onsets)}..{step}" if onsets else str(step)


def render_bisect(result: BisectResult, console) -> None:
    """Print the human summary: verdict, suspects, checkpoints, what was replayed and why."""
    style = _STYLE[result.verdict]
    headline = f"[{style}]{result.verdict.value.upper()}[/]"
    if result.first_divergent_step is not None:
        s = result.first_divergent_step
        at_rest = sorted(
            {
                x.rank
                for x in result.suspects
                if x.location.value == "state_at_rest" and x.rank is not None and s in x.steps
            }
        )
        # a copy changed in memory before the step's forward: θ_s as the job computed and saved it is still clean
        copy = f"; rank(s) {', '.join(map(str, at_rest))}' copy of it changed in memory" if at_rest else ""
        window = result.divergence_window
        if window is not None and window[0] == s and window[1] > s and not copy:
            # only bounded (a state digested at checkpoints only): at or after s, by window[1]
            headline += f"  first divergent step {s} at the earliest (θ_{s} clean, θ_{window[1] + 1} not)"
        else:
            headline += f"  first divergent step {s} (θ_{s} clean{copy}, θ_{s + 1} not)"
    console.print(headline)
    console.print(f"[dim]{escape(result.scope)}[/]")
    # a clean verdict of the trace alone
    if analysis_exit(result.verdict, result.mode) != verdict_exit(result.verdict):
        console.print(
            "[yellow]exit 4, not 0[/]: the trace's checks found nothing, but no step was replayed and no checkpoint "
            "file read: not a clean bill; bisect without --trace-only (with the recipe and checkpoints) to certify"
        )
    # trace.ends.RunEnd.describe()
    stopped = [line for line in result.damage if line.startswith(STOPPED_EARLY)]
    for line in stopped:
        console.print(f"[bold yellow]{escape(line[0].upper() + line[1:])}[/]")
    if result.suspects:
        sharded = any(
            s.mesh
            for s in result.suspects
            # a sharded job: the mesh coordinates say which shard and replica
        )
        table = new_table(
            console,
            "Suspects",
            ("rank", "host", "gpu")
            + (("mesh",) if sharded else ())
            + ("location", "steps", "recurrence", "recommendation"),
        )
        for s in result.suspects:
            table.add_row(
                "all (collective)" if s.rank is None else str(s.rank),
                escape(s.host or "-"),
                escape(s.gpu or "-"),
                *((escape(s.mesh or "-"),) if sharded else ()),
                s.location.value,
                ", ".join(_bounded(step, s.evidence) for step in s.steps),
                "recurring" if s.recurring else "one event",
                escape(s.recommendation),
            )
        console.print(table)
        evidence_table(console, [e for s in result.suspects for e in s.evidence], "Evidence chain")
    elif [e for e in result.evidence if not e.is_hint]:
        evidence_table(console, [e for e in result.evidence if not e.is_hint], "Evidence")
    hints = [e for e in result.evidence if e.is_hint]
    if hints:
        console.print(
            f"[dim]{len(hints)} statistical hint(s), not a verdict: "
            + "; ".join(f"step {e.step} rank {ranks_text(e.ranks)}" for e in hints[:5])
            + "[/]"
        )
    if result.checkpoints:
        table = new_table(console, "Checkpoints", ("step", "status", "reasons", "path"))
        for c in result.checkpoints:
            table.add_row(
                str(c.step),
                f"[{_STATUS_STYLE[c.status]}]{c.status.value}[/]",
                escape("; ".join(c.reasons[:3])),
                escape(c.path),
            )
        console.print(table)
    last = result.last_clean_checkpoint
    if last is None:
        console.print("Resume from: [yellow]no checkpoint certified clean[/]")
    elif result.verdict is Verdict.INCONCLUSIVE:
        # certify's rule (forensics.certify.certify_exit): no resume point without a verdict
        console.print(
            "Resume from: [yellow]no point named[/]: the analysis is inconclusive (see 'to settle'); checkpoint "
            f"{last.step} is the last certified clean ({escape(last.path)}), and resuming there re-runs every step after it"
        )
    else:
        console.print(f"Resume from: [bold]{escape(last.path)}[/] (step {last.step}, {last.status.value})")
    replay = result.replayed
    if replay.windows:
        console.print(
            f"Replayed on {escape(replay.device or '?')}, comparison {replay.comparison}"
            + (f", all-reduce order {replay.reduction_order}" if replay.reduction_order else "")
            + ":"
        )
        for w in replay.windows:
            if w.last < w.start:
                console.print(
                    f"  nothing from checkpoint {w.start} (its first step could not be replayed; see the notes): {escape(w.reason)}"
                )
            else:
                span = f"step {w.start}" if w.last == w.start else f"steps {w.start}..{w.last}"
                console.print(f"  {span} from checkpoint {w.start} ({w.comparison}): {escape(w.reason)}")
    elif replay.ledger is not None and replay.ledger.reused:
        console.print("Nothing replayed now:")
    render_ledger(replay.ledger, console)
    for note in (*replay.notes, *result.notes):
        console.print(f"[dim]note: {escape(note)}[/]")
    for line in result.settle:
        console.print(f"[yellow]to settle:[/] {escape(line)}")
    for line in [d for d in result.damage if d not in stopped][:5]:
        console.print(f"[yellow]trace damage:[/] {escape(line)}")


def evidence_table(console, evidence: list[Evidence], title: str) -> None:
    """Print ``evidence`` as a table (one row per step, kind, ranks and source)."""
    table = new_table(
        console,
        title,
        ("step", "kind", "ranks", "location", "expected", "found", "source", "strength"),
        overflow="fold",
    )
    seen = set()
    for e in evidence:
        key = (e.step, e.kind, e.ranks, e.source)
        if key in seen:
            continue
        seen.add(key)
        table.add_row(
            str(e.step) if e.earliest_step is None or e.earliest_step >= e.step else f"{e.earliest_step}..{e.step}",
            e.kind.value,
            ranks_text(e.ranks),
            e.location.value,
            escape(e.expected),
            escape(e.found),
            e.source,
            # an update the replay did not reproduce is about the replay's recipe, not a rank's fault:
            # "strong" there read as strong evidence of corruption on an inconclusive answer
            "recipe?" if is_unreproduced_update(e) else e.strength.value,
        )
    console.print(table)
