"""``sdc-forensics inspect TRACE_DIR`` and ``sdc-forensics export TRACE_DIR`` (numpy only, no torch)."""

from __future__ import annotations

import sys

import click
from rich.markup import escape
from rich.table import Table

from sdc_forensics.cli.output import emit_json, err
from sdc_forensics.trace.export import export_csv
from sdc_forensics.trace.reader import Trace
from sdc_forensics.trace.summary import summarize, summary_document


@click.command("inspect")
@click.argument("trace_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def inspect_cmd(trace_dir: str, as_json: bool) -> None:
    """Summarise TRACE_DIR: ranks, steps, attempts, checkpoints, fingerprint settings, damage.

    Exit 0 when the trace is usable (damage is listed), 3 when it is not a usable trace.
    """
    summary = summarize(Trace.open(trace_dir))
    doc = summary_document(summary)
    if as_json:
        emit_json(doc)
    _render(doc)


def _render(doc: dict) -> None:
    # Every string here comes from the trace's files: escaped, so that a "[/]" in a host name is
    # printed, not read as rich markup (types were checked when the manifest and notes were parsed).
    steps = doc["steps"]
    fp = doc["fingerprint"]
    err.print(
        f"[bold]{escape(doc['trace_dir'])}[/]  format v{doc['format_version']}  world size {doc['world_size']}  "
        f"steps {steps['first']}..{steps['last']} ({steps['rank_steps']} rank-steps)  recipe {escape(doc['recipe'] or '-')}"
    )
    err.print(f"fingerprints: seed {fp['seed']:#x}, sketch k={fp['sketch_k']}, gradients in {escape(fp['grad_dtype'])}")
    _render_end(doc["end"])
    if doc["environment"]:
        env = doc["environment"]
        err.print(escape(f"torch {env['torch'] or '?'}  cuda {env['cuda'] or '-'}  determinism {env['determinism'] or '-'}"))
    ranks = Table(title="ranks (latest attempt)", title_justify="left")
    for col in ("rank", "host", "node", "local", "gpu", "job / node"):
        ranks.add_column(col)
    for r in doc["ranks"]:
        gpu = r["gpu_uuid"] or r["pci_bus_id"] or r["device"]
        job = " ".join(x for x in (r["slurm_job_id"], r["slurm_node"] or r["k8s_node"]) if x) or "-"
        ranks.add_row(str(r["rank"]), escape(r["host"]), str(r["node_rank"]), str(r["local_rank"]), escape(gpu), escape(job))
    err.print(ranks)
    attempts = Table(title="attempts", title_justify="left")
    for col in ("attempt", "resumed at step", "steps recorded", "records"):
        attempts.add_column(col)
    for a in doc["attempts"]:
        span = "-" if a["first_step"] is None else f"{a['first_step']}..{a['last_step']}"
        attempts.add_row(str(a["attempt"]), str(a["start_step"]), span, str(a["num_records"]))
    err.print(attempts)
    if doc["checkpoints"]:
        cks = Table(title="checkpoints noted", title_justify="left")
        for col in ("step", "path", "attempt", "blessed", "weights digest"):
            cks.add_column(col)
        for c in doc["checkpoints"]:
            cks.add_row(str(c["step"]), escape(c["path"]), str(c["attempt"]), "yes" if c["blessed"] else "[red]no[/]", escape(c["weights_digest"] or "-"))
        err.print(cks)
    else:
        err.print("checkpoints noted: none")
    counts = ", ".join(f"{k.lower()} {v}" for k, v in doc["records"].items() if v)
    err.print(f"records: {counts}")
    if doc["damage"]:
        dmg = Table(title=f"[yellow]damage ({len(doc['damage'])})[/]", title_justify="left")
        for col in ("kind", "rank", "attempt", "record", "detail"):
            dmg.add_column(col)
        for d in doc["damage"][:50]:
            dmg.add_row(d["kind"], str(d["rank"]), str(d["attempt"]), str(d["record_index"]), escape(d["detail"]))
        err.print(dmg)
        if len(doc["damage"]) > 50:
            err.print(f"… {len(doc['damage']) - 50} more in --json")
    else:
        err.print("[green]no damage found[/]")


def _render_end(end: dict) -> None:
    """How the run ended: one line, and where each rank's file stops when it stopped early."""
    if not end["stopped_early"]:
        if end["finalised"]:
            err.print(f"[green]run ended normally: every rank closed its trace after step {end['last_step']}[/]")
        return
    err.print(f"[bold yellow]{escape(end['summary'][0].upper() + end['summary'][1:])}[/]")
    ends = Table(title=f"where each rank's file ends (attempt {end['attempt']})", title_justify="left")
    for col in ("rank", "host", "last step", "closed", "torn bytes"):
        ends.add_column(col)
    stopped = set(end["stopped_ranks"])
    for r in end["ranks"]:
        closed = "-" if r["closed"] is None else ("on an exception" if r["closed_on_error"] else "yes") if r["closed"] else "[red]no[/]"
        last = "-" if r["last_step"] is None else str(r["last_step"])
        ends.add_row(f"[bold]{r['rank']}[/]" if r["rank"] in stopped else str(r["rank"]), escape(r["host"] or "-"),
                     last if r["has_file"] else "[red]no file[/]", closed, str(r["torn_bytes"]) if r["torn_bytes"] else "-")
    err.print(ends)


@click.command("export")
@click.argument("trace_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("-o", "--output", default="-", show_default=True, help="CSV file to write, or - for stdout.")
def export_cmd(trace_dir: str, output: str) -> None:
    """Export TRACE_DIR's STEP records (latest attempt per step) as CSV, one row per rank-step."""
    trace = Trace.open(trace_dir)
    if output == "-":
        rows = export_csv(trace, sys.stdout)
    else:
        with open(output, "x", newline="", encoding="utf-8") as handle:
            rows = export_csv(trace, handle)
    err.print(f"exported {rows} rank-steps to {output}")
