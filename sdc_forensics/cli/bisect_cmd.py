"""``sdc-forensics bisect TRACE_DIR``: parse, run the analysis, render.

Exit 0 clean, 1 corruption, 4 inconclusive, and 4 for a clean verdict of ``--trace-only``
(``exitcodes.analysis_exit``; errors: 2 usage, 3 bad input, via ``cli/main.py``).
``bisect --trace-only`` never imports torch: the replay modules are imported only when used.
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import (
    distributed_replay,
    ledger_options,
    run_analysis,
    stdout_is_data,
    trace_analysis_options,
)
from sdc_forensics.cli.limits import read_limit_options
from sdc_forensics.cli.output import emit_json, err
from sdc_forensics.exitcodes import analysis_exit


@click.command("bisect")
@trace_analysis_options
@ledger_options
@click.option("--trace-only", is_flag=True, help="Use the trace alone: no replay, no checkpoint files, no torch.")
@click.option(
    "--max-replay-steps",
    type=click.IntRange(min=1),
    help="Stop widening backwards after this many replayed steps (checkpoints before stay unverified).",
)
@click.option(
    "--scan-recurrence", is_flag=True, help="Also replay the intervals after the first divergence: recurrences."
)
@read_limit_options
@stdout_is_data
@distributed_replay
@click.pass_context
def bisect_cmd(ctx: click.Context, trace_dir: Path, as_json: bool, trace_only: bool, **options) -> None:
    """Find the first divergent step, the suspect rank and the last clean checkpoint of TRACE_DIR.

    Triage of the trace first; then a replay of the window that confirms it, widening backwards
    one checkpoint interval at a time down to the first step (every step before a checkpoint is
    examined before it is called clean).

    Exit 0 clean, 1 corruption, 2 usage error, 3 bad input, 4 inconclusive; with --trace-only,
    a clean verdict exits 4 (nothing was replayed: not a clean bill).
    """
    from sdc_forensics.replay.options import AnalysisOptions
    from sdc_forensics.present.bisect import bisect_document, render_bisect

    result = run_analysis(trace_dir, AnalysisOptions(trace_only=trace_only, **options))
    if as_json:
        emit_json(bisect_document(result))
    render_bisect(result, err)
    ctx.exit(analysis_exit(result.verdict, result.mode))
