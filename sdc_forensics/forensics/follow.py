"""``certify --follow``: certify a run while it trains, one checkpoint interval at a time.

The loop, every ``poll_s`` seconds:

1. Open the trace afresh (it grows while training runs) and read its checkpoint notes and the
   ledger (``forensics/ledger_use.py``: records of an earlier follower, of a follower that was
   killed and restarted, or of a ``bisect`` run meanwhile, all count).
2. A checkpoint interval ``[a, b)`` is *closed* when the note of checkpoint ``b`` exists (the
   recorder writes it after the file is saved in full, so a half-written checkpoint is never
   seen: its note is not there yet) and the trace records step ``b - 1``. Closed intervals that
   the ledger does not cover exactly are *pending*; their number is the follower's lag
   (intervals behind training).
3. Replay each pending interval, oldest first, with the walk's own runner
   (``bisect.interval_runner``: the same replay, second opinion and ledger record as ``bisect``).
   An interval whose starting checkpoint file is gone (rotated away before it was replayed) is
   said once and left: nothing can replay it.
4. Strong evidence in an interval: the incident is the analysis of ``certify`` (the one
   decision, ``decide.decision``; it reuses everything the ledger covers: it replays the
   evidence's interval again, up to the divergence, and what training recorded after the
   follower's last replay). The follower stops with exit 1, or goes on with ``keep_going``.

It stops at ``until_step`` (every interval up to that checkpoint examined), after ``idle_s``
seconds with nothing new in the trace and nothing pending, or at SIGTERM/SIGINT (a replay in
progress is abandoned: its interval has no record and is replayed again by the next follower;
a ledger append is never cut; the final statuses are then decided on the ledger, replaying
nothing, and a second signal ends that at once). Exit status (``exitcodes.ExitCode``): 1 when an incident was found;
else 4 when it stopped with intervals still pending or some that cannot be replayed; else 0.
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
    """

    poll_s: float = 10.0
    until_step: int | None = None
    idle_s: float | None = None
    keep_going: bool = False

    def __post_init__(self) -> None:
        if not self.poll_s > 0:
            raise ValueError("poll_s must be > 0")
        if self.idle_s is not None and not self.idle_s > 0:
            raise ValueError("idle_s must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntervalDone:
    """One interval the follower examined: ``start..last`` from checkpoint ``start``."""

    start: int
    last: int
    outcome: str  # "clean", "evidence" or "reused" (covered by the ledger when first seen)
    comparison: str
    record_id: str = ""
    lag: int = 0  # intervals still pending after it


@dataclasses.dataclass(frozen=True, kw_only=True)
class FollowOutcome:
    """What the follower did and concluded.

    Attributes:
        intervals: the intervals it replayed or found covered, in the order it did.
        stopped_by: ``until-step``, ``idle``, ``signal`` or ``incident``.
        lag: intervals pending when it stopped.
        unreplayable: ``(start, stop)`` intervals whose starting checkpoint file was gone.
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
            with contextlib.suppress(ValueError):  # not the main thread: no handler, the caller stops us
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


def follow(trace_dir: str | os.PathLike, options, follow_options: FollowOptions, say: Callable[[str], None] | None = None,
           progress=None) -> FollowOutcome:
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
        raise UsageError("certify --follow records every interval in the ledger and replays: drop --no-ledger (and SDC_FORENSICS_NO_LEDGER) and --trace-only")
    loop = _Loop(Path(trace_dir), options, follow_options, say or (lambda line: None), progress)
    with _Signals() as signals:
        loop.signals = signals
        try:
            stopped_by = loop.run()
        except _Stop:
            stopped_by = "signal"
            loop.say(f"stopping: {signal.Signals(signals.received).name} received; every record appended so far is whole")
    return loop.outcome(stopped_by)


class _Loop:
    def __init__(self, trace_dir: Path, options, follow_options: FollowOptions, say, progress) -> None:
        self.trace_dir, self.options, self.follow, self.say, self.progress = trace_dir, options, follow_options, say, progress
        self.signals: _Signals | None = None
        self.done: list[IntervalDone] = []
        self.seen: set[tuple[int, int]] = set()
        self.unreplayable: dict[tuple[int, int], str] = {}
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
            if self._idle():
                return "idle"
            time.sleep(self.follow.poll_s)

    def _idle(self) -> bool:
        return self.follow.idle_s is not None and self.lag == 0 and time.monotonic() - self.last_change > self.follow.idle_s

    def _poll(self) -> str | None:
        """One look at the trace and the replay of every pending interval; a reason to stop, or None."""
        from sdc_forensics.errors import TraceError
        from sdc_forensics.forensics.bisect import interval_runner
        from sdc_forensics.forensics.ledger_use import LedgerUse
        from sdc_forensics.trace.reader import Trace

        try:
            trace = Trace.open(self.trace_dir)
        except TraceError as exc:  # not written yet (training is starting): wait
            if not self.said_waiting:
                self.say(f"waiting for the trace: {exc}")
                self.said_waiting = True
            return None
        notes = sorted((n for n in trace.checkpoint_notes() if n.weights_digest), key=lambda n: n.step)
        bounds = trace.step_range()
        last_step = bounds[1] if bounds else -1
        state = (last_step, tuple(n.step for n in notes))
        if state != self.last_state:
            self.last_state, self.last_change = state, time.monotonic()
        ledger = LedgerUse.open(trace, notes, self.options, say=None)
        for line in ledger.lines:  # records not reused, each said once
            if line not in self.said:
                self.said.add(line)
                self.say(line)
        closed = [(a, b) for a, b in zip(notes, notes[1:]) if b.step - 1 <= last_step and b.step > a.step]
        pending = [(a, b) for a, b in closed if not ledger.covering(a.step, b.step - 1)]
        for a, b in closed:
            if (a.step, b.step) not in self.seen and (a, b) not in pending:
                self.seen.add((a.step, b.step))
                ids = ledger.covering(a.step, b.step - 1)
                self.done.append(IntervalDone(start=a.step, last=b.step - 1, outcome="reused", comparison="exact", record_id=ids[0]))
                self.say(f"steps {a.step}..{b.step - 1}: already in the ledger (record {', '.join(ids)})")
        # an interval this follower examined already (with evidence, under --keep-going) is not replayed again
        replayable = [(a, b) for a, b in pending if (a.step, b.step) not in self.unreplayable and (a.step, b.step) not in self.seen]
        for a, b in replayable:
            if ledger.locate(a) is None:
                self.unreplayable[(a.step, b.step)] = f"checkpoint {a.step}'s file is gone (rotated away?)"
                self.say(f"steps {a.step}..{b.step - 1} cannot be replayed: checkpoint {a.step}'s file is gone (rotated away before "
                         "it was replayed); they stay unexamined")
        replayable = [(a, b) for a, b in replayable if (a.step, b.step) not in self.unreplayable]
        self.lag = len(replayable)
        if replayable:
            self.say(f"lag: {len(replayable)} interval(s) behind training (trace at step {last_step})")
            runner = interval_runner(trace, self.options, self.progress, ledger, recipe=self.recipe)
            self.recipe = runner.recipe
            appended = len(ledger.appended)
            for index, (a, b) in enumerate(replayable):
                result = self._replay(runner, a, b)
                self.seen.add((a.step, b.step))
                self.lag = len(replayable) - index - 1
                if result is None:  # checkpoint a does not hold the replicas' weights (runner's note says so)
                    self.unreplayable[(a.step, b.step)] = f"checkpoint {a.step} does not hold the replicas' weights"
                    self.say(f"steps {a.step}..{b.step - 1} cannot be replayed: checkpoint {a.step} does not hold the replicas' "
                             "weights; they stay unexamined")
                    continue
                self.last_change = time.monotonic()
                record = ledger.appended[-1] if len(ledger.appended) > appended else ""
                appended = len(ledger.appended)
                strong = result.first_divergent_step is not None
                weak = not strong and any(e.is_weak for e in runner.evidence if a.step <= e.step < b.step)
                outcome = "evidence" if strong or weak else "clean"
                comparison = result.comparison
                self.done.append(IntervalDone(start=a.step, last=b.step - 1, outcome=outcome, comparison=comparison,
                                              record_id=record, lag=self.lag))
                self.say(f"steps {a.step}..{b.step - 1}: replayed ({comparison}), "
                         + ("STRONG EVIDENCE" if strong else "weak evidence only" if weak else "clean")
                         + (f", record {record}" if record else "") + f"; lag {self.lag}")
                if strong:
                    self.say(f"incident: strong evidence at step {result.first_divergent_step}; analysing the run")
                    self.incidents.append(self._analyse(budget=None, progress=self.progress))
                    if not self.follow.keep_going:
                        return "incident"
                    return None  # the analysis replayed and recorded intervals too: read the ledger again before going on
        until = self.follow.until_step
        if until is not None and any(n.step >= until for n in notes):
            wanted = [(a, b) for a, b in closed if b.step <= until]
            if all((a.step, b.step) in self.seen or (a.step, b.step) in self.unreplayable for a, b in wanted):
                return "until-step"
        return None

    def _replay(self, runner, a, b):
        """Replay ``a.step .. b.step - 1``; a ledger append is never cut by a signal."""
        if self.signals is not None:
            runner.ledger.guard = self.signals.protected
        return runner.replay(a, b.step - 1, "certify --follow: a checkpoint interval closed")

    def _analyse(self, budget: int | None, progress=None):
        """``certify``'s analysis of the run as it stands, reusing the ledger (``budget``: ``max_replay_steps``)."""
        from sdc_forensics.forensics.certify import certify

        chosen = dataclasses.replace(self.options, max_replay_steps=budget)
        return certify(self.trace_dir, chosen, progress=progress)

    def outcome(self, stopped_by: str) -> FollowOutcome:
        final = None
        if stopped_by != "incident":  # after a signal too: a second SIGTERM/SIGINT ends it at once (the handlers are gone)
            from sdc_forensics.errors import SdcError

            try:  # every checkpoint's status from the one decision, on the ledger alone (replays nothing)
                final = self._analyse(budget=0)
            except SdcError as exc:  # the follower's own findings stand without it
                self.say(f"no final analysis: {exc}")
        elif self.incidents:
            final = self.incidents[-1]
        if self.incidents:
            code = ExitCode.CORRUPTION
        elif self.lag or self.unreplayable:
            code = ExitCode.INCONCLUSIVE
        else:
            code = ExitCode.CLEAN
        return FollowOutcome(intervals=tuple(self.done), stopped_by=stopped_by, lag=self.lag,
                             unreplayable=tuple(sorted(self.unreplayable)), incidents=tuple(self.incidents), final=final,
                             exit_code=code)
