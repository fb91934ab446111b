"""Bisect: the whole flow from a trace directory to a verdict.

1. Triage the trace (free, numpy only): every piece of evidence it holds and the window a replay
   must examine.
2. Verify the noted checkpoint files against their notes (a damaged file is storage evidence and
   is never replayed from).
3. Replay the smallest window that can confirm the trace's evidence: from the last usable
   checkpoint at or before the suspect window, to its end. With no trace evidence, replay the
   last checkpoint interval, then widen backwards one interval at a time, and stop at the first
   divergence. A checkpoint that does not hold the replicas' weights is skipped for the one before.
4. Decide: the first divergent step, the suspects (rank, host, GPU, location, recurrence), and
   every checkpoint's status with the last clean one.

``trace_only`` stops after step 1 (and reads checkpoint notes, not files) and never imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Protocol

from sdc_forensics.forensics.evidence import Evidence, EvidenceKind, Location, sort_key
from sdc_forensics.forensics.triage import TriageResult, triage_trace
from sdc_forensics.forensics.verdict import (
    BisectResult, CheckpointVerdict, ReplayedWindow, ReplaySummary, Verdict, find_suspects, first_divergent_step, unlocalised,
)
from sdc_forensics.trace.checkpoints import CheckpointNote, read_checkpoint_notes
from sdc_forensics.trace.consensus import majority_weights_digests
from sdc_forensics.trace.reader import UNTRUSTED_DAMAGE, Trace

# the file differs from what was saved: storage. NaN/Inf or not-the-majority content was saved that
# way (a consequence of a divergence, not of the disk); such a checkpoint is not replayed from either.
_STORAGE_FINDINGS = {"digest-mismatch", "file-damaged", "file-checksum-mismatch", "missing-tensor", "unexpected-tensor"}
_NOT_A_START = _STORAGE_FINDINGS | {"nonfinite", "weights-not-majority"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BisectOptions:
    """What ``bisect`` may use.

    Attributes:
        checkpoints_dir: where the checkpoint files are (None: the paths the job wrote).
        recipe: ``module:attribute`` overriding the manifest's recipe.
        device: replay device (``cpu``, ``cuda``, ``cuda:N``).
        trace_only: never replay, never read checkpoint files, never import torch.
        force_device: replay even on a suspect's GPU.
        max_replay_steps: stop widening backwards after this many replayed steps (None: no limit).
        scan_recurrence: also replay every other checkpoint interval (from checkpoints all replicas
            agreed on): earlier divergences the trace cannot see, and recurrences of the suspects.
    """

    checkpoints_dir: Path | None = None
    recipe: str | None = None
    device: str = "cpu"
    trace_only: bool = False
    force_device: bool = False
    max_replay_steps: int | None = None
    scan_recurrence: bool = False


class Progress(Protocol):
    """Progress of long replays (the CLI draws bars on stderr)."""

    def window(self, start: int, stop: int, reason: str) -> None: ...

    def step(self, step: int) -> None: ...


def bisect(trace_dir: str | os.PathLike, options: BisectOptions, progress: Progress | None = None) -> BisectResult:
    """Find the first divergent step, the suspects and the last clean checkpoint.

    Raises:
        TraceError: the trace is unreadable. RecipeError: the recipe cannot be loaded.
        UsageError: the replay device is unavailable or a suspect's GPU (not forced).
    """
    trace = Trace.open(trace_dir)
    tri = triage_trace(trace)
    notes = read_checkpoint_notes(trace.path)
    evidence = list(tri.evidence)
    settle: list[str] = []
    notes_out: list[str] = []
    summary = ReplaySummary()
    reports: dict[int, tuple[str, object, str]] = {}
    replayed_from: set[int] = set()
    mode = "trace-only"
    if options.trace_only:
        settle.append("replay with the job's recipe and checkpoints (bisect without --trace-only) to find faults the trace cannot see")
    else:
        recipe_ref = options.recipe or trace.manifest.recipe
        if not recipe_ref:
            settle.append("the trace names no replay recipe: pass --recipe MODULE:ATTR (docs/recipes.md)")
        if not notes:
            settle.append("the trace notes no checkpoint: replay needs one; pass a trace whose run saved checkpoints")
        if recipe_ref and notes:
            reports = _verify_files(notes, options.checkpoints_dir, trace.path, int(trace.manifest.fingerprint.seed))
            evidence += _storage_evidence(notes, reports)
            usable = [n for n in notes if reports[n.step][1] is not None and not _damaged(reports[n.step][1])]
            if not usable:
                settle.append("no checkpoint file was found intact: pass --checkpoints DIR")
            else:
                mode = "replay"
                summary, replay_evidence, replayed_from = _replay(trace, tri, usable, recipe_ref, options, progress)
                evidence += replay_evidence
    evidence.sort(key=sort_key)
    first = first_divergent_step(evidence)
    checkpoints, certification = _certify(notes, reports, first, replayed_from, trace, tri)
    suspects = find_suspects(tuple(evidence), trace.world_size, trace.manifest.identity)
    verdict, scope = _decide(tri, evidence, suspects, summary, mode, options, settle)
    if tri.superseded_cells:
        notes_out.append(f"{tri.superseded_cells} (step, rank) records were re-executed by a later attempt; the latest attempt is used")
    clean = [c for c in checkpoints if c.clean]
    return BisectResult(
        verdict=verdict, first_divergent_step=first, suspects=suspects,
        last_clean_checkpoint=max(clean, key=lambda c: c.step) if clean else None, checkpoints=tuple(checkpoints),
        replayed=summary, evidence=tuple(evidence), mode=mode, scope=scope, settle=tuple(settle) if verdict is not Verdict.CORRUPTION or mode == "trace-only" else (),
        trace_path=str(trace.path), world_size=trace.world_size, step_range=tri.step_range,
        damage=tuple(d.detail or d.kind for d in tri.damage), notes=tuple(notes_out), certification=tuple(certification),
    )


def _decide(tri: TriageResult, evidence, suspects, summary: ReplaySummary, mode: str, options: BisectOptions, settle: list[str]):
    steps = f"steps {tri.step_range[0]}..{tri.step_range[1]}" if tri.step_range else "no steps"
    scope = f"trace checks over {steps}"
    if summary.windows:
        spans = ", ".join(f"{w.start}..{w.last}" for w in summary.windows)
        scope += f"; replayed {spans} ({summary.comparison}) on {summary.device}"
    if suspects and not all(s.rank is None and s.location is Location.UNKNOWN for s in suspects):
        return Verdict.CORRUPTION, scope
    vague = unlocalised(tuple(evidence))
    if vague:
        settle.insert(0, f"evidence at step {vague[0].step} could not be localised ({vague[0].detail}); "
                      "replay that step with the recipe and checkpoints, or enable audits")
        return Verdict.INCONCLUSIVE, scope
    hints = [e for e in evidence if e.is_hint]
    if mode == "trace-only" and hints:
        steps_hinted = sorted({e.step for e in hints})
        settle.insert(0, f"outlier hints at step(s) {', '.join(map(str, steps_hinted[:5]))}: a replay of those steps "
                      "(with the recipe and checkpoints) confirms or clears them")
        return Verdict.INCONCLUSIVE, scope + "; nothing replayed"
    if mode == "trace-only" and not options.trace_only:
        return Verdict.INCONCLUSIVE, scope + "; nothing replayed"
    if mode == "trace-only":
        return Verdict.CLEAN, scope + " (trace-only: a wrong finite local gradient on a step without an audit would not show)"
    return Verdict.CLEAN, scope


def _verify_files(notes: list[CheckpointNote], checkpoints_dir, trace_path: Path, seed: int) -> dict[int, tuple[str, object, str]]:
    """``{step: (path, report or None, error)}`` for every noted checkpoint, digested with the trace's seed."""
    from sdc_forensics.checkpoint.certify import locate_checkpoint
    from sdc_forensics.checkpoint.verify import VerifyOptions, verify_checkpoint
    from sdc_forensics.errors import CheckpointError

    out = {}
    for note in notes:
        path = locate_checkpoint(note, checkpoints_dir, trace_path.parent)
        report, error = None, ""
        if path is not None:
            try:
                report = verify_checkpoint(path, note=note, options=VerifyOptions(seed=seed))
            except CheckpointError as exc:
                error = str(exc)
        out[note.step] = (str(path) if path else "", report, error)
    return out


def _damaged(report) -> bool:
    return any(f.kind.value in _NOT_A_START for f in report.findings)


def _storage_evidence(notes: list[CheckpointNote], reports) -> list[Evidence]:
    out = []
    for note in notes:
        path, report, error = reports[note.step]
        findings = [f for f in report.findings if f.kind.value in _STORAGE_FINDINGS] if report is not None else []
        if error or findings:
            first = findings[0] if findings else None
            out.append(Evidence(
                kind=EvidenceKind.CHECKPOINT_MISMATCH, step=note.step, ranks=(note.saved_by_rank,), source="checkpoint",
                expected=first.expected if first else "a readable checkpoint", found=first.found if first else error,
                location=Location.STORAGE, affects_state=False,
                detail=f"checkpoint {Path(path or note.path).name}: " + (f"{first.kind.value} in {first.subject}" if first else "unreadable")
                + "; the file differs from what rank {} saved".format(note.saved_by_rank),
            ))
    return out


def _replay(trace: Trace, tri: TriageResult, usable: list[CheckpointNote], recipe_ref: str, options: BisectOptions, progress):
    from sdc_forensics.forensics.replay_env import resolve_device
    from sdc_forensics.recipe import load_recipe

    resolve_device(options.device)  # a bad --device fails before any work
    runner = _WindowRunner(trace, load_recipe(recipe_ref), options, progress, _suspect_gpus(trace, tri))
    starts = sorted(usable, key=lambda n: n.step)
    first_step, last_step = tri.step_range if tri.step_range else (0, -1)
    if tri.suspect_window is not None:
        lo, hi = tri.suspect_window
        plan = [(lo, hi, f"confirm the trace's evidence at step {hi}" + (f" (weights last equal before step {lo})" if lo < hi else ""))]
    else:
        plan = [(None, last_step, "no trace evidence: replay the last checkpoint interval, widening backwards")]
    found = None
    while plan:
        lo, hi, reason = plan.pop(0)
        candidates = [n for n in starts if n.step <= (hi if lo is None else lo)]
        result, note = runner.first_usable(candidates, hi, reason)
        if result is None:
            runner.notes.append(f"no usable checkpoint at or before step {lo if lo is not None else hi}: steps up to {hi} not replayed")
            break
        if result.first_divergent_step is not None:
            found = result.first_divergent_step
            break
        if lo is None and note.step > first_step:
            if options.max_replay_steps is not None and runner.replayed_steps >= options.max_replay_steps:
                runner.notes.append(f"stopped widening after {runner.replayed_steps} replayed steps (--max-replay-steps)")
                break
            plan.append((None, note.step - 1, "nothing found later: widen backwards one checkpoint interval"))
        elif lo is not None:
            runner.notes.append(f"the replay of {note.step}..{hi} did not reproduce the trace's evidence; it stands unconfirmed by replay")
    if options.scan_recurrence:
        _scan_all(runner, starts, last_step)
    elif found is not None and runner.windows and min(w.start for w in runner.windows) > first_step:
        runner.notes.append(f"steps before {min(w.start for w in runner.windows)} were not replayed: a fault the trace cannot "
                            "see there would not show (--scan-recurrence replays every interval)")
    summary = ReplaySummary(windows=tuple(runner.windows), device=runner.device, reduction_order=runner.order,
                            settings=runner.settings, notes=tuple(runner.notes))
    return summary, runner.evidence, runner.verified


def _scan_all(runner: "_WindowRunner", starts: list[CheckpointNote], last_step: int) -> None:
    """Replay every checkpoint interval not replayed yet, each up to its first divergence: earlier
    and later divergences (recurrence). An interval whose checkpoint was saved while a replica
    still diverged is skipped (that replica would mismatch at every step: a persistent divergence,
    not a recurrence)."""
    done = {w.start for w in runner.windows}
    for index, note in enumerate(starts):
        if note.step in done:
            continue
        if note.diverged_ranks:
            runner.notes.append(f"scan: checkpoint {note.step} was saved while rank(s) {list(note.diverged_ranks)} "
                                "still diverged; its interval is not scanned")
            continue
        hi = starts[index + 1].step - 1 if index + 1 < len(starts) else last_step
        if hi >= note.step:
            runner.first_usable([note], hi, "scan of every interval (--scan-recurrence)")


class _WindowRunner:
    """Runs replay windows for one bisection and accumulates what they found."""

    def __init__(self, trace: Trace, recipe, options: BisectOptions, progress, suspect_gpus: dict[str, int]) -> None:
        self.trace, self.recipe, self.options, self.progress, self.suspect_gpus = trace, recipe, options, progress, suspect_gpus
        self.windows: list[ReplayedWindow] = []
        self.evidence: list[Evidence] = []
        self.notes: list[str] = []
        self.verified: set[int] = set()
        self.device, self.order, self.settings, self.replayed_steps = None, "", {}, 0

    def first_usable(self, candidates: list[CheckpointNote], hi: int, reason: str):
        """Replay ``..hi`` from the latest candidate that holds the replicas' weights; ``(result, note)``."""
        from sdc_forensics.forensics.replay import ReplayOptions, StartStateMismatch, replay_window

        for note in reversed(candidates):
            options = ReplayOptions(start_step=note.step, stop_step=hi, checkpoint_path=_resolve(note, self.options.checkpoints_dir, self.trace.path),
                                    expected_weights_digest=note.weights_digest, device=self.options.device,
                                    force_device=self.options.force_device, suspect_gpus=self.suspect_gpus, reduction_order=self.order)
            if self.progress is not None:
                self.progress.window(note.step, hi, reason)
            try:
                result = replay_window(self.trace, self.recipe, options, self.progress.step if self.progress is not None else None)
            except StartStateMismatch as exc:
                self.notes.append(f"checkpoint {note.step} does not hold the replicas' weights ({exc.found} != {exc.expected}); "
                                  "replaying from the one before")
                continue
            self.device, self.order, self.settings = result.device, self.order or result.reduction_order, result.settings
            self.notes += list(result.notes)
            self.windows.append(ReplayedWindow(start=note.step, stop=hi, last=result.last_step, comparison=result.comparison,
                                               tolerant_from=result.tolerant_from, reason=reason))
            self.evidence += list(result.evidence)
            self.replayed_steps += result.num_steps
            if result.tolerant_from != note.step:
                # it held the replicas' weights and the healthy ranks' first step replayed bit for bit
                self.verified.add(note.step)
            return result, note
        return None, None


def _suspect_gpus(trace: Trace, tri: TriageResult) -> dict[str, int]:
    """``{gpu_uuid: rank}`` of every rank the trace's findings name: never replay on those."""
    out = {}
    for ev in tri.findings:
        for rank in ev.ranks:
            uuid = trace.manifest.identity(rank).gpu_uuid
            if uuid:
                out[uuid] = rank
    return out


def _resolve(note: CheckpointNote, checkpoints_dir, trace_path: Path) -> Path:
    from sdc_forensics.checkpoint.certify import locate_checkpoint

    return locate_checkpoint(note, checkpoints_dir, trace_path.parent) or Path(note.path)


def _certify(notes, reports, first, replayed_from, trace, tri) -> tuple[list[CheckpointVerdict], list]:
    """Checkpoint verdicts, and the checkpoint module's records behind them (when files were read)."""
    if not notes:
        return [], []
    majority = majority_weights_digests(trace, [n.step for n in notes])
    if not reports:  # trace-only, or nothing to replay with: notes, not files
        return [_from_note(n, first, majority.get(n.step)) for n in notes], []
    from sdc_forensics.checkpoint.certify import decide

    consistent = not any(d.kind in UNTRUSTED_DAMAGE for d in tri.damage)
    statuses = []
    for note in notes:
        path, report, error = reports[note.step]
        statuses.append(decide(note, report=report, error=error, path=path, first_divergent_step=first,
                               replay_verified=note.step in replayed_from, trace_consistent=consistent,
                               majority_digest=majority.get(note.step)))
    verdicts = [CheckpointVerdict(step=s.step, path=s.path or n.path, status=s.status.value, reasons=s.reasons)
                for s, n in zip(statuses, notes)]
    return verdicts, statuses


def _from_note(note: CheckpointNote, first: int | None, majority: str | None) -> CheckpointVerdict:
    if note.saved_by_rank in note.diverged_ranks or not note.blessed:
        return CheckpointVerdict(step=note.step, path=note.path, status="corrupt",
                                 reasons=(f"saved from rank {note.saved_by_rank}, not the replicas' strict majority",))
    if majority and note.weights_digest and majority != note.weights_digest:
        return CheckpointVerdict(step=note.step, path=note.path, status="corrupt",
                                 reasons=(f"the note's digest {note.weights_digest} is not the replicas' majority {majority}",))
    if first is not None and note.step > first:
        return CheckpointVerdict(step=note.step, path=note.path, status="tainted",
                                 reasons=(f"holds state after the first divergent step {first} (step {note.step} > {first})",))
    return CheckpointVerdict(step=note.step, path=note.path, status="unverified",
                             reasons=("consistent with the trace; the file was not read (trace-only): run bisect or "
                                      "verify-checkpoint to certify its content",))
