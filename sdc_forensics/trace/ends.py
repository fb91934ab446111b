"""How a trace ends: where each rank's file stops, whether the recorder closed it, and the run's
last complete step.

A rank killed by SIGKILL (or the OOM killer, or a lost node) leaves its file as the kill found it:
every complete record, at most one torn record at the tail (ignored, reported as ``torn_tail``),
and no END record (format 1.1, ``docs/trace-format.md``). The other ranks then wait in a
collective until the launcher or the process-group timeout ends them; they may have recorded one
step more than the killed rank, or closed their files on the collective's error. So the trace's
**last complete step** is the last step that every rank recorded, and the run **stopped early**
when a rank's file was cut short (no END record, a torn tail, no file), a rank closed it on an
exception, or the ranks' files end at different steps. Only the latest attempt is judged: an
earlier one ended when the run was resumed.

numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sdc_forensics.trace import format as F

#: How :meth:`RunEnd.describe` begins (renderers find the line among a result's damage by it).
STOPPED_EARLY = "the run stopped early"
#: How far back from the ranks' common last step the last step present on every rank is
#: searched (a hole there is ``missing_steps`` damage; beyond it the answer is "none").
_LOOKBACK_STEPS = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankEnd:
    """Where one rank's file of the latest attempt ends.

    Attributes:
        rank: global rank.
        host: its host (manifest identity of the attempt).
        has_file: a readable rank file exists for the attempt.
        last_step: the last step with a valid STEP record in that file, None if none.
        closed: the file ends with an END record; None for a trace written before END records
            (format 1.0: unknown).
        closed_on_error: the END record says the recorder was closed while an exception propagated.
        torn_bytes: bytes of an incomplete record at the file's tail (a kill mid-write).
    """

    rank: int
    host: str = ""
    has_file: bool = True
    last_step: int | None = None
    closed: bool | None = None
    closed_on_error: bool = False
    torn_bytes: int = 0

    @property
    def cut_short(self) -> bool:
        """The file did not end the way the recorder ends it: killed, crashed, or lost."""
        return not self.has_file or self.torn_bytes > 0 or self.closed is False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"cut_short": self.cut_short}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunEnd:
    """How the run's latest attempt ended, from its rank files alone.

    Attributes:
        attempt: the latest attempt with rank files.
        ranks: one :class:`RankEnd` per rank ``0 .. W-1``.
        last_step: the furthest step any rank recorded in it, None if none.
        last_complete_step: the last step every rank recorded (the analysis reads every rank up
            to here; later steps hold some ranks' records only), None if there is none.
        finalised: every rank closed its file with an END record; None for a 1.0 trace.
        stopped_early: the run did not end the way a finished run does (see the module doc).
        stopped_ranks: where it stopped: the ranks that did not record ``last_complete_step + 1``
            (those whose files were cut short, when only some were), empty if not stopped early.
    """

    attempt: int
    ranks: tuple[RankEnd, ...]
    last_step: int | None
    last_complete_step: int | None
    finalised: bool | None
    stopped_early: bool
    stopped_ranks: tuple[int, ...] = ()

    @property
    def stop_step(self) -> int | None:
        """The first step not recorded by every rank (where the run stopped), None if not stopped early."""
        if not self.stopped_early:
            return None
        return 0 if self.last_complete_step is None else self.last_complete_step + 1

    def describe(self) -> str:
        """One sentence for people: that the run stopped early, and where (empty if it did not)."""
        from sdc_forensics.trace.spans import step_ranges

        if not self.stopped_early:
            return ""
        by_rank = {r.rank: r for r in self.ranks}
        where = _who(self.stopped_ranks, by_rank)
        parts = [STOPPED_EARLY + (f" in attempt {self.attempt}" if self.attempt else "")]
        if self.last_complete_step is None:
            parts.append("no step was recorded by every rank")
        else:
            parts.append(f"last complete step {self.last_complete_step} (recorded by every rank)")
        if self.stopped_ranks:
            after = by_rank[self.stopped_ranks[0]].last_step
            parts.append(
                f"{where} stopped " + (f"after step {after}" if after is not None else "before recording any step")
            )
        ahead = [
            r
            for r in self.ranks
            if r.last_step is not None and self.last_complete_step is not None and r.last_step > self.last_complete_step
        ]
        if ahead:
            steps = step_ranges([range(self.last_complete_step + 1, max(r.last_step for r in ahead) + 1)])
            parts.append(f"step(s) {steps} recorded by rank(s) {step_ranges([r.rank for r in ahead])} only")
        for r in self.ranks:
            if r.torn_bytes:
                parts.append(f"rank {r.rank}'s file ends in a torn record ({r.torn_bytes} bytes, ignored)")
        missing = [r.rank for r in self.ranks if not r.has_file]
        if missing:
            parts.append(f"rank(s) {step_ranges(missing)} have no readable file in this attempt")
        if self.finalised is None:
            parts.append("the trace predates END records (format 1.0): whether ranks closed it is unknown")
        else:
            open_ = [r.rank for r in self.ranks if r.has_file and not r.closed]
            failed = [r.rank for r in self.ranks if r.closed_on_error]
            if len(open_) == len(self.ranks):
                parts.append("no rank closed its trace (killed, or the machine died)")
            elif open_:
                parts.append(f"rank(s) {step_ranges(open_)} did not close their trace (killed, or the machine died)")
            if failed:
                parts.append(f"rank(s) {step_ranges(failed)} closed their trace on an exception")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """The ``end`` object of ``inspect --json``."""
        return {
            "attempt": self.attempt,
            "finalised": self.finalised,
            "stopped_early": self.stopped_early,
            "last_step": self.last_step,
            "last_complete_step": self.last_complete_step,
            "stop_step": self.stop_step,
            "stopped_ranks": list(self.stopped_ranks),
            "stopped_hosts": sorted({r.host for r in self.ranks if r.rank in self.stopped_ranks and r.host}),
            "summary": self.describe(),
            "ranks": [r.to_json() for r in self.ranks],
        }


# trace: an open trace.reader.Trace (not imported: the reader imports this module)
def run_end(trace) -> RunEnd:
    """How ``trace``'s latest attempt ended (reads each file's tail, and a few steps of tables)."""
    manifest = trace.manifest
    attempt = max(f.attempt for f in trace.files)
    knows_end = manifest.format_minor >= 1
    files = {f.rank: f for f in trace.files if f.attempt == attempt and f.rank < trace.world_size}
    ranks = []
    for rank in range(trace.world_size):
        host = manifest.identity(rank, attempt).host or manifest.identity(rank).host
        rank_file = files.get(rank)
        if rank_file is None:
            ranks.append(RankEnd(rank=rank, host=host, has_file=False, closed=False if knows_end else None))
            continue
        last_step, end = _tail(rank_file.records, trace.valid_mask(rank_file))
        ranks.append(
            RankEnd(
                rank=rank,
                host=host,
                last_step=last_step,
                torn_bytes=rank_file.torn_bytes,
                closed=(end is not None) if knows_end else None,
                closed_on_error=end is not None and bool(int(end["flags"]) & F.Flag.CLOSED_ON_ERROR),
            )
        )
    steps = [r.last_step for r in ranks if r.last_step is not None]
    last_step = max(steps) if steps else None
    complete = _last_complete(trace, ranks, attempt)
    finalised = all(r.closed for r in ranks) if knows_end else None
    ragged = len(set(steps)) > 1 or len(steps) < len(ranks)
    stopped = ragged or any(r.cut_short or r.closed_on_error for r in ranks)
    stopped_ranks: tuple[int, ...] = ()
    if stopped:
        behind = [r for r in ranks if r.last_step is None or complete is None or r.last_step <= complete]
        short = [r for r in behind if r.cut_short]
        stopped_ranks = tuple(r.rank for r in (short if short and len(short) < len(behind) else behind))
    return RunEnd(
        attempt=attempt,
        ranks=tuple(ranks),
        last_step=last_step,
        last_complete_step=complete,
        finalised=finalised,
        stopped_early=stopped,
        stopped_ranks=stopped_ranks,
    )


def _tail(records: np.ndarray, mask: np.ndarray) -> tuple[int | None, np.void | None]:
    """``(step of the last valid STEP record, the END record after it)`` of one file, probing
    from its end (a file is in step order, an END record is its last)."""
    size, probe = len(records), 64
    end_record = None
    while True:
        lo = max(0, size - probe)
        kinds = records["kind"][lo:size]
        valid = mask[lo:size]
        steps = np.flatnonzero(valid & (kinds == int(F.Kind.STEP)))
        ends = np.flatnonzero(valid & (kinds == int(F.Kind.END)))
        if steps.size:
            last = lo + int(steps[-1])
            after = ends[lo + ends > last]
            if after.size:
                end_record = records[lo + int(after[-1])]
            return int(records["step"][last]), end_record
        if lo == 0:
            return None, (records[int(ends[-1])] if ends.size else None)
        probe *= 8


def _last_complete(trace, ranks: list[RankEnd], attempt: int) -> int | None:
    """The last step every rank recorded, at or before the ranks' common last step of the attempt."""
    if any(r.last_step is None for r in ranks):
        start = next((a.start_step for a in trace.manifest.attempts if a.attempt == attempt), None)
        # earlier attempts hold the steps before the resume
        candidate = start - 1 if attempt > 0 and start else None
    else:
        candidate = min(r.last_step for r in ranks)
    if candidate is None or candidate < 0:
        return None
    # the candidate itself, nearly always: a small table first
    for lookback in (64, _LOOKBACK_STEPS):
        found = None
        for window in trace.step_windows(
            window=lookback, start=max(0, candidate - lookback + 1), stop=candidate, fields=()
        ):
            rows = np.flatnonzero(window.present.all(axis=1))
            if rows.size:
                found = int(window.steps[rows[-1]])
        if found is not None:
            return found
    return None


def _who(ranks: tuple[int, ...], by_rank: dict[int, RankEnd]) -> str:
    """``rank 1 (host h1)``, ``ranks 0, 2 (hosts h0, h2)`` or ``every rank``."""
    from sdc_forensics.trace.spans import step_ranges

    if len(ranks) == len(by_rank):
        return "every rank"
    hosts = sorted({by_rank[r].host for r in ranks if by_rank[r].host})
    label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {step_ranges(ranks)}"
    return label + (f" (host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})" if hosts else "")
