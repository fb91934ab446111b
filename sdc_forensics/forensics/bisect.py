"""Bisect: the whole flow from a trace directory to a verdict.

1. Triage the trace (free, numpy only): every piece of evidence it holds and the window a replay
   must examine.
2. Verify the noted checkpoint files against their notes (``forensics/files.py``: a damaged file
   is storage evidence and is never replayed from).
3. Replay, each checkpoint interval from its own checkpoint: first the interval that can confirm
   the trace's evidence (or, with none, the last one), then backwards one interval at a time down
   to the first step, so that every step before a checkpoint is examined before it is called
   clean. A strong divergence ends the search at it (only earlier intervals are still replayed);
   weak evidence (a tolerant residual) never ends it. A checkpoint that does not hold the
   replicas' weights is skipped for the one before. The walk (:func:`_walk`) only picks the next
   interval; the interval runner (``forensics/intervals.py``) replays it, or takes it from the
   ledger when the ledger covers it, and never calls back here.
4. Decide with ``decide.decision``: the first divergent step, the suspects, the verdict and
   every checkpoint's status with the last clean one. ``certify``, ``verify-checkpoint --trace``,
   ``replay`` and ``report`` go through the same function.

``trace_only`` stops after step 1 (and reads checkpoint notes, not files) and never imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Protocol

from sdc_forensics.decide import decision
from sdc_forensics.decide.decision import CheckpointFile, Examined
from sdc_forensics.decide.verdict import BisectResult, ReplaySummary
from sdc_forensics.evidence import sort_key
from sdc_forensics.forensics.files import checkpoint_file, replayable, storage_evidence, verify_files
from sdc_forensics.forensics.intervals import IntervalRunner, interval_runner, open_ledger, suspect_gpus
from sdc_forensics.replay import preflight
from sdc_forensics.replay.options import AnalysisOptions, BisectOptions
from sdc_forensics.trace.checkpoints import CheckpointNote, superseded_by, unreplayable_steps, unreplayable_text
from sdc_forensics.trace.consensus import majority_weights_digests
from sdc_forensics.trace.manifest import audit_reach
from sdc_forensics.trace.reader import UNTRUSTED_DAMAGE, Trace
from sdc_forensics.triage.trace_only import TriageResult, triage_trace

# BisectOptions: the options' old name, still read here (replay.options)
__all__ = ["AnalysisOptions", "BisectOptions", "Progress", "bisect"]


class Progress(Protocol):
    """Progress of long replays (the CLI draws bars on stderr)."""

    def window(self, start: int, stop: int, reason: str) -> None: ...

    def step(self, step: int) -> None: ...

    def note(self, text: str) -> None:
        """Say something people should know before the replay (optional: looked up with ``hasattr``)."""


def bisect(
    trace_dir: Trace | str | os.PathLike, options: AnalysisOptions, progress: Progress | None = None
) -> BisectResult:
    """Find the first divergent step, the suspects and the last clean checkpoint.

    Raises:
        TraceError: the trace is unreadable. RecipeError: the recipe cannot be loaded.
        UsageError: the replay device is unavailable or a suspect's GPU (not forced).
    """
    # a command that opened it already hands it down
    trace = Trace.of(trace_dir)
    tri = triage_trace(trace)
    notes = trace.checkpoint_notes()
    # checkpoints an earlier attempt saved after a later one's resume point: off the latest lineage
    owners = {
        n.step: (n.attempt, later) for n in notes if (later := superseded_by(n, trace.manifest.attempts)) is not None
    }
    evidence = list(tri.evidence)
    settle: list[str] = []
    notes_out: list[str] = []
    flight = None
    gap = unreplayable_steps(tri.step_range[0] if tri.step_range else None, [n.step for n in notes])
    # said up front, not only as an exit 4 after a replay that cannot help
    if gap is not None:
        notes_out.append(unreplayable_text(gap))
        if progress is not None and hasattr(progress, "note"):
            progress.note(unreplayable_text(gap))
    summary = ReplaySummary()
    files: dict[int, CheckpointFile] = {}
    mode = "trace-only"
    replayed: set[int] = set()
    tolerant: set[int] = set()
    reused: tuple = ()
    seed = int(trace.manifest.fingerprint.seed)
    recipe_ref = None
    if options.trace_only:
        settle.append(
            "replay with the job's recipe and checkpoints (without --trace-only) to certify checkpoints and find "
            "faults the trace cannot see"
        )
    else:
        recipe_ref = options.recipe or trace.manifest.recipe
        if not recipe_ref:
            settle.append("the trace names no replay recipe: pass --recipe MODULE:ATTR (docs/recipes.md)")
        if not notes:
            settle.append("the trace notes no checkpoint: replay needs one; pass a trace whose run saved checkpoints")
        if notes:
            files = verify_files(notes, options, trace.path, seed)
            evidence += storage_evidence(notes, files, sharded=trace.manifest.parallel is not None)
        from sdc_forensics.replay.env import resolve_device

        # an unknown or absent device is a usage error before anything is said or done
        resolve_device(options.device)
        flight = preflight.check(
            trace.manifest,
            device=options.device,
            num_threads=options.num_threads,
            collective=options.collective,
            force_tolerant=options.force_tolerant,
        )
        if progress is not None and hasattr(progress, "note"):
            # before any replay: a run that cannot certify says so first
            for line in flight.lines():
                progress.note(line)
        if recipe_ref and notes:
            # the latest lineage replays from its own checkpoints only
            usable = [n for n in notes if replayable(files[n.step]) and n.step not in owners]
            # a checkpoint whose file is gone (a checkpoint limit rotated it away) still starts the interval
            # an exact record of the ledger covers, replayed while the file was there
            gone = [n for n in notes if not files[n.step].path and n.step not in owners]
            ledger = open_ledger(trace, notes, options, say=getattr(progress, "note", None)) if usable or gone else None
            from_ledger_only = _covered_by_ledger(gone, notes, tri, ledger)
            if not usable and not from_ledger_only:
                settle.append("no checkpoint file was found intact: pass --checkpoints DIR")
            else:
                mode = "replay"
                # loads the recipe
                runner = interval_runner(trace, options, progress, ledger, triage=tri)
                summary = _walk(tri, usable, options, runner, from_ledger_only)
                from sdc_forensics.replay.buffers import unconfirmed

                evidence += unconfirmed(runner.evidence, runner.notes)
                replayed, tolerant = runner.replayed, runner.tolerant
                reused = summary.ledger.reused if summary.ledger is not None else ()
    evidence.sort(key=sort_key)
    first_step = tri.step_range[0] if tri.step_range else 0
    # steps the ledger certifies count as examined exactly, as if replayed now (ledger.reuse: a chain of exact clean records)
    from_ledger = {s for w in reused for s in range(w.start, w.last + 1)}
    examined = Examined(
        first_step=first_step,
        replayed=frozenset(replayed | from_ledger),
        tolerant_steps=frozenset(tolerant),
        trace_consistent=not any(d.kind in UNTRUSTED_DAMAGE for d in tri.damage),
        files_read=bool(files),
        trace_only=options.trace_only,
        anchors=frozenset(w.start for w in summary.windows) | frozenset(w.start for w in reused),
    )
    # not read, but named: every checkpoint row has its path
    if options.trace_only:
        files = {n.step: CheckpointFile(path=str(checkpoint_file(n, trace.path, options) or n.path)) for n in notes}
    # (a checkpoint off the latest lineage holds its own attempt's weights, not the latest records')
    majority = majority_weights_digests(trace, [n.step for n in notes if n.step not in owners]) if notes else {}
    decided = decision.decide(
        evidence,
        world_size=trace.world_size,
        identity=trace.manifest.identity,
        notes=notes,
        files=files,
        majority=majority,
        examined=examined,
        sharded=trace.manifest.parallel is not None,
    )
    # a resumed run: every attempt is judged, not only the latest lineage
    if len(trace.manifest.attempts) > 1:
        earlier = _earlier_attempts(
            trace, options, progress, (recipe_ref if mode == "replay" else None), files, notes_out
        )
        decided = decision.with_earlier_attempts(
            decided,
            earlier,
            owners,
            notes=notes,
            files=files,
            examined=examined,
            sharded=trace.manifest.parallel is not None,
        )
    scope = _scope(tri, summary)
    if decided.verdict is decision.Verdict.CLEAN and mode == "trace-only":
        scope += " (trace-only: a wrong finite local gradient on a step without an audit would not show)"
    if tri.superseded_cells:
        notes_out.append(
            f"{tri.superseded_cells} (step, rank) records were re-executed by a later attempt; the latest attempt is used"
        )
    settle = list(decided.settle) + settle
    if flight is not None and not flight.exact and mode == "replay" and replayed:
        settle.append(f"this replay could not be exact ({flight.blockers[0]}): {flight.fix}")
    unused = _options_not_exercised(options) if mode == "replay" and reused and not replayed else ""
    if unused:
        notes_out.append(
            f"every step examined came from the ledger's earlier exact replays, so {unused} changed nothing: "
            "pass --no-ledger to replay with it"
        )
    reach = audit_reach(trace.manifest.node_of_rank)
    if reach is not None and any(
        "audit" in line
        for line in decided.settle
        # advice this job's audits could not follow
    ):
        settle.append(f"audits cannot settle it in this job: {reach}")
    if mode == "replay":
        unexamined = [
            c.step
            for c in decided.checkpoints
            if c.status is decision.Status.UNVERIFIED and examined.unexamined_before(c.step)
        ]
        if unexamined and gap is not None:
            settle.append(unreplayable_text(gap))
        elif unexamined:
            limit = " (without --max-replay-steps)" if options.max_replay_steps is not None else ""
            settle.append(
                f"checkpoint(s) {', '.join(map(str, unexamined))} stay unverified: replay every step before them{limit} "
                "to certify them" + ("" if limit else " (the notes say what stopped the replay)")
            )
    numpy_only = [] if options.trace_only else _numpy_only(decided.checkpoints)
    if numpy_only:
        # (the Trainer's rng_state.pth): one line, not one per file in the table
        settle.append(
            f"checkpoint(s) {', '.join(map(str, numpy_only))} hold numpy arrays the reader does not load unless "
            "asked (a Trainer's rng_state.pth): pass --allow-numpy to read and certify them"
        )
    suspects = decided.suspects
    mesh = trace.manifest.parallel
    # a sharded job: where in the mesh each suspect sits
    if mesh is not None:
        suspects = tuple(
            dataclasses.replace(s, mesh=mesh.coordinates(s.rank)) if s.rank is not None else s for s in suspects
        )
    return BisectResult(
        verdict=decided.verdict,
        first_divergent_step=decided.first_divergent_step,
        suspects=suspects,
        last_clean_checkpoint=decided.last_clean,
        checkpoints=decided.checkpoints,
        replayed=summary,
        evidence=decided.evidence,
        mode=mode,
        scope=scope,
        settle=tuple(settle),
        trace_path=str(trace.path),
        world_size=trace.world_size,
        step_range=tri.step_range,
        damage=tuple(d.detail or d.kind for d in tri.damage),
        notes=tuple(notes_out),
        divergence_window=decided.divergence_window,
        seed=seed,
        preflight=flight,
    )


def _numpy_only(statuses) -> list[int]:
    """Checkpoints unverified because a file of theirs holds numpy arrays (refused without --allow-numpy)."""
    # (torch_reader imports torch: only called once checkpoint files were read, never under --trace-only)
    from sdc_forensics.checkpoint.torch_reader import NUMPY_HINT

    return [
        c.step
        for c in statuses
        if c.status is decision.Status.UNVERIFIED and any(f"pass {NUMPY_HINT}" in r for r in c.reasons)
    ]


def _options_not_exercised(options: AnalysisOptions) -> str:
    """The replay options a run given them did not use (every step taken from the ledger), as words."""
    given = [
        f"--recipe {options.recipe}" if options.recipe else "",
        f"--threads {options.num_threads}" if options.num_threads else "",
        f"--device {options.device}" if options.device != "cpu" else "",
        "--tolerant" if options.force_tolerant else "",
    ]
    return ", ".join(g for g in given if g)


def _earlier_attempts(
    trace: Trace,
    options: AnalysisOptions,
    progress,
    recipe_ref: str | None,
    files: dict[int, CheckpointFile],
    notes_out: list[str],
) -> list[decision.EarlierAttempt]:
    """Each earlier attempt of a resumed run, judged on its own records of the steps a later attempt re-executed.

    The latest lineage (every step's latest record) hides them: a fault that made the job stop, and the resume from
    a checkpoint before it, would otherwise leave no trace in the answer, and its GPU would go back into service. Each
    attempt is read as it stood (``Trace.as_of``): its trace evidence over those steps, and, with a recipe, a replay
    of them from its last checkpoint at or before the resume step, compared with its own records.
    """
    attempts = sorted(trace.manifest.attempts, key=lambda a: a.attempt)
    seed = int(trace.manifest.fingerprint.seed)
    recipe = None
    latest_attempt = {n.step: n.attempt for n in trace.checkpoint_notes()}
    out: list[decision.EarlierAttempt] = []
    for past, later in zip(attempts, attempts[1:]):
        own = trace.step_range(attempt=past.attempt)
        lo, hi = later.start_step, (own[1] if own is not None else -1)
        if hi < lo:
            # it stopped before the step the next attempt resumed from: nothing of it was re-executed
            continue
        view = trace.as_of(past.attempt)
        tri = triage_trace(view)
        evidence = [e for e in tri.evidence if lo <= e.step <= hi]
        replayed, tolerant, anchors = set(), set(), set()
        if recipe_ref is not None:
            if recipe is None:
                from sdc_forensics.recipe import load_recipe

                recipe = load_recipe(recipe_ref, args=trace.manifest.recipe_args)
            # the ledger as this attempt left it: an exact record of its steps made while its checkpoint existed
            # (a follower's) still judges them once a checkpoint limit rotated the file away; read, never extended
            ledger = None
            for note in sorted(
                (n for n in view.checkpoint_notes() if n.step <= lo), key=lambda n: n.step, reverse=True
            ):
                # the file the latest lineage verified, when its note is this attempt's too; else this note's own
                known = files.get(note.step) if latest_attempt.get(note.step) == note.attempt else None
                file = known if known is not None else verify_files([note], options, trace.path, seed)[note.step]
                if not replayable(file):
                    if not file.path:
                        ledger = ledger or open_ledger(view, view.checkpoint_notes(), options)
                        covering = ledger.covering(note.step, hi) if ledger is not None else ()
                        if covering:
                            replayed, anchors = set(range(note.step, hi + 1)), {note.step}
                            notes_out.append(
                                f"attempt {past.attempt}'s steps {note.step}..{hi}: from the ledger (record "
                                f"{', '.join(covering)}), replayed exactly and clean while checkpoint {note.step}'s file existed"
                            )
                            break
                    continue
                runner = IntervalRunner(view, recipe, options, progress, suspect_gpus(view, tri))
                reason = f"judge attempt {past.attempt}'s steps {lo}..{hi}, re-executed by attempt {later.attempt}"
                if runner.replay(note, hi, reason) is None:
                    # it does not hold the replicas' weights: the one before
                    continue
                evidence += [e for e in runner.evidence if lo <= e.step <= hi]
                replayed, tolerant, anchors = runner.replayed, runner.tolerant, {note.step}
                break
        examined = Examined(
            first_step=lo,
            replayed=frozenset(s for s in replayed if s >= lo),
            tolerant_steps=frozenset(tolerant),
            files_read=bool(replayed),
            trace_only=recipe_ref is None,
            anchors=frozenset(anchors),
        )
        decided = decision.decide(
            evidence,
            world_size=view.world_size,
            identity=view.manifest.identity,
            notes=(),
            files={},
            majority={},
            examined=examined,
            sharded=view.manifest.parallel is not None,
        )
        how = "replayed and compared with its own records" if replayed else "checked in the trace"
        notes_out.append(
            f"attempt {past.attempt}'s steps {lo}..{hi}, re-executed by attempt {later.attempt}, were {how}: "
            f"{decided.verdict.value}"
        )
        notes_out += _superseded_files(view, past.attempt, decided.first_divergent_step, latest_attempt)
        out.append(
            decision.EarlierAttempt(
                attempt=past.attempt,
                resumed_by=later.attempt,
                steps=(lo, hi),
                decision=decided,
                examined=examined if replayed else None,
            )
        )
    return out


def _superseded_files(view: Trace, attempt: int, first: int | None, latest_attempt: dict[int, int]) -> list[str]:
    """One line per checkpoint file ``attempt`` saved after its first divergent step ``first`` that a
    later attempt saved again under another name: the checkpoint table lists the later file only, and
    a trial user's cleanup script could not tell that the earlier one holds the fault's state."""
    if first is None:
        return []
    return [
        f"attempt {attempt}'s checkpoint {n.step} ({Path(n.path).name}), saved again by attempt "
        f"{latest_attempt[n.step]}, holds attempt {attempt}'s state after its divergence at step {first}: tainted, "
        "do not resume from it"
        for n in view.checkpoint_notes()
        if n.attempt == attempt and n.step > first and latest_attempt.get(n.step, attempt) != attempt
    ]


def _scope(tri: TriageResult, summary: ReplaySummary) -> str:
    steps = f"steps {tri.step_range[0]}..{tri.step_range[1]}" if tri.step_range else "no steps"
    scope = f"trace checks over {steps}"
    windows = sorted(summary.windows, key=lambda w: w.start)
    # a window that stopped before its first step replayed nothing
    done = [w for w in windows if w.last >= w.start]
    reused = sorted(summary.ledger.reused, key=lambda w: w.start) if summary.ledger is not None else []
    if reused:
        scope += (
            "; from the ledger steps "
            + ", ".join(f"{w.start}..{w.last}" for w in reused)
            + " (exact, replayed earlier)"
        )
    if done:
        spans = ", ".join(f"{w.start}..{w.last}" if w.last > w.start else str(w.start) for w in done)
        scope += f"; replayed step{'s' if len(done) > 1 or done[0].last > done[0].start else ''} {spans} ({summary.comparison}) on {summary.device}"
    else:
        scope += "; nothing replayed" + (" now" if reused else "")
    empty = [w.start for w in windows if w.last < w.start]
    if empty:
        scope += f"; nothing replayable from checkpoint{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} (see the notes)"
    return scope


def _covered_by_ledger(
    gone: list[CheckpointNote], notes: list[CheckpointNote], tri: TriageResult, ledger
) -> list[CheckpointNote]:
    """The checkpoints of ``gone`` (no file found) whose whole interval, up to the next checkpoint or
    the trace's last step, an exact clean record of ``ledger`` covers: the walk takes those intervals
    from the ledger and never replays from them."""
    if ledger is None or not gone:
        return []
    steps = sorted(n.step for n in notes)
    last_step = tri.step_range[1] if tri.step_range else -1
    out = []
    for note in gone:
        later = [s for s in steps if s > note.step]
        hi = later[0] - 1 if later else last_step
        if hi >= note.step and ledger.covering(note.step, hi):
            out.append(note)
    return out


def _walk(
    tri: TriageResult,
    usable: list[CheckpointNote],
    options: AnalysisOptions,
    runner: IntervalRunner,
    from_ledger_only: list[CheckpointNote] = (),
) -> ReplaySummary:
    """The backward walk: hand ``runner`` the intervals that decide the run, one at a time, from the
    one that can confirm the trace's evidence (or the last) down to the first step; the runner takes
    from the ledger what it covers and replays the rest. What it found stays on the runner.

    ``from_ledger_only``: checkpoints whose file is gone but whose interval the ledger covers; an
    interval that starts at one of them and that the ledger does not cover (the walk asks for other
    steps) is left to the checkpoint before it."""
    gone = {n.step for n in from_ledger_only}
    starts = sorted([*usable, *from_ledger_only], key=lambda n: n.step)
    first_step, last_step = tri.step_range if tri.step_range else (0, -1)
    if tri.suspect_window is not None:
        hi = tri.suspect_window[1]
        reason = f"confirm the trace's evidence at step {hi}"
    else:
        hi = last_step
        reason = "no trace evidence: replay the last checkpoint interval, then widen backwards"
    hint = runner.ledger_evidence()
    if hint is not None and first_step <= hint[0] < hi:
        # an earlier exact replay (a follower's) found strong evidence there: replay it again (the evidence a verdict rests
        # on is this run's) before the steps after it, which a confirmed divergence taints whatever they hold
        hi, reason = hint[0], f"confirm the ledger's evidence at step {hint[0]} (record {hint[1]})"
    found: int | None = None
    for note in reversed(starts):
        if note.step > hi:
            continue
        if (
            options.max_replay_steps is not None
            and runner.replayed_steps >= options.max_replay_steps
            and not runner.covered(note.step, hi)
            # the limit is on replays, not on reuse
        ):
            # earlier intervals may still come from the ledger
            if runner.ledger_certifies_before(note.step):
                runner.notes.append(
                    f"steps {note.step}..{hi} not replayed (--max-replay-steps reached); earlier intervals "
                    "the ledger covers are still taken from it"
                )
                hi = note.step - 1
                if hi < first_step:
                    break
                continue
            runner.notes.append(
                f"stopped widening after {runner.replayed_steps} replayed steps (--max-replay-steps): "
                f"steps {first_step}..{hi} not replayed"
            )
            break
        if note.step in gone and not runner.covered(note.step, hi):
            runner.notes.append(
                f"checkpoint {note.step}'s file was not found and the ledger does not cover steps {note.step}..{hi}: "
                "replaying them from the checkpoint before"
            )
            continue
        result = runner.replay(note, hi, reason)
        if result is None:
            # it does not hold the replicas' weights: the checkpoint before covers its interval
            continue
        if result.first_divergent_step is not None:
            found = result.first_divergent_step if found is None else min(found, result.first_divergent_step)
        hi = note.step - 1
        reason = "widen backwards: every step before a checkpoint is examined before it is certified"
        if hi < first_step:
            break
        runner.share(_intervals_below(starts, note, runner.budget_left(), first_step))
    else:
        if hi >= first_step and starts and runner.windows:
            runner.notes.append(f"no usable checkpoint at or before step {hi}: steps {first_step}..{hi} not replayed")
    if options.scan_recurrence and found is not None:
        _scan_after(runner, starts, found, last_step)
    return runner.summary()


def _intervals_below(
    starts: list[CheckpointNote], note: CheckpointNote, budget: int | None, first_step: int = 0
) -> list[tuple[CheckpointNote, int]]:
    """The intervals the backward walk replays after ``note``'s, in its order (``(checkpoint, last
    step)``), as far as ``budget`` steps reach (None: all) and down to the trace's ``first_step``;
    a checkpoint found not to hold the replicas' weights changes the walk, which then replays
    what it needs itself."""
    out: list[tuple[CheckpointNote, int]] = []
    hi = note.step - 1
    for below in reversed([n for n in starts if n.step < note.step]):
        if (budget is not None and budget <= 0) or hi < first_step:
            break
        out.append((below, hi))
        if budget is not None:
            budget -= hi - below.step + 1
        hi = below.step - 1
    return out


def _scan_after(runner: IntervalRunner, starts: list[CheckpointNote], found: int, last_step: int) -> None:
    """Replay the intervals after the first divergence, each up to its own first divergence:
    recurrences. An interval whose checkpoint was saved while a replica still diverged is skipped
    (that replica would mismatch at every step: the same event, not a recurrence)."""
    # None: not scanned (its note goes in its place)
    plan: list[tuple[CheckpointNote, int | None]] = []
    for index, note in enumerate(starts):
        if note.step <= found:
            continue
        hi = starts[index + 1].step - 1 if index + 1 < len(starts) else last_step
        if note.diverged_ranks or hi >= note.step:
            plan.append((note, None if note.diverged_ranks else hi))
    runner.share([(note, hi) for note, hi in plan if hi is not None])
    for note, hi in plan:
        if hi is None:
            runner.notes.append(
                f"scan: checkpoint {note.step} was saved while rank(s) {', '.join(map(str, note.diverged_ranks))} "
                "still diverged; its interval is not scanned"
            )
        else:
            runner.replay(note, hi, "scan of the intervals after the first divergence (--scan-recurrence)")
