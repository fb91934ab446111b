"""Certify a run's checkpoints: the analysis of ``bisect``, read as "where do I resume?".

Every noted checkpoint gets its status from ``decide.decision`` (through the analysis); this
module adds what certification needs on top: the checkpoint-looking files no note names, the
resume point, and the exit status (docs/bisect.md, "certify"; the codes are ``exitcodes.ExitCode``):

* 0 — a checkpoint is certified clean: resume from the last clean one. Tainted or corrupt
  checkpoints after it are still listed, and the analysis verdict is in the JSON;
* 1 — no checkpoint is clean, and corruption was found or some checkpoint is tainted or corrupt
  (with no checkpoint notes at all: corruption was found);
* 4 — no checkpoint is clean and nothing wrong was found: unverified (with no notes: nothing found).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from sdc_forensics.exitcodes import ExitCode, status_exit, verdict_exit
from sdc_forensics.decide.decision import CheckpointStatus, Verdict, last_clean
from sdc_forensics.decide.verdict import BisectResult


Span = tuple[int, int]  # (first, last) steps, inclusive


@dataclasses.dataclass(frozen=True, kw_only=True)
class Coverage:
    """What examined the steps before checkpoint ``step`` (``first_step .. step - 1``), as step spans.

    Each step is counted once, under the strongest examination it had: exact replay (now, or
    earlier and reused from the ledger), then tolerant replay, then the trace's online checks
    alone, then nothing (no trace record of it).

    Attributes:
        step: ``N``.
        exact_now: replayed bit for bit by this analysis.
        exact_ledger: replayed bit for bit earlier, taken from the ledger (``record_ids``).
        tolerant: replayed and compared within tolerance only.
        online_only: recorded in the trace (online checks ran) but not replayed.
        nothing: not recorded in the trace at all.
        record_ids: the ledger records behind ``exact_ledger``.
    """

    step: int
    exact_now: tuple[Span, ...] = ()
    exact_ledger: tuple[Span, ...] = ()
    tolerant: tuple[Span, ...] = ()
    online_only: tuple[Span, ...] = ()
    nothing: tuple[Span, ...] = ()
    record_ids: tuple[str, ...] = ()

    @property
    def lacking_replay(self) -> tuple[Span, ...]:
        """Steps before ``N`` without an exact replay: what keeps it from being certified."""
        return _merge([*self.tolerant, *self.online_only, *self.nothing])


def coverage_of(result: BisectResult) -> tuple[Coverage, ...]:
    """:class:`Coverage` of every checkpoint of ``result`` (from its windows and the ledger windows it reused)."""
    first = result.step_range[0] if result.step_range else 0
    traced = [result.step_range] if result.step_range else []
    now_exact, now_tolerant = [], []
    for w in result.replayed.windows:
        if w.last < w.start:
            continue
        cut = w.last + 1 if w.tolerant_from is None else max(w.start, w.tolerant_from)
        if cut > w.start:
            now_exact.append((w.start, cut - 1))
        if cut <= w.last:
            now_tolerant.append((cut, w.last))
    ledger = result.replayed.ledger
    reused = [(w.start, w.last, w.record_ids) for w in ledger.reused] if ledger is not None else []
    out = []
    for c in result.checkpoints:
        before = [(first, c.step - 1)] if c.step > first else []
        exact_now = _clip(now_exact, before)
        exact_ledger = _minus(_clip([(a, b) for a, b, _ in reused], before), exact_now)
        exact = _merge([*exact_now, *exact_ledger])
        tolerant = _minus(_clip(now_tolerant, before), exact)
        online = _minus(_minus(_clip(traced, before), exact), tolerant)
        nothing = _minus(_minus(_minus(before, exact), tolerant), online)
        ids = tuple(dict.fromkeys(i for a, b, rec in reused if a < c.step for i in rec))
        out.append(Coverage(step=c.step, exact_now=exact_now, exact_ledger=exact_ledger, tolerant=tolerant, online_only=online,
                            nothing=nothing, record_ids=ids))
    return tuple(out)


def _merge(spans) -> tuple[Span, ...]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def _clip(spans, within) -> tuple[Span, ...]:
    return _merge((max(a, lo), min(b, hi)) for a, b in spans for lo, hi in within if max(a, lo) <= min(b, hi))


def _minus(spans, taken) -> tuple[Span, ...]:
    out = []
    for a, b in _merge(spans):
        for lo, hi in _merge(taken):
            if hi < a or lo > b:
                continue
            if lo > a:
                out.append((a, lo - 1))
            a = max(a, hi + 1)
            if a > b:
                break
        if a <= b:
            out.append((a, b))
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Certification:
    """What ``certify`` concluded about a run.

    Attributes:
        trace_dir: the trace certified.
        analysis: the analysis (``bisect``) it is based on: verdict, statuses, evidence.
        unnoted: checkpoint-looking files in the checkpoint folders that no note names.
        exit_code: :func:`certify_exit` of the statuses and the verdict.
        coverage: what examined the steps before each checkpoint (:func:`coverage_of`).
    """

    trace_dir: Path
    analysis: BisectResult
    unnoted: tuple[Path, ...] = ()
    exit_code: ExitCode = ExitCode.UNVERIFIED
    coverage: tuple[Coverage, ...] = ()

    @property
    def checkpoints(self) -> tuple[CheckpointStatus, ...]:
        return self.analysis.checkpoints

    @property
    def resume(self) -> CheckpointStatus | None:
        """The last checkpoint certified clean: where to resume (None: nowhere safe)."""
        return last_clean(self.analysis.checkpoints)


def certify_exit(statuses: Sequence[CheckpointStatus], verdict: Verdict) -> ExitCode:
    """The exit status of ``certify``: it answers "is there a checkpoint to resume from?".

    The code of the best checkpoint status (clean before unverified before not certifiable), but
    with no clean checkpoint a verdict of corruption makes it not certifiable.
    """
    codes = [status_exit(s.status) for s in statuses]
    if ExitCode.CLEAN in codes:
        return ExitCode.CLEAN
    if verdict_exit(verdict) == ExitCode.CORRUPTION or ExitCode.NOT_CERTIFIABLE in codes:
        return ExitCode.NOT_CERTIFIABLE
    return ExitCode.UNVERIFIED


def certify(trace_dir: str | os.PathLike, options, progress=None) -> Certification:
    """Run the analysis on ``trace_dir`` and certify every noted checkpoint.

    Args:
        trace_dir: the trace directory.
        options: :class:`~sdc_forensics.replay.options.AnalysisOptions` (``checkpoints_dir``,
            replay settings, ``trace_only``).
        progress: replay progress (``bisect.Progress``), or None.

    Raises:
        UsageError: ``options.checkpoints_dir`` is not a directory. Whatever ``bisect`` raises.
    """
    from sdc_forensics.checkpoint.locate import unnoted_checkpoints
    from sdc_forensics.errors import UsageError
    from sdc_forensics.forensics.bisect import bisect
    from sdc_forensics.trace.reader import Trace

    folder = options.checkpoints_dir
    if folder is not None and not Path(folder).is_dir():
        raise UsageError(f"--checkpoints {folder} is not a directory")
    trace = Trace.of(trace_dir)
    result = bisect(trace, options, progress=progress)
    notes = trace.checkpoint_notes()
    folders = {Path(folder)} if folder is not None else {Path(s.path).parent for s in result.checkpoints if s.path}
    unnoted = tuple(p for f in sorted(folders) if f.is_dir() for p in unnoted_checkpoints(notes, f))
    return Certification(trace_dir=Path(trace.path), analysis=result, unnoted=unnoted,
                         exit_code=certify_exit(result.checkpoints, result.verdict), coverage=coverage_of(result))


def write_run_certificate(path: str | os.PathLike, certification: Certification, *, force: bool = False) -> Path:
    """Write the certificate of ``certification`` to ``path`` (atomically; see ``decide.certificate``)."""
    from sdc_forensics.decide.certificate import build_certificate, write_certificate

    result = certification.analysis
    cert = build_certificate(result.checkpoints, trace_dir=certification.trace_dir,
                             first_divergent_step=result.first_divergent_step, seed=result.seed)
    return write_certificate(path, cert, force=force)
