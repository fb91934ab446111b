"""Replay one window of a recorded run, named by its trace: ``sdc-forensics replay``.

:func:`check_window` refuses a window the trace cannot answer (before torch is imported or
anything is replayed); :func:`replay_from_trace` finds checkpoint ``N``'s note and file, replays
steps ``N..M`` and hands the evidence to ``decide.decision`` for the verdict. Exit statuses
follow the verdict: 0 the replay matches the trace, 1 it diverges (strong evidence), 4 only weak
mismatches (tolerant residuals within what clean replays produce).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from sdc_forensics.decide.decision import Decision
from sdc_forensics.replay.options import AnalysisOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayRequest:
    """One window to replay.

    Attributes:
        start_step: checkpoint ``N`` to start from (it holds ``θ_N``).
        stop_step: the last step ``M`` replayed (inclusive).
        options: what the user chose (``checkpoints_dir``, ``recipe``, ``device``, ``force_device``,
            ``num_threads``, ``force_tolerant``), as for ``bisect``.
    """

    start_step: int
    stop_step: int
    options: AnalysisOptions = AnalysisOptions()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayRun:
    """A replayed window and the decision on its evidence."""

    # replay.replayer.ReplayResult
    result: Any
    decision: Decision
    # replay.preflight.Preflight
    preflight: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    """A window :func:`check_window` accepted: the trace, the recipe, checkpoint ``N``'s note."""

    # trace.reader.Trace
    trace: Any
    recipe: str
    # trace.checkpoints.CheckpointNote
    note: Any


def check_window(trace_dir: str | os.PathLike, request: ReplayRequest) -> Window:
    """Check, before any work, that the trace can answer ``request``.

    Raises:
        UsageError: ``--to`` before ``--from``, a step outside the trace's steps, ``--from`` not a
            checkpoint step, ``--checkpoints`` not a directory. RecipeError: no recipe named.
            TraceError: the trace is unreadable.
    """
    from sdc_forensics.errors import RecipeError, UsageError
    from sdc_forensics.trace.reader import Trace

    start, stop = request.start_step, request.stop_step
    if stop < start:
        raise UsageError(f"--to {stop} is before --from {start}: the window is steps N..M with N <= M")
    if request.options.checkpoints_dir is not None and not Path(request.options.checkpoints_dir).is_dir():
        raise UsageError(f"--checkpoints {request.options.checkpoints_dir} is not a directory")
    trace = Trace.open(trace_dir)
    bounds = trace.step_range()
    if bounds is None:
        raise UsageError(f"{trace.path} records no step: there is nothing to replay")
    first, last = bounds
    if start < first or stop > last:
        bad = f"--from {start}" if start < first else f"--to {stop}"
        raise UsageError(f"{bad} is outside the trace's steps {first}..{last}: choose a window within them")
    notes = {n.step: n for n in trace.checkpoint_notes()}
    if start not in notes:
        have = ", ".join(map(str, sorted(notes))) or "none"
        raise UsageError(f"--from {start} is not a checkpoint step of this trace (checkpoints: {have})")
    reference = request.options.recipe or trace.manifest.recipe
    if not reference:
        raise RecipeError("the trace names no replay recipe: pass --recipe MODULE:ATTR (docs/recipes.md)")
    return Window(trace=trace, recipe=reference, note=notes[start])


def replay_from_trace(trace_dir: str | os.PathLike, request: ReplayRequest, progress=None) -> ReplayRun:
    """Replay steps ``N..M`` of ``trace_dir`` from checkpoint ``N`` and decide on what differs.

    Args:
        trace_dir: the trace directory.
        request: the window and replay settings.
        progress: ``bisect.Progress`` (``window`` then ``step`` per replayed step), or None.

    Raises:
        Everything :func:`check_window` raises; CheckpointError: checkpoint ``N``'s file is not
        found or is not the state the replicas agreed on; RecipeError: the recipe cannot be loaded.
    """
    window = check_window(trace_dir, request)
    from sdc_forensics.errors import CheckpointError
    from sdc_forensics.decide import decision
    from sdc_forensics.forensics.files import checkpoint_file
    from sdc_forensics.replay import preflight
    from sdc_forensics.replay.replayer import ReplayOptions
    from sdc_forensics.replay.window import replay_window
    from sdc_forensics.replay.env import resolve_device
    from sdc_forensics.recipe import load_trace_recipe

    trace, note, start = window.trace, window.note, request.start_step
    # an unknown or absent device: a usage error before the recipe is loaded
    resolve_device(request.options.device)
    path = checkpoint_file(note, trace.path, request.options)
    if path is None:
        raise CheckpointError(
            f"checkpoint file of step {start} ({Path(note.path).name}) not found: pass --checkpoints DIR"
        )
    chosen = request.options
    options = ReplayOptions.of(
        chosen,
        start_step=start,
        stop_step=request.stop_step,
        checkpoint_path=path,
        expected_weights_digest=note.weights_digest,
    )
    # with the job settings the manifest recorded
    recipe = load_trace_recipe(trace.manifest, chosen.recipe)
    flight = preflight.check(
        trace.manifest,
        device=chosen.device,
        num_threads=chosen.num_threads,
        collective=chosen.collective,
        force_tolerant=chosen.force_tolerant,
    )
    if progress is not None:
        for line in flight.lines() if hasattr(progress, "note") else ():
            progress.note(line)
        progress.window(start, request.stop_step, "requested")
    result = replay_window(trace, recipe, options, progress.step if progress is not None else None)
    decided = decision.decide(
        result.evidence,
        world_size=trace.world_size,
        identity=trace.manifest.identity,
        notes=(),
        files={},
        majority={},
        examined=decision.Examined(
            first_step=start, anchors=frozenset({start}), replayed=frozenset(range(start, result.last_step + 1))
        ),
    )
    return ReplayRun(result=result, decision=decided, preflight=flight)
