"""Bisect: the whole flow from a trace directory to a verdict.

1. Triage the trace (free, numpy only): every piece of evidence it holds and the window a replay
   must examine.
2. Verify the noted checkpoint files against their notes (a damaged file is storage evidence and
   is never replayed from).
3. Replay, each checkpoint interval from its own checkpoint: first the interval that can confirm
   the trace's evidence (or, with none, the last one), then backwards one interval at a time down
   to the first step, so that every step before a checkpoint is examined before it is called
   clean. A strong divergence ends the search at it (only earlier intervals are still replayed);
   weak evidence (a tolerant residual) never ends it. A checkpoint that does not hold the
   replicas' weights is skipped for the one before.
4. Decide with ``decide.decision``: the first divergent step, the suspects, the verdict and
   every checkpoint's status with the last clean one. ``certify``, ``verify-checkpoint --trace``,
   ``replay`` and ``report`` go through the same function.

``trace_only`` stops after step 1 (and reads checkpoint notes, not files) and never imports torch.

Over 400 lines on purpose: the flow of one command, stage by stage (triage, replay windows, decide),
read top to bottom; the stages are their own packages.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Protocol

from sdc_forensics.checkpoint.findings import FindingKind
from sdc_forensics.decide import decision
from sdc_forensics.replay import preflight
from sdc_forensics.decide.decision import CheckpointFile, Examined
from sdc_forensics.triage.evidence import Evidence, EvidenceKind, Location, sort_key
from sdc_forensics.replay.options import AnalysisOptions, BisectOptions
from sdc_forensics.triage.trace_only import TriageResult, triage_trace
from sdc_forensics.decide.verdict import BisectResult, ReplayedWindow, ReplaySummary
from sdc_forensics.trace.checkpoints import CheckpointNote, unreplayable_steps, unreplayable_text
from sdc_forensics.trace.consensus import majority_weights_digests
from sdc_forensics.trace.manifest import audit_reach
from sdc_forensics.trace.reader import UNTRUSTED_DAMAGE, Trace

# BisectOptions: the options' old name, still read here (replay.options)
__all__ = ["AnalysisOptions", "BisectOptions", "Progress", "bisect"]

# the file differs from what was saved (storage), or holds NaN/Inf or not-the-majority content
# (saved that way: a consequence of a divergence): never replayed from
_NOT_A_START = decision.STORAGE_FINDINGS | decision.STATE_FINDINGS


class Progress(Protocol):
    """Progress of long replays (the CLI draws bars on stderr)."""

    def window(self, start: int, stop: int, reason: str) -> None: ...

    def step(self, step: int) -> None: ...

    def note(self, text: str) -> None:
        """Say something people should know before the replay (optional: looked up with ``hasattr``)."""


def bisect(trace_dir: Trace | str | os.PathLike, options: AnalysisOptions, progress: Progress | None = None) -> BisectResult:
    """Find the first divergent step, the suspects and the last clean checkpoint.

    Raises:
        TraceError: the trace is unreadable. RecipeError: the recipe cannot be loaded.
        UsageError: the replay device is unavailable or a suspect's GPU (not forced).
    """
    trace = Trace.of(trace_dir)  # a command that opened it already hands it down
    tri = triage_trace(trace)
    notes = trace.checkpoint_notes()
    evidence = list(tri.evidence)
    settle: list[str] = []
    notes_out: list[str] = []
    flight = None
    gap = unreplayable_steps(tri.step_range[0] if tri.step_range else None, [n.step for n in notes])
    if gap is not None:  # said up front, not only as an exit 4 after a replay that cannot help
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
        settle.append("replay with the job's recipe and checkpoints (without --trace-only) to certify checkpoints and find "
                      "faults the trace cannot see")
    else:
        recipe_ref = options.recipe or trace.manifest.recipe
        if not recipe_ref:
            settle.append("the trace names no replay recipe: pass --recipe MODULE:ATTR (docs/recipes.md)")
        if not notes:
            settle.append("the trace notes no checkpoint: replay needs one; pass a trace whose run saved checkpoints")
        if notes:
            files = _verify_files(notes, options, trace.path, seed)
            evidence += _storage_evidence(notes, files, sharded=trace.manifest.parallel is not None)
        from sdc_forensics.replay.env import resolve_device

        resolve_device(options.device)  # an unknown or absent device is a usage error before anything is said or done
        flight = preflight.check(trace.manifest, device=options.device, num_threads=options.num_threads, collective=options.collective,
                                 force_tolerant=options.force_tolerant)
        if progress is not None and hasattr(progress, "note"):
            for line in flight.lines():  # before any replay: a run that cannot certify says so first
                progress.note(line)
        if recipe_ref and notes:
            usable = [n for n in notes if files[n.step].report is not None and not _damaged(files[n.step].report)]
            if not usable:
                settle.append("no checkpoint file was found intact: pass --checkpoints DIR")
            else:
                mode = "replay"
                from sdc_forensics.forensics.ledger_use import LedgerUse

                ledger = LedgerUse.open(trace, notes, options, say=getattr(progress, "note", None))
                summary, replay_evidence, replayed, tolerant = _replay(trace, tri, usable, recipe_ref, options, progress, ledger)
                evidence += replay_evidence
                reused = summary.ledger.reused if summary.ledger is not None else ()
    evidence.sort(key=sort_key)
    first_step = tri.step_range[0] if tri.step_range else 0
    # steps the ledger certifies count as examined exactly, as if replayed now (ledger.reuse: a chain of exact clean records)
    from_ledger = {s for w in reused for s in range(w.start, w.last + 1)}
    examined = Examined(first_step=first_step, replayed=frozenset(replayed | from_ledger), tolerant_steps=frozenset(tolerant),
                        trace_consistent=not any(d.kind in UNTRUSTED_DAMAGE for d in tri.damage),
                        files_read=bool(files), trace_only=options.trace_only,
                        anchors=frozenset(w.start for w in summary.windows) | frozenset(w.start for w in reused))
    if options.trace_only:  # not read, but named: every checkpoint row has its path
        files = {n.step: CheckpointFile(path=_where(n, options, trace.path)) for n in notes}
    majority = majority_weights_digests(trace, [n.step for n in notes]) if notes else {}
    decided = decision.decide(evidence, world_size=trace.world_size, identity=trace.manifest.identity, notes=notes,
                              files=files, majority=majority, examined=examined, sharded=trace.manifest.parallel is not None)
    if len(trace.manifest.attempts) > 1:  # a resumed run: every attempt is judged, not only the latest lineage
        earlier = _earlier_attempts(trace, options, progress, (recipe_ref if mode == "replay" else None), files, notes_out)
        decided = decision.with_earlier_attempts(decided, earlier)
    scope = _scope(tri, summary)
    if decided.verdict is decision.Verdict.CLEAN and mode == "trace-only":
        scope += " (trace-only: a wrong finite local gradient on a step without an audit would not show)"
    if tri.superseded_cells:
        notes_out.append(f"{tri.superseded_cells} (step, rank) records were re-executed by a later attempt; the latest attempt is used")
    settle = list(decided.settle) + settle
    if flight is not None and not flight.exact and mode == "replay":
        settle.append(f"this replay could not be exact ({flight.blockers[0]}): {flight.fix}")
    reach = audit_reach(trace.manifest.node_of_rank)
    if reach is not None and any("audit" in line for line in decided.settle):  # advice this job's audits could not follow
        settle.append(f"audits cannot settle it in this job: {reach}")
    if mode == "replay":
        unexamined = [c.step for c in decided.checkpoints
                      if c.status is decision.Status.UNVERIFIED and examined.unexamined_before(c.step)]
        if unexamined and gap is not None:
            settle.append(unreplayable_text(gap))
        elif unexamined:
            limit = " (without --max-replay-steps)" if options.max_replay_steps is not None else ""
            settle.append(f"checkpoint(s) {', '.join(map(str, unexamined))} stay unverified: replay every step before them{limit} "
                          "to certify them" + ("" if limit else " (the notes say what stopped the replay)"))
    suspects = decided.suspects
    mesh = trace.manifest.parallel
    if mesh is not None:  # a sharded job: where in the mesh each suspect sits
        suspects = tuple(dataclasses.replace(s, mesh=mesh.coordinates(s.rank)) if s.rank is not None else s for s in suspects)
    return BisectResult(
        verdict=decided.verdict, first_divergent_step=decided.first_divergent_step, suspects=suspects,
        last_clean_checkpoint=decided.last_clean, checkpoints=decided.checkpoints,
        replayed=summary, evidence=decided.evidence, mode=mode, scope=scope, settle=tuple(settle),
        trace_path=str(trace.path), world_size=trace.world_size, step_range=tri.step_range,
        damage=tuple(d.detail or d.kind for d in tri.damage), notes=tuple(notes_out),
        divergence_window=decided.divergence_window, seed=seed, preflight=flight,
    )


def _earlier_attempts(trace: Trace, options: AnalysisOptions, progress, recipe_ref: str | None,
                      files: dict[int, CheckpointFile], notes_out: list[str]) -> list[decision.EarlierAttempt]:
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
            continue  # it stopped before the step the next attempt resumed from: nothing of it was re-executed
        view = trace.as_of(past.attempt)
        tri = triage_trace(view)
        evidence = [e for e in tri.evidence if lo <= e.step <= hi]
        replayed, tolerant, anchors = set(), set(), set()
        if recipe_ref is not None:
            if recipe is None:
                from sdc_forensics.recipe import load_recipe

                recipe = load_recipe(recipe_ref, args=trace.manifest.recipe_args)
            for note in sorted((n for n in view.checkpoint_notes() if n.step <= lo), key=lambda n: n.step, reverse=True):
                # the file the latest lineage verified, when its note is this attempt's too; else this note's own
                known = files.get(note.step) if latest_attempt.get(note.step) == note.attempt else None
                file = known if known is not None else _verify_files([note], options, trace.path, seed)[note.step]
                if file.report is None or _damaged(file.report):
                    continue
                runner = _WindowRunner(view, recipe, options, progress, _suspect_gpus(view, tri))
                reason = f"judge attempt {past.attempt}'s steps {lo}..{hi}, re-executed by attempt {later.attempt}"
                if runner.replay(note, hi, reason) is None:
                    continue  # it does not hold the replicas' weights: the one before
                evidence += [e for e in runner.evidence if lo <= e.step <= hi]
                replayed, tolerant, anchors = runner.replayed, runner.tolerant, {note.step}
                break
        examined = Examined(first_step=lo, replayed=frozenset(s for s in replayed if s >= lo), tolerant_steps=frozenset(tolerant),
                            files_read=bool(replayed), trace_only=recipe_ref is None, anchors=frozenset(anchors))
        decided = decision.decide(evidence, world_size=view.world_size, identity=view.manifest.identity, notes=(), files={},
                                  majority={}, examined=examined, sharded=view.manifest.parallel is not None)
        how = "replayed and compared with its own records" if replayed else "checked in the trace"
        notes_out.append(f"attempt {past.attempt}'s steps {lo}..{hi}, re-executed by attempt {later.attempt}, were {how}: "
                         f"{decided.verdict.value}")
        out.append(decision.EarlierAttempt(attempt=past.attempt, resumed_by=later.attempt, steps=(lo, hi), decision=decided))
    return out


def _scope(tri: TriageResult, summary: ReplaySummary) -> str:
    steps = f"steps {tri.step_range[0]}..{tri.step_range[1]}" if tri.step_range else "no steps"
    scope = f"trace checks over {steps}"
    windows = sorted(summary.windows, key=lambda w: w.start)
    done = [w for w in windows if w.last >= w.start]  # a window that stopped before its first step replayed nothing
    reused = sorted(summary.ledger.reused, key=lambda w: w.start) if summary.ledger is not None else []
    if reused:
        scope += "; from the ledger steps " + ", ".join(f"{w.start}..{w.last}" for w in reused) + " (exact, replayed earlier)"
    if done:
        spans = ", ".join(f"{w.start}..{w.last}" if w.last > w.start else str(w.start) for w in done)
        scope += f"; replayed step{'s' if len(done) > 1 or done[0].last > done[0].start else ''} {spans} ({summary.comparison}) on {summary.device}"
    else:
        scope += "; nothing replayed" + (" now" if reused else "")
    empty = [w.start for w in windows if w.last < w.start]
    if empty:
        scope += f"; nothing replayable from checkpoint{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} (see the notes)"
    return scope


def _verify_files(notes: list[CheckpointNote], options: AnalysisOptions, trace_path: Path, seed: int) -> dict[int, CheckpointFile]:
    """``{N: CheckpointFile}`` for every noted checkpoint, digested with the trace's seed."""
    from sdc_forensics.checkpoint.locate import locate_checkpoint
    from sdc_forensics.checkpoint.verify import VerifyOptions, verify_checkpoint
    from sdc_forensics.errors import CheckpointError

    out = {}
    for note in notes:
        path = options.checkpoint_paths.get(note.step) or locate_checkpoint(note, options.checkpoints_dir, trace_path)
        report, error = None, ""
        if path is not None:
            try:
                report = verify_checkpoint(path, note=note, options=VerifyOptions(seed=seed))
            except CheckpointError as exc:
                error = str(exc)
        out[note.step] = CheckpointFile(path=str(path) if path else "", report=report, error=error)
    return out


def _where(note: CheckpointNote, options: AnalysisOptions, trace_path: Path) -> str:
    """The file checkpoint ``note`` names, found as replay would find it (nothing is read), else the noted path."""
    from sdc_forensics.checkpoint.locate import locate_checkpoint

    path = options.checkpoint_paths.get(note.step) or locate_checkpoint(note, options.checkpoints_dir, trace_path)
    return str(path) if path is not None else note.path


def _damaged(report) -> bool:
    return any(f.kind.value in _NOT_A_START for f in report.findings)


def _storage_evidence(notes: list[CheckpointNote], files: dict[int, CheckpointFile], sharded: bool = False) -> list[Evidence]:
    out = []
    for note in notes:
        file = files[note.step]
        findings = [f for f in file.report.findings if f.kind.value in decision.STORAGE_FINDINGS] if file.report is not None else []
        if decision.diverged_replica_copy(note, sharded):  # a diverged replica's shard, written as it was: not the disk
            findings = [f for f in findings if f.kind is not FindingKind.DIGEST_MISMATCH]
        if file.error or findings:
            first = findings[0] if findings else None
            out.append(Evidence(
                kind=EvidenceKind.CHECKPOINT_MISMATCH, step=note.step, ranks=(note.saved_by_rank,), source="checkpoint",
                expected=first.expected if first else "a readable checkpoint", found=first.found if first else file.error,
                location=Location.STORAGE, affects_state=False,
                detail=f"checkpoint {Path(file.path or note.path).name}: " + (f"{first.kind.value} in {first.subject}" if first else "unreadable")
                + "; the file differs from what rank {} saved".format(note.saved_by_rank),
            ))
    return out


def _replay(trace: Trace, tri: TriageResult, usable: list[CheckpointNote], recipe_ref: str, options: AnalysisOptions, progress,
            ledger=None):
    """Replay the intervals that decide the run, each one the ``ledger`` (``forensics.ledger_use.LedgerUse``, or
    None) does not cover already; ``(summary, evidence, replayed steps, tolerant steps)``."""
    from sdc_forensics.replay.env import resolve_device
    from sdc_forensics.recipe import load_recipe

    resolve_device(options.device)  # a bad --device fails before any work
    runner = _WindowRunner(trace, load_recipe(recipe_ref, args=trace.manifest.recipe_args), options, progress, _suspect_gpus(trace, tri),
                           ledger)
    starts = sorted(usable, key=lambda n: n.step)
    first_step, last_step = tri.step_range if tri.step_range else (0, -1)
    if tri.suspect_window is not None:
        hi = tri.suspect_window[1]
        reason = f"confirm the trace's evidence at step {hi}"
    else:
        hi = last_step
        reason = "no trace evidence: replay the last checkpoint interval, then widen backwards"
    hint = ledger.strong_evidence() if ledger is not None else None
    if hint is not None and first_step <= hint[0] < hi:
        # an earlier exact replay (a follower's) found strong evidence there: replay it again (the evidence a verdict rests
        # on is this run's) before the steps after it, which a confirmed divergence taints whatever they hold
        hi, reason = hint[0], f"confirm the ledger's evidence at step {hint[0]} (record {hint[1]})"
    found: int | None = None
    for note in reversed(starts):
        if note.step > hi:
            continue
        if (options.max_replay_steps is not None and runner.replayed_steps >= options.max_replay_steps
                and not (ledger is not None and ledger.covering(note.step, hi))):  # the limit is on replays, not on reuse
            if ledger is not None and ledger.certifies_before(note.step):  # earlier intervals may still come from the ledger
                runner.notes.append(f"steps {note.step}..{hi} not replayed (--max-replay-steps reached); earlier intervals "
                                    "the ledger covers are still taken from it")
                hi = note.step - 1
                if hi < first_step:
                    break
                continue
            runner.notes.append(f"stopped widening after {runner.replayed_steps} replayed steps (--max-replay-steps): "
                                f"steps {first_step}..{hi} not replayed")
            break
        result = runner.replay(note, hi, reason)
        if result is None:
            continue  # it does not hold the replicas' weights: the checkpoint before covers its interval
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
    summary = ReplaySummary(windows=tuple(sorted(runner.windows, key=lambda w: w.start)), device=runner.device,
                            reduction_order=runner.order, settings=runner.settings, notes=tuple(runner.notes),
                            ledger=ledger.summary() if ledger is not None else None)
    return summary, runner.evidence, runner.replayed, runner.tolerant


def interval_runner(trace: Trace, options: AnalysisOptions, progress=None, ledger=None, recipe=None) -> "_WindowRunner":
    """A runner of checkpoint-interval replays, as the walk above uses them: ``runner.replay(note, last_step, reason)``
    reuses what ``ledger`` covers, replays the rest (second opinion on weak residuals included) and appends each
    replay to the ledger. ``certify --follow`` replays interval by interval with it; ``recipe``: one loaded before."""
    if recipe is None:
        from sdc_forensics.recipe import load_recipe

        recipe = load_recipe(options.recipe or trace.manifest.recipe, args=trace.manifest.recipe_args)
    return _WindowRunner(trace, recipe, options, progress, _suspect_gpus(trace, triage_trace(trace)), ledger)


def _intervals_below(starts: list[CheckpointNote], note: CheckpointNote, budget: int | None,
                     first_step: int = 0) -> list[tuple[CheckpointNote, int]]:
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


def _scan_after(runner: "_WindowRunner", starts: list[CheckpointNote], found: int, last_step: int) -> None:
    """Replay the intervals after the first divergence, each up to its own first divergence:
    recurrences. An interval whose checkpoint was saved while a replica still diverged is skipped
    (that replica would mismatch at every step: the same event, not a recurrence)."""
    plan: list[tuple[CheckpointNote, int | None]] = []  # None: not scanned (its note goes in its place)
    for index, note in enumerate(starts):
        if note.step <= found:
            continue
        hi = starts[index + 1].step - 1 if index + 1 < len(starts) else last_step
        if note.diverged_ranks or hi >= note.step:
            plan.append((note, None if note.diverged_ranks else hi))
    runner.share([(note, hi) for note, hi in plan if hi is not None])
    for note, hi in plan:
        if hi is None:
            runner.notes.append(f"scan: checkpoint {note.step} was saved while rank(s) {', '.join(map(str, note.diverged_ranks))} "
                                "still diverged; its interval is not scanned")
        else:
            runner.replay(note, hi, "scan of the intervals after the first divergence (--scan-recurrence)")


class _WindowRunner:
    """Runs replay windows for one bisection and accumulates what they found."""

    def __init__(self, trace: Trace, recipe, options: AnalysisOptions, progress, suspect_gpus: dict[str, int], ledger=None) -> None:
        self.trace, self.recipe, self.options, self.progress, self.suspect_gpus = trace, recipe, options, progress, suspect_gpus
        self.ledger = ledger  # forensics.ledger_use.LedgerUse: intervals it covers are not replayed; each replay is appended
        self.windows: list[ReplayedWindow] = []
        self.evidence: list[Evidence] = []
        self.notes: list[str] = []
        self.replayed: set[int] = set()
        self.tolerant: set[int] = set()
        self.device, self.order, self.settings, self.replayed_steps = None, "", {}, 0
        # replays done ahead by the processes of a distributed replay (``share``), by ``_run``'s
        # arguments; ``record`` collects this runner's own when it replays intervals alone
        self.done: dict[tuple, object] = {}
        self.record: dict[tuple, object] | None = None
        self.last_replayed: tuple[float, int] | None = None  # (seconds, steps) of the last window this process replayed
        if ledger is not None:
            # the run's summation order, as an earlier exact replay found it: without it the first window replayed
            # learns it from its first step, which fails when that step's all-reduce is the one corrupted (a record
            # of a later, clean interval then made the answer depend on what ran before)
            self.order = ledger.known_reduction()

    def budget_left(self) -> int | None:
        """Steps ``--max-replay-steps`` still allows (None: no limit)."""
        limit = self.options.max_replay_steps
        return None if limit is None else limit - self.replayed_steps

    def share(self, plan: list[tuple[CheckpointNote, int]]) -> None:
        """Under ``torchrun``, replay the intervals of ``plan`` ahead, whole intervals dealt out
        to the processes, when that ends sooner than sharing the ranks of each step (costs measured
        on the rank-shared interval before, gathered from every process: every process decides
        alike). The walk then takes each result from ``done``; whatever it needs that was not
        done ahead (another reduction order, a checkpoint without the replicas' weights, an
        error on the process that replayed it) it replays itself, ranks shared as before."""
        from sdc_forensics.errors import SdcError
        from sdc_forensics.replay import distributed
        from sdc_forensics.replay.env import resolve_device

        group = distributed.current()
        plan = [(note, hi) for note, hi in plan if (note.step, hi, self.options.num_threads, True, self.order) not in self.done
                and not (self.ledger is not None and self.ledger.covering(note.step, hi))]
        if group is None or len(plan) < 2 or self.last_replayed is None or self.options.collective:
            return  # --collective: every process replays every step together, one collective per bucket
        costs = distributed.measured_costs(*self.last_replayed)
        gathered = [c for c in distributed.exchange_objects(costs) if c is not None]
        if not gathered:
            return
        mean = distributed.StepCosts(*(sum(getattr(c, f) for c in gathered) / len(gathered) for f in ("rank", "exchange", "rest")))
        lengths = [hi - note.step + 1 for note, hi in plan]
        if not distributed.intervals_pay(lengths, self.trace.world_size, group.size, mean):
            return
        distributed.check_placement(resolve_device(self.options.device), self.trace, self.suspect_gpus, self.options.force_device)
        dealt = distributed.deal([float(n) for n in lengths], group.size)
        mine = dealt[group.rank]
        # a process that finishes first waits at the exchange for the others' work: allow three
        # times the estimated longest share on top of --replay-timeout before calling a peer lost.
        # Every interval is taken to pay the measured window's whole unshared time again (its
        # checkpoint load and model build are in it): short intervals are not underestimated.
        per_interval_s = mean.rest * self.last_replayed[1]
        longest_s = max(sum(lengths[i] * (self.trace.world_size * mean.rank + mean.rest) + per_interval_s for i in part)
                        for part in dealt)
        patient = distributed.patient_group(3.0 * longest_s)
        note_line = getattr(self.progress, "note", None)
        if note_line is not None:
            note_line(f"{len(plan)} checkpoint intervals ({sum(lengths)} steps) shared out whole across {group.size} processes, "
                      "each replaying its own intervals alone")
        scratch = _WindowRunner(self.trace, self.recipe, self.options, None, self.suspect_gpus)
        scratch.order, scratch.record = self.order, {}
        with distributed.alone():
            for index in mine:
                note, hi = plan[index]
                try:
                    scratch.replay(note, hi, "")
                except distributed.ReplayProcessLost:
                    raise  # the launcher stopped this process (SIGTERM): one line and exit 4, now
                except SdcError:
                    pass  # not recorded: the walk replays it on every process and reports the error as usual
        for done in distributed.exchange_objects(scratch.record, patient):
            self.done.update(done)

    def replay(self, note: CheckpointNote, hi: int, reason: str):
        """Replay ``note.step..hi`` from checkpoint ``note``; None when it does not hold the replicas' weights."""
        from sdc_forensics.replay.replayer import StartStateMismatch

        if self.ledger is not None:
            reused = self.ledger.reuse(note.step, hi, reason)
            if reused is not None:
                say = getattr(self.progress, "note", None)
                if say is not None:
                    span = f"step {note.step}" if hi == note.step else f"steps {note.step}..{hi}"
                    say(f"{span} not replayed: the ledger holds their exact clean replay (record {', '.join(reused.record_ids)})")
                return _FROM_LEDGER
        if self.progress is not None:
            self.progress.window(note.step, hi, reason)
        started = time.perf_counter()
        try:
            result = self._run(note, hi, self.options.num_threads)
        except StartStateMismatch as exc:
            self.notes.append(f"checkpoint {note.step} does not hold the replicas' weights ({exc.found} != {exc.expected}); "
                              "replaying from the one before")
            return None
        evidence = list(result.evidence)
        # weak residuals before the replay's first strong divergence (or with none): a strong one right after a weak one may
        # be its consequence (``common_mode``), so the weak one is checked in either case
        first = result.first_divergent_step
        weak = [e for e in evidence if e.is_weak and (first is None or e.step < first)]
        if weak and self.device_is_cpu:
            evidence = self._second_opinion(note, result, evidence, weak)
        self.device, self.order, self.settings = result.device, self.order or result.reduction_order, result.settings
        self.notes += [n for n in result.notes if n not in self.notes]
        self.windows.append(ReplayedWindow(start=note.step, stop=hi, last=result.last_step, comparison=result.comparison,
                                           tolerant_from=result.tolerant_from, reason=reason,
                                           max_residual_ratio=result.max_residual_ratio))
        self.evidence += evidence
        if self.ledger is not None:
            self.ledger.append(note, hi + 1, result, evidence, time.perf_counter() - started)
        self.replayed_steps += result.num_steps
        self.replayed.update(range(note.step, result.last_step + 1))
        if result.tolerant_from is not None:
            self.tolerant.update(range(result.tolerant_from, result.last_step + 1))
        return result

    @property
    def device_is_cpu(self) -> bool:
        return self.options.device == "cpu"

    def _run(self, note: CheckpointNote, hi: int, threads: int | None, stop_at_divergence: bool = True):
        from sdc_forensics.replay.replayer import StartStateMismatch

        key = (note.step, hi, threads, stop_at_divergence, self.order)
        if key in self.done:  # replayed ahead by one of the processes (``share``)
            outcome = self.done[key]
            if isinstance(outcome, _NotTheReplicas):
                raise StartStateMismatch(outcome.message, step=note.step, expected=outcome.expected, found=outcome.found)
            if self.progress is not None:
                for step in range(note.step, outcome.last_step + 1):
                    self.progress.step(step)
            # the device this process replays on names the replay, as for a window it replayed itself
            return dataclasses.replace(outcome, device=self.device) if self.device else outcome
        started = time.perf_counter()
        try:
            result = self._replay_window(note, hi, threads, stop_at_divergence)
            self.last_replayed = (time.perf_counter() - started, result.num_steps)
        except StartStateMismatch as exc:
            if self.record is not None:
                self.record[key] = _NotTheReplicas(message=str(exc), expected=exc.expected, found=exc.found)
            raise
        if self.record is not None:
            self.record[key] = result
        return result

    def _replay_window(self, note: CheckpointNote, hi: int, threads: int | None, stop_at_divergence: bool):
        from sdc_forensics.replay.replayer import ReplayOptions, replay_window

        options = ReplayOptions.of(self.options, start_step=note.step, stop_step=hi,
                                   checkpoint_path=_resolve(note, self.options, self.trace.path),
                                   expected_weights_digest=note.weights_digest, suspect_gpus=self.suspect_gpus,
                                   reduction_order=self.order, num_threads=threads, stop_at_divergence=stop_at_divergence)
        return replay_window(self.trace, self.recipe, options, self.progress.step if self.progress is not None else None)

    def _second_opinion(self, note: CheckpointNote, first, evidence: list[Evidence], weak: list[Evidence]) -> list[Evidence]:
        """Majority of three for weak tolerant residuals: a second, independent replay of the same
        steps at another thread count (its last-bit drift differs). A residual that a fault caused is
        in the record and shows again; one that the first replay's drift caused does not. Only the
        steps the second replay reached are cleared, and what it found strongly is kept."""
        threads = int(first.settings.get("num_threads") or 1) + 1
        upto = max(e.step for e in weak)
        second = self._run(note, upto, threads, stop_at_divergence=False)
        again = set()
        for e in second.evidence:
            if e.is_weak or e.marks_divergence:
                again |= {(e.step, r) for r in e.ranks} if e.ranks else {(e.step, None)}

        def reproduced(e: Evidence) -> bool:
            if e.step > second.last_step:
                return True  # not re-examined: keep it
            if not e.ranks:  # a collective residual: any evidence at that step
                return any(step == e.step for step, _ in again)
            return any((e.step, r) in again or (e.step, None) in again for r in e.ranks)

        kept = [e for e in evidence if not e.is_weak or reproduced(e)]
        kept += [e for e in second.evidence if e.marks_divergence and all((e.step, e.ranks) != (k.step, k.ranks) for k in kept)]
        cleared = len(evidence) - len([e for e in kept if e in evidence])
        if cleared:
            self.notes.append(f"steps {note.step}..{second.last_step}: {cleared} weak tolerant residual(s) not reproduced by a "
                              f"second replay at {threads} threads: replay drift, not a fault")
        if any(e.is_weak for e in kept):
            self.notes.append(f"steps {note.step}..{upto}: a second replay at {threads} threads reproduced the weak residual(s)")
        return kept


@dataclasses.dataclass(frozen=True)
class _FromLedger:
    """An interval taken from the ledger: replayed exactly and clean before, so no divergence in it."""

    first_divergent_step: None = None


_FROM_LEDGER = _FromLedger()


@dataclasses.dataclass(frozen=True)
class _NotTheReplicas:
    """A replay done ahead found its checkpoint not holding the replicas' weights (``StartStateMismatch``)."""

    message: str
    expected: str
    found: str


def _suspect_gpus(trace: Trace, tri: TriageResult) -> dict[str, int]:
    """``{gpu_uuid: rank}`` of every rank the trace's findings name: never replay on those."""
    out = {}
    for ev in tri.findings:
        for rank in ev.ranks:
            uuid = trace.manifest.identity(rank).gpu_uuid
            if uuid:
                out[uuid] = rank
    return out


def _resolve(note: CheckpointNote, options: AnalysisOptions, trace_path: Path) -> Path:
    from sdc_forensics.checkpoint.locate import locate_checkpoint

    return options.checkpoint_paths.get(note.step) or locate_checkpoint(note, options.checkpoints_dir, trace_path) or Path(note.path)
