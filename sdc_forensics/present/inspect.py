"""Renderers of a :class:`~sdc_forensics.trace.summary.TraceSummary` (``sdc-forensics inspect``):
text for people and the ``inspect --json`` document. numpy only, no torch.

Every string here that comes from the trace's files is escaped, so that a ``[/]`` in a host name
is printed, not read as rich markup (types were checked when the manifest and notes were parsed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdc_forensics.replay import preflight

from rich.markup import escape

from sdc_forensics.present.text import new_table, pairs_text
from sdc_forensics.trace.checkpoints import unreplayable_steps, unreplayable_text
from sdc_forensics.trace.ends import RunEnd
from sdc_forensics.trace.summary import AlarmSummary, TraceSummary

_MAX_ROWS = 50


def inspect_document(summary: TraceSummary, covered=None) -> dict[str, Any]:
    """The ``inspect --json`` document (docs/json.md; ``schema_version`` is added by the emitter);
    ``covered``: the ledger's coverage (``forensics.ledger_coverage.LedgerCoverage``), or None."""
    from sdc_forensics.present.coverage import coverage_document

    m = summary.manifest
    latest = max(m.attempts, key=lambda a: a.attempt) if m.attempts else None
    return {
        "trace_dir": str(summary.path),
        "format_version": m.format_version,
        "world_size": m.world_size,
        "recipe": m.recipe,
        "framework": m.framework,
        "parallel": None if m.parallel is None else m.parallel.to_json(),
        "fingerprint": dataclasses.asdict(m.fingerprint),
        "steps": {"first": summary.first_step, "last": summary.last_step, "rank_steps": summary.num_rank_steps},
        "end": summary.end.to_json(),
        "records": summary.records_by_kind,
        "alarms": [_alarm_json(a) for a in summary.alarms],
        "attempts": [dataclasses.asdict(a) for a in summary.attempts],
        "ranks": [dataclasses.asdict(r) for r in (latest.ranks if latest else ())],
        "environment": None
        if latest is None
        else {"torch": latest.torch_version, "cuda": latest.cuda_version, "determinism": latest.determinism},
        "checkpoints": [
            {
                "step": c.step,
                "path": c.path,
                "attempt": c.attempt,
                "blessed": c.blessed,
                "weights_digest": c.weights_digest,
            }
            for c in summary.checkpoints
        ],
        "damage": [dataclasses.asdict(d) for d in summary.damage],
        "usable": True,
        "preflight": preflight.check(m).to_json() if m.attempts else None,
        "coverage": None if covered is None else [coverage_document(c) for c in covered.coverage],
        "ledger": None
        if covered is None or covered.ledger is None
        else {
            "path": str(covered.ledger),
            "strong_evidence": [{"step": s, "record": r} for s, r in covered.strong_evidence],
            "notes": list(covered.notes),
        },
    }


def _alarm_json(alarm: AlarmSummary) -> dict[str, Any]:
    doc = dataclasses.asdict(alarm)
    doc["recorded_by"] = list(alarm.recorded_by)
    return doc


def render_inspect(summary: TraceSummary, console, covered=None) -> None:
    """Print the summary: run, fingerprints, how it ended, ranks, attempts, checkpoints, coverage, alarms, damage."""
    m, fp = summary.manifest, summary.manifest.fingerprint
    latest = max(m.attempts, key=lambda a: a.attempt) if m.attempts else None
    console.print(
        f"[bold]{escape(str(summary.path))}[/]  format v{m.format_version}  world size {m.world_size}  "
        + (
            f"steps {summary.first_step}..{summary.last_step} ({summary.num_rank_steps} rank-steps)"
            if summary.first_step is not None
            else "no steps recorded"
        )
        + f"  recipe {escape(m.recipe or '-')}"
    )
    if m.framework is not None:
        fw = m.framework
        console.print(
            f"written by: {escape(fw['name'])} {escape(fw['version'])} through {escape(fw['adapter'] or '-')}"
        )
    if m.parallel is not None:
        console.print(f"sharded: {escape(m.parallel.describe())}; reduced gradients and weights recorded per shard")
    console.print(f"fingerprints: seed {fp.seed:#x}, sketch k={fp.sketch_k}, gradients in {escape(fp.grad_dtype)}")
    _render_end(console, summary.end)
    if m.attempts:
        for line in preflight.check(m).lines():
            console.print(f"replay: {escape(line)}")
        from sdc_forensics.replay import (
            memory as replay_memory,
            # the memory plan (issue 35): imports torch for the sizes
        )

        for line in replay_memory.inspect_lines(summary.path, m):
            console.print(f"replay: {escape(line)}")
    if latest is not None:
        console.print(
            escape(
                f"torch {latest.torch_version or '?'}  cuda {latest.cuda_version or '-'}  "
                f"determinism {pairs_text(latest.determinism)}"
            )
        )
    ranks = new_table(
        console,
        "ranks (latest attempt)",
        ("rank", "host", "node", "local", "gpu", "job / node") + (("mesh",) if m.parallel is not None else ()),
    )
    for r in latest.ranks if latest else ():
        job = " ".join(x for x in (r.slurm_job_id, r.slurm_node or r.k8s_node) if x) or "-"
        ranks.add_row(
            str(r.rank),
            escape(r.host),
            str(r.node_rank),
            str(r.local_rank),
            escape(r.gpu),
            escape(job),
            *((escape(m.parallel.coordinates(r.rank)),) if m.parallel is not None else ()),
        )
    console.print(ranks)
    attempts = new_table(console, "attempts", ("attempt", "resumed at step", "steps recorded", "records"))
    for a in summary.attempts:
        span = "-" if a.first_step is None else f"{a.first_step}..{a.last_step}"
        attempts.add_row(str(a.attempt), str(a.start_step), span, str(a.num_records))
    console.print(attempts)
    if summary.checkpoints:
        # what the recorder saw when it saved each one; whether the file is still as saved and the
        # steps before it were clean is a status only certify (replay, files read) can give
        cks = new_table(
            console,
            "checkpoints noted (as saved; statuses: sdc-forensics certify)",
            ("step", "path", "attempt", "saved from", "weights digest"),
        )
        for c in summary.checkpoints:
            cks.add_row(
                str(c.step),
                escape(c.path),
                str(c.attempt),
                "majority" if c.blessed else "[red]no majority[/]",
                escape(c.weights_digest or "-"),
            )
        console.print(cks)
    else:
        console.print("checkpoints noted: none")
    gap = unreplayable_steps(summary.first_step, [c.step for c in summary.checkpoints])
    if gap is not None:
        console.print(f"[bold yellow]warning:[/] {escape(unreplayable_text(gap))}")
    if covered is not None:
        _render_coverage(console, covered)
    counts = ", ".join(f"{kind.lower()} {n}" for kind, n in summary.records_by_kind.items() if n)
    console.print(f"records: {counts}")
    _render_alarms(console, summary.alarms)
    if summary.damage:
        dmg = new_table(
            console, f"[yellow]damage ({len(summary.damage)})[/]", ("kind", "rank", "attempt", "record", "detail")
        )
        for d in summary.damage[:_MAX_ROWS]:
            dmg.add_row(d.kind, str(d.rank), str(d.attempt), str(d.record_index), escape(d.detail))
        console.print(dmg)
        if len(summary.damage) > _MAX_ROWS:
            console.print(f"… {len(summary.damage) - _MAX_ROWS} more in --json")
    else:
        console.print("[green]no damage found[/]")


def _render_coverage(console, covered) -> None:
    """Per checkpoint, what examined the steps before it (the ledger's replays, the online checks), and the ledger's own lines."""
    from sdc_forensics.present.coverage import render_coverage

    for line in covered.notes:
        console.print(f"[yellow]ledger:[/] {escape(line)}")
    for step, record in covered.strong_evidence:
        console.print(
            f"[bold red]ledger:[/] strong evidence at step {step} (record {escape(record)}): run sdc-forensics bisect"
        )
    render_coverage(console, covered.coverage)


def _render_alarms(console, alarms: tuple[AlarmSummary, ...]) -> None:
    """One row per alarm: step, rank at fault, check, what it found (the ALARM records of every rank, counted once)."""
    if not alarms:
        console.print("online alarms: none")
        return
    table = new_table(
        console, f"[red]online alarms ({len(alarms)})[/]", ("step", "rank", "check", "detail", "attempt", "recorded by")
    )
    for a in alarms[:_MAX_ROWS]:
        table.add_row(
            str(a.step),
            "none named" if a.rank is None else str(a.rank),
            a.check,
            escape(a.detail),
            str(a.attempt),
            f"{len(a.recorded_by)} rank(s)",
        )
    console.print(table)
    if len(alarms) > _MAX_ROWS:
        console.print(f"… {len(alarms) - _MAX_ROWS} more alarms in --json")


def _render_end(console, end: RunEnd) -> None:
    """How the run ended: one line, and where each rank's file stops when it stopped early."""
    if not end.stopped_early:
        if end.finalised:
            console.print(f"[green]run ended normally: every rank closed its trace after step {end.last_step}[/]")
        return
    summary = end.describe()
    console.print(f"[bold yellow]{escape(summary[0].upper() + summary[1:])}[/]")
    ends = new_table(
        console,
        f"where each rank's file ends (attempt {end.attempt})",
        ("rank", "host", "last step", "closed", "torn bytes"),
    )
    for r in end.ranks:
        closed = (
            "-"
            if r.closed is None
            else ("on an exception" if r.closed_on_error else "yes")
            if r.closed
            else "[red]no[/]"
        )
        last = "-" if r.last_step is None else str(r.last_step)
        ends.add_row(
            f"[bold]{r.rank}[/]" if r.rank in end.stopped_ranks else str(r.rank),
            escape(r.host or "-"),
            last if r.has_file else "[red]no file[/]",
            closed,
            str(r.torn_bytes) if r.torn_bytes else "-",
        )
    console.print(ends)
