"""Certify a run's checkpoints: the analysis of ``bisect``, read as "where do I resume?".

Every noted checkpoint gets its status from ``decide.decision`` (through the analysis); this
module adds what certification needs on top: the checkpoint-looking files no note names, the
resume point, and the exit status (docs/bisect.md, "certify"; the codes are ``exitcodes.ExitCode``):

* 0 — the analysis reached a verdict (clean or corruption) and a checkpoint is certified clean:
  resume from the last clean one. Tainted or corrupt checkpoints after it are still listed, and
  the analysis verdict is in the JSON;
* 1 — no checkpoint is clean, and corruption was found or some checkpoint is tainted or corrupt
  (with no checkpoint notes at all: corruption was found);
* 4 — the analysis is inconclusive (even with checkpoint 0 clean: no resume point is named), or
  no checkpoint is clean and nothing wrong was found: unverified (with no notes: nothing found).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from collections.abc import Sequence
from pathlib import Path

from sdc_forensics.exitcodes import ExitCode, status_exit, verdict_exit
from sdc_forensics.decide.decision import CheckpointStatus, Verdict, last_clean
from sdc_forensics.decide.coverage import Coverage, coverage_of, with_details
from sdc_forensics.decide.verdict import BisectResult
from sdc_forensics.forensics.intervals import ledger_records


@dataclasses.dataclass(frozen=True, kw_only=True)
class Certification:
    """What ``certify`` concluded about a run.

    Attributes:
        trace_dir: the trace certified.
        analysis: the analysis (``bisect``) it is based on: verdict, statuses, evidence.
        unnoted: checkpoint-looking files in the checkpoint folders that no note names.
        replaced: ``(file, note)`` of an earlier attempt's checkpoint that a later attempt noted again
            (a resumed run's older files, still on disk): judged by ``verify-checkpoint FILE --trace``.
        exit_code: :func:`certify_exit` of the statuses and the verdict.
        coverage: what examined the steps before each checkpoint (:func:`coverage_of`).
    """

    trace_dir: Path
    analysis: BisectResult
    unnoted: tuple[Path, ...] = ()
    replaced: tuple[tuple[Path, Any], ...] = ()
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

    0 only when the analysis reached a verdict (clean or corruption) and a checkpoint is certified
    clean: an ``inconclusive`` analysis is 4 even when checkpoint 0 is clean (a wrong recipe or a
    run with dropout certifies nothing after it, and ``certify && resume`` would throw the run
    away). Otherwise the code of the best checkpoint status (clean before unverified before not
    certifiable), but with no clean checkpoint a verdict of corruption makes it not certifiable.
    """
    if verdict_exit(verdict) == ExitCode.INCONCLUSIVE:
        return ExitCode.INCONCLUSIVE
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
    from sdc_forensics.forensics.files import earlier_attempt_files
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes
    from sdc_forensics.errors import UsageError
    from sdc_forensics.forensics.bisect import bisect
    from sdc_forensics.trace.reader import Trace

    folder = options.checkpoints_dir
    if folder is not None and not Path(folder).is_dir():
        raise UsageError(f"--checkpoints {folder} is not a directory")
    trace = Trace.of(trace_dir)
    result = bisect(trace, options, progress=progress)
    # every attempt's notes: a resumed run's earlier files are noted, by the attempt that saved them
    notes = read_checkpoint_notes(trace.path, every_attempt=True)
    folders = {Path(folder)} if folder is not None else {Path(s.path).parent for s in result.checkpoints if s.path}
    unnoted = tuple(p for f in sorted(folders) if f.is_dir() for p in unnoted_checkpoints(notes, f))
    replaced = tuple(earlier_attempt_files(trace, options))
    coverage = with_details(
        coverage_of(result), trace, ledger_records(trace.path, options.ledger_path, options.no_ledger)
    )
    return Certification(
        trace_dir=Path(trace.path),
        analysis=result,
        unnoted=unnoted,
        replaced=replaced,
        exit_code=certify_exit(result.checkpoints, result.verdict),
        coverage=coverage,
    )


def write_run_certificate(path: str | os.PathLike, certification: Certification, *, force: bool = False) -> Path:
    """Write the certificate of ``certification`` to ``path`` (atomically; see ``decide.certificate``)."""
    from sdc_forensics.decide.certificate import build_certificate, write_certificate

    result = certification.analysis
    cert = build_certificate(
        result.checkpoints,
        trace_dir=certification.trace_dir,
        first_divergent_step=result.first_divergent_step,
        seed=result.seed,
    )
    return write_certificate(path, cert, force=force)
