"""The interval runner: checkpoint intervals replayed for one analysis, and the one owner of the ledger's answers.

A checkpoint interval is the steps ``N..M`` replayed from checkpoint ``N``'s file (``files.checkpoint_file``, the one
answer to "which file is checkpoint N"). Every command that replays intervals does it through an :class:`IntervalRunner`:

* ``bisect``'s backward walk (``forensics/bisect.py``; ``certify``, ``verify-checkpoint --trace`` and ``report`` run it)
  hands it one interval at a time (:meth:`IntervalRunner.replay`) and asks it what the ledger already holds
  (:meth:`~IntervalRunner.covered`, :meth:`~IntervalRunner.ledger_evidence`,
  :meth:`~IntervalRunner.ledger_certifies_before`); an earlier attempt of a resumed run is replayed by a runner
  without a ledger;
* ``certify --follow`` (``forensics/follow.py``) reads which closed intervals the ledger covers (:func:`open_ledger`)
  and replays the rest with a runner (:func:`interval_runner`), its stop signals held off around each ledger append
  (``guard``);
* ``certify`` and ``report`` measure what replaying the rest would cost on the ledger's records (:func:`ledger_records`).

For each interval the runner takes it from the ledger when the ledger covers it exactly (``forensics/ledger_use.py``,
opened here and nowhere else), or replays it (``replay.replayer``), settles weak tolerant residuals with a second
replay at another thread count (majority of three), appends the record of each replay to the ledger, and under
``torchrun`` takes the intervals replayed ahead by the processes (:meth:`IntervalRunner.share`).
It never calls back into the walk: the walk decides which interval comes next, the runner only replays it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sdc_forensics.decide.verdict import ReplayedWindow, ReplaySummary
from sdc_forensics.evidence import Evidence
from sdc_forensics.forensics.files import checkpoint_file
from sdc_forensics.forensics.ledger_use import LedgerUse
from sdc_forensics.replay.options import AnalysisOptions
from sdc_forensics.trace.checkpoints import CheckpointNote
from sdc_forensics.trace.reader import Trace
from sdc_forensics.triage.trace_only import TriageResult, triage_trace

__all__ = ["IntervalRunner", "interval_runner", "ledger_records", "open_ledger", "suspect_gpus"]


def open_ledger(
    trace: Trace,
    notes: Sequence[CheckpointNote],
    options: AnalysisOptions,
    say: Callable[[str], None] | None = None,
    guard: Callable[[], Any] | None = None,
) -> LedgerUse | None:
    """The ledger of ``trace`` as one analysis reads and extends it (None with ``no_ledger`` or ``trace_only``).

    Args:
        trace: the open trace.
        notes: its checkpoint notes (the intervals' ends).
        options: where the ledger is (``ledger_path``) and the checkpoint files (``files.checkpoint_file``).
        say: prints each line about records not reused (the progress' ``note``), or None.
        guard: a context manager around each append (``certify --follow`` holds its stop signals off there).
    """
    return LedgerUse.open(trace, notes, options, say=say, guard=guard)


def ledger_records(
    trace_path: str | os.PathLike, ledger_file: str | os.PathLike | None = None, no_ledger: bool = False
) -> tuple:
    """Every valid record of the ledger beside ``trace_path`` (or ``ledger_file``; none with ``no_ledger``):
    what ``decide.coverage.with_details`` measures the replay cost on. Damaged records were said by the
    analysis that read the ledger."""
    from sdc_forensics.ledger import ledger_path, read_ledger

    return () if no_ledger else tuple(read_ledger(ledger_path(trace_path, ledger_file)).records)


def interval_runner(
    trace: Trace,
    options: AnalysisOptions,
    progress=None,
    ledger: LedgerUse | None = None,
    recipe=None,
    *,
    triage: TriageResult | None = None,
) -> "IntervalRunner":
    """A runner of checkpoint-interval replays: ``runner.replay(note, last_step, reason)`` takes what ``ledger``
    (:func:`open_ledger`) covers from it, replays the rest (second opinion on weak residuals included) and appends
    each replay to the ledger.

    Args:
        recipe: a recipe loaded before (the follower keeps one between polls); None: the one ``options`` or the
            manifest names.
        triage: the trace's triage, when the caller has it (the GPUs of the ranks it names are not replayed on).
    """
    if recipe is None:
        from sdc_forensics.recipe import load_recipe

        recipe = load_recipe(options.recipe or trace.manifest.recipe, args=trace.manifest.recipe_args)
    return IntervalRunner(
        trace,
        recipe,
        options,
        progress,
        suspect_gpus(trace, triage if triage is not None else triage_trace(trace)),
        ledger,
    )


def _collective_load(path: Path) -> bool:
    """Whether the checkpoint at ``path`` is a DCP directory, which a recipe loads with ``dcp.load``: a
    collective over the default process group."""
    from sdc_forensics.checkpoint.dcp_reader import METADATA_NAME

    try:
        return (path / METADATA_NAME).is_file()
    except OSError:
        return False


class IntervalRunner:
    """Replays checkpoint intervals for one analysis and accumulates what they found.

    Args:
        trace: the open trace (its manifest, ranks and records the replays compare against).
        recipe: the loaded replay recipe.
        options: the analysis options (device, threads, ``--max-replay-steps``, checkpoint files).
        progress: ``bisect.Progress``, or None.
        suspect_gpus: ``{gpu_uuid: rank}`` of the ranks the trace names (never replayed on).
        ledger: the ledger as this analysis reads and extends it (:func:`open_ledger`), or None:
            intervals it covers are not replayed, and each replay is appended to it.
    """

    def __init__(
        self, trace: Trace, recipe, options: AnalysisOptions, progress, suspect_gpus: dict[str, int], ledger=None
    ) -> None:
        self.trace, self.recipe, self.options, self.progress, self.suspect_gpus = (
            trace,
            recipe,
            options,
            progress,
            suspect_gpus,
        )
        self.ledger = ledger
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
        # (seconds, steps) of the last window this process replayed
        self.last_replayed: tuple[float, int] | None = None
        if ledger is not None:
            # the run's summation order, as an earlier exact replay found it: without it the first window replayed
            # learns it from its first step, which fails when that step's all-reduce is the one corrupted (a record
            # of a later, clean interval then made the answer depend on what ran before)
            self.order = ledger.known_reduction()

    def budget_left(self) -> int | None:
        """Steps ``--max-replay-steps`` still allows (None: no limit)."""
        limit = self.options.max_replay_steps
        return None if limit is None else limit - self.replayed_steps

    # -- what the ledger holds, for the walk (nothing but this runner asks the ledger) -------------

    def covered(self, start_step: int, last_step: int) -> tuple[str, ...]:
        """The ids of the ledger records that cover steps ``start_step..last_step`` exactly and clean
        (empty: some step is not covered, or there is no ledger): such an interval is not replayed."""
        return self.ledger.covering(start_step, last_step) if self.ledger is not None else ()

    def ledger_evidence(self) -> tuple[int, str] | None:
        """``(step, record id)`` of the earliest strong evidence an exact ledger record holds (None: none):
        where a walk starts, to replay it again (the evidence a verdict rests on is always this run's)."""
        return self.ledger.strong_evidence() if self.ledger is not None else None

    def ledger_certifies_before(self, step: int) -> bool:
        """True when a ledger record replayed steps before ``step`` exactly and found them clean."""
        return self.ledger is not None and self.ledger.certifies_before(step)

    @property
    def appended(self) -> tuple[str, ...]:
        """The ids of the records this runner's replays appended to the ledger, in order."""
        return tuple(self.ledger.appended) if self.ledger is not None else ()

    def summary(self) -> ReplaySummary:
        """What the replays did (windows in step order, device, summation order, notes) and what the ledger gave and got."""
        return ReplaySummary(
            windows=tuple(sorted(self.windows, key=lambda w: w.start)),
            device=self.device,
            reduction_order=self.order,
            settings=self.settings,
            notes=tuple(self.notes),
            ledger=self.ledger.summary() if self.ledger is not None else None,
        )

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
        plan = [
            (note, hi)
            for note, hi in plan
            if (note.step, hi, self.options.num_threads, True, self.order) not in self.done
            and not (self.ledger is not None and self.ledger.covering(note.step, hi))
        ]
        if group is None or len(plan) < 2 or self.last_replayed is None or self.options.collective:
            # --collective: every process replays every step together, one collective per bucket
            return
        if any(
            _collective_load(checkpoint_file(note, self.trace.path, self.options) or Path(note.path))
            for note, _ in plan
        ):
            # a DCP checkpoint is loaded by every process of the default group together (dcp.load): a
            # process replaying its own interval alone waited for the others until gloo timed out (a
            # trial user's PP and TP traces, and the PP demo, on 3-4 processes); replayed together instead
            return
        costs = distributed.measured_costs(*self.last_replayed)
        gathered = [c for c in distributed.exchange_objects(costs) if c is not None]
        if not gathered:
            return
        mean = distributed.StepCosts(
            *(sum(getattr(c, f) for c in gathered) / len(gathered) for f in ("rank", "exchange", "rest"))
        )
        lengths = [hi - note.step + 1 for note, hi in plan]
        if not distributed.intervals_pay(lengths, self.trace.world_size, group.size, mean):
            return
        distributed.check_placement(
            resolve_device(self.options.device), self.trace, self.suspect_gpus, self.options.force_device
        )
        dealt = distributed.deal([float(n) for n in lengths], group.size)
        mine = dealt[group.rank]
        # a process that finishes first waits at the exchange for the others' work: allow three
        # times the estimated longest share on top of --replay-timeout before calling a peer lost.
        # Every interval is taken to pay the measured window's whole unshared time again (its
        # checkpoint load and model build are in it): short intervals are not underestimated.
        per_interval_s = mean.rest * self.last_replayed[1]
        longest_s = max(
            sum(lengths[i] * (self.trace.world_size * mean.rank + mean.rest) + per_interval_s for i in part)
            for part in dealt
        )
        patient = distributed.patient_group(3.0 * longest_s)
        note_line = getattr(self.progress, "note", None)
        if note_line is not None:
            note_line(
                f"{len(plan)} checkpoint intervals ({sum(lengths)} steps) shared out whole across {group.size} processes, "
                "each replaying its own intervals alone"
            )
        scratch = IntervalRunner(self.trace, self.recipe, self.options, None, self.suspect_gpus)
        scratch.order, scratch.record = self.order, {}
        with distributed.alone():
            for index in mine:
                note, hi = plan[index]
                try:
                    scratch.replay(note, hi, "")
                except distributed.ReplayProcessLost:
                    # the launcher stopped this process (SIGTERM): one line and exit 4, now
                    raise
                except SdcError:
                    # not recorded: the walk replays it on every process and reports the error as usual
                    pass
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
                    say(
                        f"{span} not replayed: the ledger holds their exact clean replay (record {', '.join(reused.record_ids)})"
                    )
                return _FROM_LEDGER
        if self.progress is not None:
            self.progress.window(note.step, hi, reason)
        started = time.perf_counter()
        try:
            result = self._run(note, hi, self.options.num_threads)
        except StartStateMismatch as exc:
            self.notes.append(
                f"checkpoint {note.step} does not hold the replicas' weights ({exc.found} != {exc.expected}); "
                "replaying from the one before"
            )
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
        self.windows.append(
            ReplayedWindow(
                start=note.step,
                stop=hi,
                last=result.last_step,
                comparison=result.comparison,
                tolerant_from=result.tolerant_from,
                reason=reason,
                max_residual_ratio=result.max_residual_ratio,
            )
        )
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
        # replayed ahead by one of the processes (``share``)
        if key in self.done:
            outcome = self.done[key]
            if isinstance(outcome, _NotTheReplicas):
                raise StartStateMismatch(
                    outcome.message, step=note.step, expected=outcome.expected, found=outcome.found
                )
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
        from sdc_forensics.replay.replayer import ReplayOptions
        from sdc_forensics.replay.window import replay_window

        options = ReplayOptions.of(
            self.options,
            start_step=note.step,
            stop_step=hi,
            checkpoint_path=checkpoint_file(note, self.trace.path, self.options) or Path(note.path),
            expected_weights_digest=note.weights_digest,
            suspect_gpus=self.suspect_gpus,
            reduction_order=self.order,
            num_threads=threads,
            stop_at_divergence=stop_at_divergence,
        )
        return replay_window(
            self.trace, self.recipe, options, self.progress.step if self.progress is not None else None
        )

    def _second_opinion(
        self, note: CheckpointNote, first, evidence: list[Evidence], weak: list[Evidence]
    ) -> list[Evidence]:
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
                # not re-examined: keep it
                return True
            # a collective residual: any evidence at that step
            if not e.ranks:
                return any(step == e.step for step, _ in again)
            return any((e.step, r) in again or (e.step, None) in again for r in e.ranks)

        kept = [e for e in evidence if not e.is_weak or reproduced(e)]
        kept += [
            e
            for e in second.evidence
            if e.marks_divergence and all((e.step, e.ranks) != (k.step, k.ranks) for k in kept)
        ]
        cleared = len(evidence) - len([e for e in kept if e in evidence])
        still = sum(e.is_weak for e in kept)
        # one note: "reproduced" and "not reproduced" of the same interval read as a contradiction when both were said
        if cleared and still:
            self.notes.append(
                f"steps {note.step}..{upto}: a second replay at {threads} threads reproduced {still} weak tolerant "
                f"residual(s), and not {cleared} other(s) (those were replay drift, not a fault)"
            )
        elif cleared:
            self.notes.append(
                f"steps {note.step}..{second.last_step}: {cleared} weak tolerant residual(s) not reproduced by a "
                f"second replay at {threads} threads: replay drift, not a fault"
            )
        elif still:
            self.notes.append(
                f"steps {note.step}..{upto}: a second replay at {threads} threads reproduced the weak residual(s)"
            )
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


def suspect_gpus(trace: Trace, tri: TriageResult) -> dict[str, int]:
    """``{gpu_uuid: rank}`` of every rank the trace's findings name: never replay on those."""
    out = {}
    for ev in tri.findings:
        for rank in ev.ranks:
            uuid = trace.manifest.identity(rank).gpu_uuid
            if uuid:
                out[uuid] = rank
    return out
