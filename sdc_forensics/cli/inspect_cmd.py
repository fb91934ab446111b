"""``sdc-forensics inspect TRACE_DIR``: parse, summarise the trace (numpy only, no torch), render."""

from __future__ import annotations

import click

from sdc_forensics.cli.output import emit_json, err


@click.command("inspect")
@click.argument("trace_dir", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def inspect_cmd(trace_dir: str, as_json: bool) -> None:
    """Summarise TRACE_DIR: ranks, steps, attempts, checkpoints, online alarms, fingerprint settings, damage.

    Exit 0 when the trace is usable (damage is listed), 3 when it is not a usable trace.
    """
    from sdc_forensics.present.inspect import inspect_document, render_inspect
    from sdc_forensics.trace.reader import Trace
    from sdc_forensics.trace.summary import summarize

    summary = summarize(Trace.open(trace_dir))
    if as_json:
        emit_json(inspect_document(summary))
    render_inspect(summary, err)
