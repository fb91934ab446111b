"""``certify --follow``: certify a run while it trains, one checkpoint interval at a time.

The loop, every ``poll_s`` seconds:

1. Open the trace afresh (it grows while training runs) and read its checkpoint notes and the
   ledger (``intervals.open_ledger``: records of an earlier follower, of a follower that was
   killed and restarted, or of a ``bisect`` run meanwhile, all count).
2. A checkpoint interval ``[a, b)`` is *closed* when the note of checkpoint ``b`` exists (the
   recorder writes it after the file is saved in full, so a half-written checkpoint is never
   seen: its note is not there yet) and the trace records step ``b - 1``. Closed intervals that
   the ledger does not cover exactly are *pending*; their number is the follower's lag
   (intervals behind training).
3. Replay each pending interval, oldest first (``--budget newest``: newest first, so that when
   the follower is behind a fresh fault alarms soonest; ``--budget sample:F``: a fraction ``F``
   of the intervals, picked by a hash of the starting checkpoint's step and digest so that a
   restarted follower picks the same, the others said once and left to the online checks),
   with the walk's own runner
   (``intervals.interval_runner``: the same replay, second opinion and ledger record as ``bisect``).
   An interval whose starting checkpoint file is gone (rotated away before it was replayed) is
   said once and left: nothing can replay it.
   Under ``torchrun`` process 0 takes each look and hands it to every process (``_View``), so
   all replay the same intervals: whole intervals dealt out to the processes when that pays
   (``IntervalRunner.share``, issue 12's machinery), else each step's ranks shared; process 0
   appends the records.
4. Strong evidence in an interval: the incident is the analysis of ``certify`` (the one
   decision, ``decide.decision``; it reuses everything the ledger covers: it replays the
   evidence's interval again, up to the divergence, and what training recorded after the
   follower's last replay). The follower stops with exit 1, or goes on with ``keep_going``.

It stops at ``until_step`` (every interval up to that checkpoint examined), after ``idle_s``
seconds with nothing new in the trace and nothing pending, or at SIGTERM/SIGINT (a replay in
progress is abandoned: its interval has no record and is replayed again by the next follower;
a ledger append is never cut; the final statuses are then decided on the ledger, replaying
nothing, and a second signal ends that at once). Exit status (``exitcodes.ExitCode``): 1 when an incident's analysis found corruption;
else 4 when an incident's analysis was inconclusive (a replay that does not reproduce the update:
the recipe), or it stopped with intervals still pending, some that cannot be replayed or some that
``--budget sample:F`` left out, or when the final analysis is 4 by ``certify``'s own rule (an
inconclusive analysis names no resume point: replays that judged nothing); else 0.

Over 400 lines on purpose: one loop (look, pick, replay, record, stop) whose parts share the
follower's state between polls (the look process 0 hands to every torchrun process, the
intervals seen by attempt, the budget's choice, the signal handling); the walk, the ledger and
the decision it calls are their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdc_forensics.exitcodes import ExitCode


@dataclasses.dataclass(frozen=True, kw_only=True)
class FollowOptions:
    """How ``certify --follow`` runs.

    Attributes:
        poll_s: seconds between looks at the trace when nothing is pending.
        until_step: stop once every interval before checkpoint ``until_step`` is examined (None: never).
        idle_s: stop after this many seconds without a new step, note or pending interval (None: never).
        keep_going: after an incident, go on following (exit 1 at the end) instead of stopping.
        budget: which closed intervals to replay (:func:`parse_budget`): ``all`` (oldest first),
            ``newest`` (all, newest first: a fresh fault alarms soonest when the follower is
            behind) or ``sample:F`` (a fraction ``F`` of the intervals, the others left to the
            online checks and said so).
    """

    poll_s: float = 10.0
    until_step: int | None = None
    idle_s: float | None = None
    keep_going: bool = False
    budget: str = "all"

    def __post_init__(self) -> None:
        if not self.poll_s > 0:
            raise ValueError("poll_s must be > 0")
        if self.idle_s is not None and not self.idle_s > 0:
            raise ValueError("idle_s must be > 0")
        parse_budget(self.budget)

    @property
    def sample(self) -> float | None:
        """The fraction of intervals ``sample:F`` replays (None: every interval)."""
        return parse_budget(self.budget)[1]

    @property
    def newest_first(self) -> bool:
        return parse_budget(self.budget)[0] == "newest"


def parse_budget(text: str) -> tuple[str, float | None]:
    """``all``, ``newest`` or ``sample:F`` (0 < F <= 1) as ``(kind, fraction or None)``.

    Raises:
        UsageError: anything else, with the forms it takes.
    """
    from sdc_forensics.errors import UsageError

    kind, _, value = str(text).strip().partition(":")
    if kind in ("all", "newest") and not value:
        return kind, None
    if kind == "sample":
        try:
            fraction = float(value)
        except ValueError:
            fraction = float("nan")
        if 0 < fraction <= 1:
            return kind, fraction
    raise UsageError(
        f"--budget {text!r}: use all (every interval, oldest first), newest (every interval, newest first) or "
        "sample:F with 0 < F <= 1 (that fraction of the intervals, the rest left to the online checks)"
    )


def sampled(note, fraction: float) -> bool:
    """Whether ``sample:fraction`` replays the interval from checkpoint ``note``: a hash of its step
    and weights digest, so a restarted follower, and every process under torchrun, picks the same."""
    import hashlib

    digest = hashlib.sha256(f"{note.step}:{note.weights_digest}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntervalDone:
    """One interval the follower examined: ``start..last`` from checkpoint ``start``."""

    start: int
    last: int
    # "clean", "evidence" or "reused" (covered by the ledger when first seen)
    outcome: str
    comparison: str
    record_id: str = ""
    # intervals still pending after it
    lag: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class FollowOutcome:
    """What the follower did and concluded.

    Attributes:
        intervals: the intervals it replayed or found covered, in the order it did.
        stopped_by: ``until-step``, ``idle``, ``signal`` or ``incident``.
        lag: intervals pending when it stopped.
        unreplayable: ``(start, stop)`` intervals whose starting checkpoint file was gone.
        skipped: ``(start, stop)`` intervals ``--budget sample:F`` left to the online checks.
        budget: the ``--budget`` it ran with.
        incidents: the analyses (``certify.Certification``) of the incidents found.
        final: the analysis when it stopped (reusing the ledger; no replay beyond what the ledger covers).
        exit_code: see the module docstring.
    """

    intervals: tuple[IntervalDone, ...]
    stopped_by: str
    lag: int
    unreplayable: tuple[tuple[int, int], ...]
    incidents: tuple[Any, ...]
    final: Any
    exit_code: ExitCode
    skipped: tuple[tuple[int, int], ...] = ()
    budget: str = "all"


class _Stop(Exception):
    """SIGTERM or SIGINT arrived: leave the loop (raised from the handler, never inside a ledger append)."""


class _Signals:
    """SIGTERM/SIGINT handlers for the loop: raise :class:`_Stop` at once, except while the ledger
    is being appended to, where the stop waits for the append to end."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.critical = False
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            # not the main thread: no handler, the caller stops us
            with contextlib.suppress(ValueError):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = signum
        if not self.critical:
            raise _Stop()

    @contextlib.contextmanager
    def protected(self):
        self.critical = True
        try:
            yield
        finally:
            self.critical = False
        if self.received is not None:
            raise _Stop()


def follow(
    trace_dir: str | os.PathLike,
    options,
    follow_options: FollowOptions,
    say: Callable[[str], None] | None = None,
    progress=None,
) -> FollowOutcome:
    """Certify ``trace_dir`` while it grows (module docstring).

    Args:
        trace_dir: the trace directory (it may not exist yet: the follower waits for it).
        options: ``replay.options.AnalysisOptions`` (``no_ledger`` is refused: the ledger is the follower's memory).
        follow_options: :class:`FollowOptions`.
        say: prints one line for people (stderr), or None.
        progress: ``bisect.Progress`` for the replays, or None.

    Raises:
        UsageError: ``--no-ledger`` or ``--trace-only``. Whatever a replay raises for a bad recipe or device.
    """
    from sdc_forensics.errors import UsageError

    if options.no_ledger or options.trace_only:
        raise UsageError(
            "certify --follow records every interval in the ledger and replays: drop --no-ledger (and SDC_FORENSICS_NO_LEDGER) and --trace-only"
        )
    loop = _Loop(Path(trace_dir), options, follow_options, say or (lambda line: None), progress)
    with _Signals() as signals:
        loop.signals = signals
        try:
            stopped_by = loop.run()
        except _Stop:
            stopped_by = "signal"
            loop.say(
                f"stopping: {signal.Signals(signals.received).name} received; every record appended so far is whole"
            )
    return loop.outcome(stopped_by)


@dataclasses.dataclass(frozen=True)
class _View:
    """One look at the trace and the ledger, taken by process 0 and shared with every process
    under torchrun (they then replay the same intervals in the same order: issue 12's sharing).

    Attributes:
        last_step: the last step the trace records (-1: none).
        notes: ``(step, attempt)`` of the checkpoint notes with weights digests, in step order.
        covered: ``(start, stop, attempt, record ids)`` closed intervals the ledger covers exactly
            (``attempt``: of the closing checkpoint's note).
        gone: ``(start, stop, attempt)`` closed intervals not covered whose starting checkpoint file is gone.
        todo: ``(start, stop, attempt)`` intervals to replay now, in the order the budget says.
        skipped: ``(start, stop, attempt)`` intervals ``sample:F`` leaves to the online checks.
        lines: the ledger's lines (records not reused).
        idle: the trace has not changed for ``idle_s`` and nothing is left to replay.
        waiting: the trace cannot be opened yet (the reason), or "".
    """

    last_step: int = -1
    notes: tuple[tuple[int, int], ...] = ()
    covered: tuple[tuple[int, int, int, tuple[str, ...]], ...] = ()
    gone: tuple[tuple[int, int, int], ...] = ()
    todo: tuple[tuple[int, int, int], ...] = ()
    skipped: tuple[tuple[int, int, int], ...] = ()
    lines: tuple[str, ...] = ()
    idle: bool = False
    waiting: str = ""


class _Loop:
    def __init__(self, trace_dir: Path, options, follow_options: FollowOptions, say, progress) -> None:
        self.trace_dir, self.options, self.follow, self.say, self.progress = (
            trace_dir,
            options,
            follow_options,
            say,
            progress,
        )
        self.signals: _Signals | None = None
        self.done: list[IntervalDone] = []
        # intervals by (start, stop, attempt of the closing checkpoint's note): a resumed attempt that
        # re-executes steps makes new intervals of the same steps, to examine again
        self.seen: set[tuple[int, int, int]] = set()
        self.unreplayable: dict[tuple[int, int, int], str] = {}
        self.skipped: set[tuple[int, int, int]] = set()
        self.incidents: list[Any] = []
        self.recipe = None
        self.lag = 0
        self.last_change = time.monotonic()
        self.last_state: tuple = ()
        self.said_waiting = False
        self.said: set[str] = set()

    def run(self) -> str:
        while True:
            state = self._poll()
            if state is not None:
                return state
            time.sleep(self.follow.poll_s)

    def _look(self) -> _View:
        """Process 0's look at the trace and the ledger (every process's, without torchrun)."""
        from sdc_forensics.errors import TraceError
        from sdc_forensics.forensics.files import checkpoint_file
        from sdc_forensics.forensics.intervals import open_ledger
        from sdc_forensics.trace.reader import Trace

        try:
            trace = Trace.open(self.trace_dir)
        # not written yet (training is starting): wait
        except TraceError as exc:
            return _View(waiting=str(exc))
        notes = sorted((n for n in trace.checkpoint_notes() if n.weights_digest), key=lambda n: n.step)
        bounds = trace.step_range()
        last_step = bounds[1] if bounds else -1
        state = (last_step, tuple(n.step for n in notes))
        if state != self.last_state:
            self.last_state, self.last_change = state, time.monotonic()
        ledger = open_ledger(trace, notes, self.options)
        closed = [(a, b) for a, b in zip(notes, notes[1:]) if b.step - 1 <= last_step and b.step > a.step]
        covered, gone, todo, skipped = [], [], [], []
        for a, b in closed:
            span = (a.step, b.step, b.attempt)
            ids = ledger.covering(a.step, b.step - 1)
            if ids:
                covered.append((*span, ids))
            elif span in self.seen or span in self.unreplayable or span in self.skipped:
                # examined by this follower already (with evidence, under --keep-going), or said
                continue
            elif self.follow.sample is not None and not sampled(a, self.follow.sample):
                skipped.append(span)
            elif checkpoint_file(a, trace.path, self.options) is None:
                gone.append(span)
            else:
                todo.append(span)
        if self.follow.newest_first:
            todo.reverse()
        idle = (
            self.follow.idle_s is not None
            and not todo
            and self.lag == 0
            and time.monotonic() - self.last_change > self.follow.idle_s
        )
        return _View(
            last_step=last_step,
            notes=tuple((n.step, n.attempt) for n in notes),
            covered=tuple(covered),
            gone=tuple(gone),
            todo=tuple(todo),
            skipped=tuple(skipped),
            lines=tuple(ledger.lines),
            idle=idle,
        )

    def _shared_look(self) -> _View:
        """:meth:`_look` on process 0, handed to every process under torchrun."""
        from sdc_forensics.replay import distributed

        if distributed.current() is None:
            return self._look()
        view = None
        if distributed.is_lead():
            with (
                distributed.alone()
                # process 0 reads alone (its ledger reading is not exchanged): the view is what is shared
            ):
                view = self._look()
        return distributed.exchange_objects(view)[0]

    def _poll(self) -> str | None:
        """One look at the trace and the replay of every interval to replay; a reason to stop, or None."""
        from sdc_forensics.forensics.intervals import interval_runner, open_ledger
        from sdc_forensics.trace.reader import Trace

        view = self._shared_look()
        if view.waiting:
            if not self.said_waiting:
                self.say(f"waiting for the trace: {view.waiting}")
                self.said_waiting = True
            return None
        # records not reused, each said once
        for line in view.lines:
            if line not in self.said:
                self.said.add(line)
                self.say(line)
        for a, b, attempt, ids in view.covered:
            if (a, b, attempt) not in self.seen:
                self.seen.add((a, b, attempt))
                self.done.append(
                    IntervalDone(start=a, last=b - 1, outcome="reused", comparison="exact", record_id=ids[0])
                )
                self.say(f"steps {a}..{b - 1}: already in the ledger (record {', '.join(ids)})")
        for a, b, attempt in view.gone:
            self.unreplayable[(a, b, attempt)] = f"checkpoint {a}'s file is gone (rotated away?)"
            self.say(
                f"steps {a}..{b - 1} cannot be replayed: checkpoint {a}'s file is gone (rotated away before "
                "it was replayed); they stay unexamined"
            )
        for a, b, attempt in view.skipped:
            self.skipped.add((a, b, attempt))
            self.say(f"steps {a}..{b - 1}: left to the online checks by --budget {self.follow.budget} (not replayed)")
        self.lag = len(view.todo)
        if view.todo:
            self.say(
                f"lag: {len(view.todo)} interval(s) behind training (trace at step {view.last_step})"
                + (", newest first" if self.follow.newest_first and len(view.todo) > 1 else "")
            )
            trace = Trace.open(self.trace_dir)
            wanted = set(view.notes)
            by_step = {
                n.step: n for n in trace.checkpoint_notes() if n.weights_digest and (n.step, n.attempt) in wanted
            }
            notes = [by_step[step] for step, _ in view.notes if step in by_step]
            # a ledger append is never cut by a stop signal: the handlers hold it off until the append ends
            ledger = open_ledger(
                trace, notes, self.options, guard=self.signals.protected if self.signals is not None else None
            )
            runner = interval_runner(trace, self.options, self.progress, ledger, recipe=self.recipe)
            self.recipe = runner.recipe
            plan = [(by_step[a], by_step[b]) for a, b, _ in view.todo]
            runner.share(
                [(a, b.step - 1) for a, b in plan]
                # under torchrun: whole intervals dealt out, when that pays
            )
            appended = len(runner.appended)
            for index, (a, b) in enumerate(plan):
                result = runner.replay(a, b.step - 1, "certify --follow: a checkpoint interval closed")
                self.seen.add((a.step, b.step, b.attempt))
                self.lag = len(plan) - index - 1
                # checkpoint a does not hold the replicas' weights (runner's note says so)
                if result is None:
                    self.unreplayable[(a.step, b.step, b.attempt)] = (
                        f"checkpoint {a.step} does not hold the replicas' weights"
                    )
                    self.say(
                        f"steps {a.step}..{b.step - 1} cannot be replayed: checkpoint {a.step} does not hold the replicas' "
                        "weights; they stay unexamined"
                    )
                    continue
                self.last_change = time.monotonic()
                record = runner.appended[-1] if len(runner.appended) > appended else ""
                appended = len(runner.appended)
                strong = result.first_divergent_step is not None
                weak = not strong and any(e.is_weak for e in runner.evidence if a.step <= e.step < b.step)
                outcome = "evidence" if strong or weak else "clean"
                comparison = result.comparison
                self.done.append(
                    IntervalDone(
                        start=a.step,
                        last=b.step - 1,
                        outcome=outcome,
                        comparison=comparison,
                        record_id=record,
                        lag=self.lag,
                    )
                )
                self.say(
                    f"steps {a.step}..{b.step - 1}: replayed ({comparison}), "
                    + ("STRONG EVIDENCE" if strong else "weak evidence only" if weak else "clean")
                    + (f", record {record}" if record else "")
                    + f"; lag {self.lag}"
                )
                if strong:
                    self.say(f"incident: strong evidence at step {result.first_divergent_step}; analysing the run")
                    self.incidents.append(self._analyse(budget=None, progress=self.progress))
                    if not self.follow.keep_going:
                        return "incident"
                    return (
                        None  # the analysis replayed and recorded intervals too: read the ledger again before going on
                    )
        until = self.follow.until_step
        if until is not None and any(n >= until for n, _ in view.notes):
            wanted = [
                (a, b, attempt)
                for (a, _), (b, attempt) in zip(view.notes, view.notes[1:])
                if b <= until and b - 1 <= view.last_step and b > a
            ]
            if all(span in self.seen or span in self.unreplayable or span in self.skipped for span in wanted):
                return "until-step"
        if view.idle:
            return "idle"
        return None

    def _analyse(self, budget: int | None, progress=None):
        """``certify``'s analysis of the run as it stands, reusing the ledger (``budget``: ``max_replay_steps``)."""
        from sdc_forensics.forensics.certify import certify

        chosen = dataclasses.replace(self.options, max_replay_steps=budget)
        return certify(self.trace_dir, chosen, progress=progress)

    def outcome(self, stopped_by: str) -> FollowOutcome:
        from sdc_forensics.replay import distributed

        final = None
        if stopped_by == "signal" and distributed.current() is not None:
            # each process was stopped wherever it was: they cannot meet for an analysis together
            self.say(
                "no final analysis under torchrun after a stop signal: run sdc-forensics certify TRACE_DIR for the statuses "
                "(it reuses every record appended)"
            )
        elif (
            stopped_by != "incident"
            # after a signal too: a second SIGTERM/SIGINT ends it at once (the handlers are gone)
        ):
            from sdc_forensics.errors import SdcError

            # every checkpoint's status from the one decision, on the ledger alone (replays nothing)
            try:
                final = self._analyse(budget=0)
            # the follower's own findings stand without it
            except SdcError as exc:
                self.say(f"no final analysis: {exc}")
        elif self.incidents:
            final = self.incidents[-1]
        from sdc_forensics.decide.decision import Verdict

        if any(c.analysis.verdict is Verdict.CORRUPTION for c in self.incidents):
            code = ExitCode.CORRUPTION
        elif self.incidents or self.lag or self.unreplayable or self.skipped:
            # strong evidence that the analysis could not pin on a rank (a replay that does not reproduce the
            # update, most likely the recipe): nothing after it is certified, and it is no corruption verdict
            code = ExitCode.INCONCLUSIVE
        elif final is not None and final.exit_code == ExitCode.INCONCLUSIVE:
            # certify's rule on the final statuses (forensics/certify.py, certify_exit): replays that judged
            # nothing (a step drawing from the unseeded global RNG) name no resume point, so not 0 either
            code = ExitCode.INCONCLUSIVE
        else:
            code = ExitCode.CLEAN
        return FollowOutcome(
            intervals=tuple(self.done),
            stopped_by=stopped_by,
            lag=self.lag,
            unreplayable=tuple(sorted({(a, b) for a, b, _ in self.unreplayable})),
            incidents=tuple(self.incidents),
            final=final,
            exit_code=code,
            skipped=tuple(sorted({(a, b) for a, b, _ in self.skipped})),
            budget=self.follow.budget,
        )
