"""Renderers of a :class:`~sdc_forensics.forensics.certify.Certification`: the checkpoint table and
resume point for people, the ``certify --json`` document for programs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.markup import escape

from sdc_forensics.exitcodes import ExitCode
from sdc_forensics.forensics.certify import Certification
from sdc_forensics.present.coverage import coverage_document, render_coverage
from sdc_forensics.present.text import new_table

_STYLE = {"clean": "green", "unverified": "yellow"}


def certify_document(cert: Certification, certificate_out: str | Path | None = None) -> dict[str, Any]:
    """The ``certify --json`` document (docs/json.md; ``schema_version`` is added by the emitter)."""
    result, resume = cert.analysis, cert.resume
    return {
        "command": "certify",
        "trace_dir": str(cert.trace_dir),
        "verdict": result.verdict.value,
        "first_divergent_step": result.first_divergent_step,
        "mode": result.mode,
        "scope": result.scope,
        "settle": list(result.settle),
        "trace_damage": list(result.damage),
        "checkpoints": [s.to_json() for s in cert.checkpoints],
        "unnoted": [str(p) for p in cert.unnoted],
        "resume_step": resume.step if resume else None,
        "resume_path": resume.path if resume else None,
        "certificate": str(certificate_out) if certificate_out else None,
        "exit_code": cert.exit_code,
        "preflight": None if result.preflight is None else result.preflight.to_json(),
        "coverage": [coverage_document(c) for c in cert.coverage],
    }


def render_certify(cert: Certification, console, certificate_out: str | Path | None = None) -> None:
    """Print every checkpoint's status, what stays unverified, the analysis, and where to resume."""
    result, resume = cert.analysis, cert.resume
    table = new_table(console, f"checkpoints of {escape(str(cert.trace_dir))}", ("step", "status", "path", "reasons"))
    for s in cert.checkpoints:
        style = _STYLE.get(s.status.value, "bold red")
        table.add_row(
            str(s.step),
            f"[{style}]{s.status.value}[/]",
            # the whole path: a resumed run's attempts may save files of the same name in other folders
            escape(s.path or "(not read)"),
            escape("; ".join(s.reasons)),
        )
    console.print(table)
    render_coverage(console, cert.coverage)
    for line in result.damage:
        console.print(f"[yellow]trace damage:[/] {escape(line)}")
    for path in cert.unnoted:
        console.print(
            f"[yellow]unverified:[/] {escape(str(path))} has no checkpoint note in the trace; nothing can be certified about it"
        )
    for path, note in cert.replaced:
        console.print(
            f"[yellow]earlier attempt:[/] {escape(str(path))} is attempt {note.attempt}'s checkpoint {note.step}, saved "
            f"again by a later attempt (the one above); it holds attempt {note.attempt}'s state: `sdc-forensics "
            f"verify-checkpoint {escape(str(path))} --trace {escape(str(cert.trace_dir))}` judges it on that attempt's steps"
        )
    console.print(
        f"analysis: {result.verdict.value}; first divergent step: "
        f"{'none found' if result.first_divergent_step is None else result.first_divergent_step}; {escape(result.scope)}"
    )
    said: set[str] = set()
    # what stopped or bent a replay, each reason once
    for note in (*result.replayed.notes, *result.notes):
        reason = re.sub(r"^steps? [\d.]+(, rank \d+)?: ", "", note)
        if reason not in said:
            said.add(reason)
            console.print(f"[dim]note: {escape(note)}[/]")
    for line in result.settle:
        console.print(f"[yellow]to settle:[/] {escape(line)}")
    if not cert.checkpoints:
        console.print("[bold red]no checkpoint notes[/] in this trace: nothing to certify")
    elif resume is None:
        console.print("[bold red]no checkpoint certified clean[/]: none can be resumed from safely")
    # certify_exit: no resume point without a verdict
    elif cert.exit_code == ExitCode.INCONCLUSIVE:
        console.print(
            f"[bold yellow]no resume point named (exit 4)[/]: the analysis is inconclusive (see 'to settle'); "
            f"checkpoint {resume.step} is the last certified clean ({escape(resume.path)}), and resuming there "
            f"re-runs every step after it"
        )
    else:
        later = [s for s in cert.checkpoints if s.step > resume.step and not s.clean]
        after = f"; {len(later)} later checkpoint(s) not clean, listed above" if later else ""
        console.print(
            f"[bold green]resume from step {resume.step}[/]: {escape(resume.path)} ({resume.status.value}){after}"
        )
    if certificate_out is not None:
        console.print(f"certificate written to {escape(str(certificate_out))}")


def follow_document(outcome) -> dict[str, Any]:
    """The ``certify --follow --json`` document: ``certify``'s document of the analysis the follower
    ended with (the incident's, or the ledger's alone), plus ``follow``: what it replayed, its lag,
    why it stopped, and the incident as ``bisect --json`` prints it (docs/json.md)."""
    from sdc_forensics.present.bisect import bisect_document

    incident = outcome.incidents[-1] if outcome.incidents else None
    doc = certify_document(outcome.final) if outcome.final is not None else {"command": "certify"}
    doc["follow"] = {
        "stopped_by": outcome.stopped_by,
        "lag": outcome.lag,
        "exit_code": int(outcome.exit_code),
        "intervals": [
            {
                "from": i.start,
                "last": i.last,
                "outcome": i.outcome,
                "comparison": i.comparison,
                "record": i.record_id or None,
                "lag": i.lag,
            }
            for i in outcome.intervals
        ],
        "unreplayable": [list(span) for span in outcome.unreplayable],
        "budget": outcome.budget,
        "skipped": [list(span) for span in outcome.skipped],
        "incident": None if incident is None else bisect_document(incident.analysis),
    }
    return doc


def render_follow(outcome, console) -> None:
    """The incident (as ``bisect`` prints it) or the final statuses, then one line on what the follower did."""
    from sdc_forensics.present.bisect import render_bisect

    if outcome.incidents:
        console.print("[bold red]incident[/] found while following the run:")
        render_bisect(outcome.incidents[-1].analysis, console)
    elif outcome.final is not None:
        render_certify(outcome.final, console)
    replayed = [i for i in outcome.intervals if i.outcome != "reused"]
    console.print(
        f"follower stopped ({outcome.stopped_by}): {len(replayed)} interval(s) replayed, "
        f"{len(outcome.intervals) - len(replayed)} already in the ledger, lag {outcome.lag} interval(s)"
        + (f", {len(outcome.unreplayable)} not replayable (checkpoint file gone)" if outcome.unreplayable else "")
        + (
            f", {len(outcome.skipped)} left to the online checks by --budget {outcome.budget}"
            if outcome.skipped
            else ""
        )
    )
