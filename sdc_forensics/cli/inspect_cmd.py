"""``sdc-forensics inspect TRACE_DIR``: parse, summarise the trace (numpy only, no torch), render."""

from __future__ import annotations

import click

from sdc_forensics.cli.common import ledger_options, stdout_is_data
from sdc_forensics.cli.output import emit_json, err


@click.command("inspect")
@click.argument("trace_dir", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@ledger_options
@stdout_is_data
def inspect_cmd(trace_dir: str, as_json: bool, ledger_path, no_ledger: bool) -> None:
    """Summarise TRACE_DIR: ranks, steps, attempts, checkpoints, online alarms, fingerprint settings, damage,
    and per checkpoint what examined the steps before it (the ledger's replays, the online checks), replaying nothing.

    Exit 0 when the trace is usable (damage is listed), 3 when it is not a usable trace.
    """
    from sdc_forensics.forensics.ledger_coverage import ledger_coverage
    from sdc_forensics.present.inspect import inspect_document, render_inspect
    from sdc_forensics.trace.reader import Trace
    from sdc_forensics.trace.summary import summarize

    trace = Trace.open(trace_dir)
    summary = summarize(trace)
    covered = ledger_coverage(trace, ledger_path, no_ledger)
    if as_json:
        emit_json(inspect_document(summary, covered))
    render_inspect(summary, err, covered)
