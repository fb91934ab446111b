"""Verify one checkpoint: its file alone, against its run's trace, and against a certificate.

``verify-checkpoint PATH`` combines three sources into one outcome and exit status:

* the file's own findings (``checkpoint.verify``: readable, every file read or listed, no NaN/Inf);
* with a trace: the checkpoint's status from the run's analysis, which is ``decide.decision``'s
  (``clean`` 0, ``unverified`` 4, ``tainted``/``corrupt`` 1): no checkpoint is called clean here
  unless the one decision module calls it clean;
* with a certificate: the files are still what was certified, and it was certified clean.

Exit status: 1 when the certificate disagrees or did not certify it clean; else the decision's
status with a trace; else (a trace that has no note for the step, or no trace) 1 for a damaged file
(damage, NaN/Inf), 4 when its only findings are files it could not verify (a pickle not loadable
safely, an unknown format; with no note, always at least 4), 0 when it has none. The codes are
``exitcodes.ExitCode``, a status's code ``exitcodes.EXIT_BY_STATUS``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sdc_forensics.exitcodes import ExitCode, status_exit
from sdc_forensics.decide import decision
from sdc_forensics.decide.decision import UNVERIFIABLE_FINDINGS, CheckpointStatus, Status


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyRequest:
    """What to verify.

    Attributes:
        path: the checkpoint file or folder.
        trace_dir: the run's trace (None: the file alone).
        step: the checkpoint's step N (None: from the note naming the file, or the payload).
        trace_only: with a trace, its evidence alone (no replay).
        certificate_path: a certificate to confirm the file against.
    """

    path: Path
    trace_dir: Path | None = None
    step: int | None = None
    trace_only: bool = False
    certificate_path: Path | None = None

    def __post_init__(self) -> None:
        from sdc_forensics.errors import UsageError

        if (self.step is not None or self.trace_only) and self.trace_dir is None:
            raise UsageError("--step and --trace-only need --trace (they select the run to certify against)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyOutcome:
    """Everything ``verify-checkpoint`` concluded.

    Attributes:
        request: what was asked.
        report: the file's verification report (``checkpoint.verify.VerificationReport``).
        status: its status from the run's analysis (None without a trace, or with no note).
        analysis: the run's analysis (``BisectResult``; None without a trace, or with no note).
        missing: why it could not be certified against the trace ("" when it could, or no trace).
        certificate_status: the status the certificate gave it (None without a certificate).
        certificate_findings: where the files differ from the certificate.
        reasons: one sentence per reason it is not verified or certified, most important first.
        exit_code: 0 verified / certified clean, 1 not certifiable, 4 unverified.
    """

    request: VerifyRequest
    report: Any
    status: CheckpointStatus | None = None
    analysis: Any = None
    missing: str = ""
    certificate_status: Status | None = None
    certificate_findings: tuple[Any, ...] = ()
    reasons: tuple[str, ...] = ()
    exit_code: ExitCode = ExitCode.CLEAN

    @property
    def verdict(self) -> str:
        """``verified`` (file alone), ``certified-clean``, ``not-certifiable`` or ``unverified``."""
        if self.exit_code == ExitCode.CLEAN:
            return "verified" if self.request.trace_dir is None else "certified-clean"
        return "unverified" if self.exit_code == ExitCode.UNVERIFIED else "not-certifiable"


def verify_exit(
    report, status: CheckpointStatus | None, missing: str, certificate_findings, certificate_status: Status | None
) -> ExitCode:
    """The exit status of ``verify-checkpoint`` (module docstring); the trace's part is the decision's status."""
    if certificate_findings or (certificate_status is not None and not certificate_status.clean):
        return ExitCode.NOT_CERTIFIABLE
    # the one decision: clean 0, unverified 4, tainted or corrupt 1
    if status is not None:
        return status_exit(status.status)
    # the file alone (or with no note in the trace): damage is 1; only files it could not verify (a pickle not
    # loadable safely, an unknown format) is 4, nothing wrong found, as the decision's unverified is
    damaged = [f for f in report.findings if f.kind not in UNVERIFIABLE_FINDINGS]
    if damaged:
        return ExitCode.NOT_CERTIFIABLE
    return ExitCode.UNVERIFIED if report.findings or missing else ExitCode.CLEAN


def _copy_of(report, notes, wanted: int | None) -> int | None:
    """The other checkpoint whose noted tensor digests ``report``'s tensors all equal, or None."""
    digests = {t.key: t.digest for t in report.tensors}
    for note in notes:
        if note.step != wanted and note.tensors and digests and note.tensors == digests:
            return note.step
    return None


def _earlier_note(path: Path, trace, step: int | None, options):
    """The note of the earlier attempt whose checkpoint file ``path`` is, by its path
    (``files.earlier_attempt_files``), when a later attempt noted that step again elsewhere; else None."""
    from sdc_forensics.forensics.files import earlier_attempt_files

    target = Path(path).resolve()
    mine = [
        note
        for found, note in earlier_attempt_files(trace, options)
        if found.resolve() == target and (step is None or note.step == step)
    ]
    return mine[0] if len(mine) == 1 else None


def verify_run(request: VerifyRequest, options=None, progress=None) -> VerifyOutcome:
    """Verify ``request.path`` (and certify it as part of its run with a trace).

    Args:
        request: what to verify.
        options: :class:`~sdc_forensics.replay.options.AnalysisOptions` for the run's analysis
            (replay settings); its ``trace_only`` and ``checkpoint_paths`` are set here.
        progress: replay progress (``bisect.Progress``), or None.

    Raises:
        UsageError: the certificate has no entry for the file, its seed differs from the trace's,
            or the file's step cannot be told. Reader errors for unreadable inputs.
    """
    from sdc_forensics.checkpoint import VerifyOptions, open_checkpoint, verify_checkpoint
    from sdc_forensics.errors import UsageError
    from sdc_forensics.forensics.bisect import bisect
    from sdc_forensics.decide.certificate import check_against_certificate, read_certificate
    from sdc_forensics.replay.options import AnalysisOptions
    from sdc_forensics.trace.reader import Trace

    path, trace_dir = request.path, request.trace_dir
    cert = read_certificate(request.certificate_path) if request.certificate_path is not None else None
    seed = cert.seed if cert else VerifyOptions().seed
    # opened once, handed down
    trace = Trace.open(trace_dir) if trace_dir is not None else None
    if trace is not None:
        trace_seed = int(trace.manifest.fingerprint.seed)
        if cert and trace_seed != cert.seed:
            raise UsageError(
                f"the trace's fingerprint seed {trace_seed} differs from the certificate's {cert.seed}; check one at a time"
            )
        seed = trace_seed
    entry = None
    if cert is not None:
        entry = cert.entry_for(path)
        if entry is None:
            raise UsageError(
                f"{request.certificate_path} has no entry for {path}; pass the certificate written when this checkpoint was certified"
            )

    notes = trace.checkpoint_notes() if trace is not None else []
    # an earlier attempt's checkpoint another attempt saved again: judged on the trace as that attempt left it
    own = _earlier_note(path, trace, request.step, options) if trace is not None else None
    if own is not None:
        trace = trace.as_of(own.attempt)
        notes = trace.checkpoint_notes()
        options = dataclasses.replace(options if options is not None else AnalysisOptions(), no_ledger=True)
    with open_checkpoint(path) as reader:
        wanted = request.step if own is None else own.step
        if trace_dir is not None and wanted is None:
            named = [n for n in notes if Path(n.path).name == Path(path).name]
            wanted = named[0].step if len(named) == 1 else reader.step()
        noted = wanted is not None and any(n.step == wanted for n in notes)
        # with a note and files read, the analysis verifies the file against its note: read it once
        report = (
            None if noted and not request.trace_only else verify_checkpoint(reader, options=VerifyOptions(seed=seed))
        )

    status, result, missing = None, None, ""
    if trace_dir is not None:
        if wanted is None:
            raise UsageError(
                f"cannot tell which step {path} holds (no note names this file, no 'step' in it): pass --step N"
            )
        if not noted:
            missing = f"no checkpoint note for step {wanted} in {trace_dir}"
        else:
            base = options if options is not None else AnalysisOptions()
            analysis = dataclasses.replace(base, trace_only=request.trace_only, checkpoint_paths={wanted: Path(path)})
            result = bisect(trace, analysis, progress=progress)
            status = next(c for c in result.checkpoints if c.step == wanted)
            if status.report is not None:
                # read against its note (tensor digests as saved)
                report = status.report
    # the analysis could not read it (its status says why): the file's own findings
    if report is None:
        report = verify_checkpoint(path, options=VerifyOptions(seed=seed))
    cert_findings = tuple(check_against_certificate(report, entry)) if entry is not None else ()
    # what the user asked about first: the certificate, when one was passed
    reasons = [f"certificate: {f.kind.value} {f.subject}: {f.detail}" for f in cert_findings]
    if entry is not None and not entry.status.clean:
        reasons.append(f"certificate: it was certified {entry.status.value}, not clean")
    findings = report.findings
    note = next((n for n in notes if n.step == wanted), None) if status is not None else None
    if note is not None and decision.diverged_replica_copy(note, trace.manifest.parallel is not None):
        # a diverged replica's shard, written as it was: its status says so; "storage corruption" would send the
        # operator to the disks (a trial user's TP job with a compute fault before checkpoint 8)
        findings = tuple(f for f in findings if f.kind not in decision.REPLICA_COPY_FINDINGS)
    reasons += [f"{f.kind.value} {f.subject}: {f.detail}" for f in findings]
    if status is not None and not status.clean:
        reasons += [f"{status.status.value}: {r}" for r in status.reasons if r not in reasons]
    if status is not None and not status.clean and request.step is not None and own is None:
        other = _copy_of(report, notes, wanted)
        if other is not None:
            # a mistyped --step is the user's, not the disk's: no "corruption" verdict on it
            raise UsageError(
                f"{path} holds checkpoint {other}'s tensors as noted when it was saved, not checkpoint {wanted}'s "
                f"(--step {wanted}): pass --step {other}, or drop --step to take it from the note naming the file"
            )
    if status is not None and not status.clean and request.step is None:
        other = _copy_of(report, notes, wanted)
        if other is not None:
            # the step came from the file's name: say what the bytes are before any "corruption"
            reasons.insert(
                0,
                f"its tensors are checkpoint {other}'s as noted when it was saved, not checkpoint {wanted}'s: a copy of "
                f"checkpoint {other} under checkpoint {wanted}'s file name (the step was taken from the name), not "
                f"storage damage; pass --step {other}",
            )
    if own is not None:
        reasons.append(
            f"attempt {own.attempt}'s checkpoint {own.step}, which a later attempt saved again elsewhere: judged on "
            f"attempt {own.attempt}'s own steps (the trace as it stood then), not the later attempt's"
        )
    if missing:
        reasons.append(f"not certified against the trace: {missing}")
    code = verify_exit(report, status, missing, cert_findings, entry.status if entry is not None else None)
    return VerifyOutcome(
        request=request,
        report=report,
        status=status,
        analysis=result,
        missing=missing,
        certificate_status=entry.status if entry is not None else None,
        certificate_findings=cert_findings,
        reasons=tuple(reasons),
        exit_code=code,
    )
