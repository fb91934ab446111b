"""``sdc-forensics replay TRACE_DIR --from N --to M``: parse, replay one window, render.

The window is checked against the trace before anything is imported or replayed
(``forensics.replay.check_window``): a step outside the trace is a usage error, exit 2.
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import Bars, distributed_replay, stdout_is_data, trace_analysis_options
from sdc_forensics.cli.output import emit_json, err
from sdc_forensics.exitcodes import verdict_exit


@click.command("replay")
@trace_analysis_options
@click.option(
    "--from", "start", type=click.IntRange(min=0), required=True, help="Checkpoint step N to start from (holds θ_N)."
)
@click.option("--to", "stop", type=click.IntRange(min=0), required=True, help="Last step M to replay (inclusive).")
@stdout_is_data
@distributed_replay
@click.pass_context
def replay_cmd(ctx: click.Context, trace_dir: Path, as_json: bool, start: int, stop: int, **options) -> None:
    """Replay steps N..M of TRACE_DIR from checkpoint N and compare every fingerprint with the trace.

    Exit 0 when the replay matches the trace, 1 when it diverges (strong evidence), 4 when the
    only mismatches are weak (tolerant residuals within what clean replays produce), 2 usage
    error (a window outside the trace's steps, N not a checkpoint step), 3 bad input.
    """
    from sdc_forensics.replay.options import AnalysisOptions
    from sdc_forensics.forensics.replay import ReplayRequest, replay_from_trace
    from sdc_forensics.present.replay import render_replay, replay_document

    request = ReplayRequest(start_step=start, stop_step=stop, options=AnalysisOptions(**options))
    with Bars(enabled=err.is_terminal) as bars:
        run = replay_from_trace(trace_dir, request, progress=bars)
    if as_json:
        emit_json(replay_document(run))
    render_replay(run, err)
    ctx.exit(verdict_exit(run.decision.verdict))
