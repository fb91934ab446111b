"""``sdc-forensics bisect TRACE_DIR`` and ``sdc-forensics replay TRACE_DIR --from N --to M``.

The click layer only builds options, draws progress on stderr and maps the verdict to the exit
code (0 clean, 1 corruption, 4 inconclusive; errors: 2 usage, 3 bad input, via ``cli/main.py``).
``bisect --trace-only`` never imports torch: the replay modules are imported only when used.
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import EXIT_BY_VERDICT, Bars, run_analysis, trace_analysis_options
from sdc_forensics.cli.limits import read_limit_options
from sdc_forensics.cli.output import emit_json, err

@click.command("bisect")
@trace_analysis_options
@click.option("--trace-only", is_flag=True, help="Use the trace alone: no replay, no checkpoint files, no torch.")
@click.option("--max-replay-steps", type=click.IntRange(min=1),
              help="Stop widening backwards after this many replayed steps (checkpoints before stay unverified).")
@click.option("--scan-recurrence", is_flag=True, help="Also replay the intervals after the first divergence: recurrences.")
@read_limit_options
@click.pass_context
def bisect_cmd(ctx: click.Context, trace_dir: Path, as_json: bool, trace_only: bool, **options) -> None:
    """Find the first divergent step, the suspect rank and the last clean checkpoint of TRACE_DIR.

    Triage of the trace first; then a replay of the window that confirms it, widening backwards
    one checkpoint interval at a time down to the first step (every step before a checkpoint is
    examined before it is called clean). Exit 0 clean, 1 corruption, 2 usage error, 3 bad input,
    4 inconclusive.
    """
    from sdc_forensics.present.bisect import bisect_document, render_bisect

    result = run_analysis(trace_dir, trace_only=trace_only, **options)
    if as_json:
        emit_json(bisect_document(result))
    render_bisect(result, err)
    ctx.exit(EXIT_BY_VERDICT[result.verdict.value])


@click.command("replay")
@trace_analysis_options
@click.option("--from", "start", type=click.IntRange(min=0), required=True, help="Checkpoint step N to start from (holds θ_N).")
@click.option("--to", "stop", type=click.IntRange(min=0), required=True, help="Last step M to replay (inclusive).")
@click.pass_context
def replay_cmd(ctx: click.Context, trace_dir: Path, checkpoints_dir: Path | None, recipe: str | None, device: str,
               force_device: bool, as_json: bool, start: int, stop: int, num_threads: int | None, force_tolerant: bool) -> None:
    """Replay steps N..M of TRACE_DIR from checkpoint N and compare every fingerprint with the trace.

    Exit 0 when the replay matches the trace, 1 when it diverges (strong evidence), 4 when the
    only mismatches are weak (tolerant residuals within what clean replays produce), 2 usage, 3 bad input.
    """
    from sdc_forensics.checkpoint.locate import locate_checkpoint
    from sdc_forensics.errors import CheckpointError, RecipeError, UsageError
    from sdc_forensics.forensics import decision
    from sdc_forensics.present.bisect import render_replay, replay_document
    from sdc_forensics.forensics.replay import ReplayOptions, replay_window
    from sdc_forensics.recipe import load_recipe
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes
    from sdc_forensics.trace.reader import Trace

    if stop < start:
        raise UsageError(f"--to {stop} is before --from {start}: the window is steps N..M with N <= M")
    trace = Trace.open(trace_dir)
    reference = recipe or trace.manifest.recipe
    if not reference:
        raise RecipeError("the trace names no replay recipe: pass --recipe MODULE:ATTR (docs/recipes.md)")
    notes = {n.step: n for n in read_checkpoint_notes(trace.path)}
    if start not in notes:
        have = ", ".join(map(str, sorted(notes))) or "none"
        raise UsageError(f"--from {start} is not a checkpoint step of this trace (checkpoints: {have})")
    note = notes[start]
    path = locate_checkpoint(note, checkpoints_dir, trace.path.parent)
    if path is None:
        raise CheckpointError(f"checkpoint file of step {start} ({Path(note.path).name}) not found: pass --checkpoints DIR")
    options = ReplayOptions(start_step=start, stop_step=stop, checkpoint_path=path, expected_weights_digest=note.weights_digest,
                            device=device, force_device=force_device, num_threads=num_threads, force_tolerant=force_tolerant)
    with Bars(enabled=err.is_terminal) as bars:
        bars.window(start, stop, "requested")
        result = replay_window(trace, load_recipe(reference), options, bars.step)
    decided = decision.decide(result.evidence, world_size=trace.world_size, identity=trace.manifest.identity, notes=(),
                              files={}, majority={}, examined=decision.Examined(first_step=start, replayed=frozenset(range(start, result.last_step + 1))))
    if as_json:
        emit_json(replay_document(result, decided))
    render_replay(result, err)
    ctx.exit(EXIT_BY_VERDICT[decided.verdict.value])
