"""Renderers of a :class:`~sdc_forensics.forensics.certify.Certification`: the checkpoint table and
resume point for people, the ``certify --json`` document for programs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.markup import escape

from sdc_forensics.forensics.certify import Certification
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
    }


def render_certify(cert: Certification, console, certificate_out: str | Path | None = None) -> None:
    """Print every checkpoint's status, what stays unverified, the analysis, and where to resume."""
    result, resume = cert.analysis, cert.resume
    table = new_table(console, f"checkpoints of {escape(str(cert.trace_dir))}", ("step", "status", "path", "reasons"))
    for s in cert.checkpoints:
        style = _STYLE.get(s.status.value, "bold red")
        table.add_row(str(s.step), f"[{style}]{s.status.value}[/]", escape(Path(s.path).name if s.path else "(not read)"),
                      escape("; ".join(s.reasons)))
    console.print(table)
    for line in result.damage:
        console.print(f"[yellow]trace damage:[/] {escape(line)}")
    for path in cert.unnoted:
        console.print(f"[yellow]unverified:[/] {escape(str(path))} has no checkpoint note in the trace; nothing can be certified about it")
    console.print(f"analysis: {result.verdict.value}; first divergent step: "
                  f"{'none found' if result.first_divergent_step is None else result.first_divergent_step}; {escape(result.scope)}")
    said: set[str] = set()
    for note in (*result.replayed.notes, *result.notes):  # what stopped or bent a replay, each reason once
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
    else:
        later = [s for s in cert.checkpoints if s.step > resume.step and not s.clean]
        after = f"; {len(later)} later checkpoint(s) not clean, listed above" if later else ""
        console.print(f"[bold green]resume from step {resume.step}[/]: {escape(resume.path)} ({resume.status.value}){after}")
    if certificate_out is not None:
        console.print(f"certificate written to {escape(str(certificate_out))}")
