"""Certification: every checkpoint of a run gets a status with reasons; the last clean one is
the resume point.

The library API is :func:`certify_checkpoints` (what ``certify`` runs), :func:`decide` (one
checkpoint, what ``bisect`` runs) and :func:`last_clean` (the resume point).

The rule (design brief, "Conventions"): with first divergent step ``s*`` (``θ_{s*}`` clean,
``θ_{s*+1}`` not), checkpoint ``N`` (``θ_N``) is clean only if ``N <= s*`` (or no divergence was
found), its file verifies (structure, no NaN/Inf, every tensor digest equal to the one noted at
save time) and its parameters' combined digest equals the replicas' majority digest recorded
for that step. Statuses:

* ``corrupt``: unreadable/malformed, NaN/Inf, digests that differ from the note (storage), or
  content that is not the majority's (written from a diverged replica, or not blessed);
* ``tainted``: readable and as saved, but ``N > s*``: it holds state after the divergence;
* ``clean-replay-verified``: clean, and a replay from it reproduced the trace;
* ``clean-trace-consistent``: clean by the trace's evidence, not replayed;
* ``unverified``: cannot be decided (file not found, no majority digest recorded, trace not
  consistent enough to trust).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from sdc_forensics.checkpoint.verify import Finding, VerificationReport, VerifyOptions, verify_checkpoint
from sdc_forensics.errors import CheckpointError
from sdc_forensics.trace.checkpoints import CheckpointNote


class Status(str, enum.Enum):
    """Certification status of one checkpoint."""

    CLEAN_REPLAY_VERIFIED = "clean-replay-verified"
    CLEAN_TRACE_CONSISTENT = "clean-trace-consistent"
    TAINTED = "tainted"
    CORRUPT = "corrupt"
    UNVERIFIED = "unverified"

    @property
    def clean(self) -> bool:
        """True for the two clean statuses."""
        return self in (Status.CLEAN_REPLAY_VERIFIED, Status.CLEAN_TRACE_CONSISTENT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointStatus:
    """The decision about one checkpoint.

    Attributes:
        step: ``N``, the completed steps it holds.
        path: the file or directory verified ("" if it was not found).
        status: the :class:`Status`.
        reasons: one human sentence per reason, most important first.
        findings: the verification findings behind a ``corrupt`` status.
        report: the verification report (None when the file could not be read or found).
    """

    step: int
    path: str
    status: Status
    reasons: tuple[str, ...]
    findings: tuple[Finding, ...] = ()
    report: VerificationReport | None = None

    @property
    def clean(self) -> bool:
        """True when this checkpoint may be resumed from."""
        return self.status.clean


def locate_checkpoint(
    note: CheckpointNote,
    checkpoints: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    base_dir: str | os.PathLike | None = None,
) -> Path | None:
    """The file of ``note``: by name in ``checkpoints`` (a directory or a list of paths), else
    the path the job wrote (as is, then relative to ``base_dir``); None if not found."""
    name = Path(note.path).name
    if isinstance(checkpoints, (str, os.PathLike)):
        candidate = Path(checkpoints) / name
        return candidate if candidate.exists() else None
    if checkpoints is not None:
        for path in checkpoints:
            if Path(path).name == name:
                return Path(path)
        return None
    written = Path(note.path)
    if written.exists():
        return written
    if base_dir is not None and not written.is_absolute() and (Path(base_dir) / written).exists():
        return Path(base_dir) / written
    return None


def decide(
    note: CheckpointNote,
    *,
    report: VerificationReport | None,
    error: str = "",
    path: str = "",
    first_divergent_step: int | None,
    replay_verified: bool = False,
    trace_consistent: bool = True,
    majority_digest: str | None = None,
) -> CheckpointStatus:
    """The status of one checkpoint from its verification (``report``, or ``error`` if unreadable).

    ``majority_digest`` is the weights digest the trace's STEP records hold for ``θ_N`` by strict
    majority (when the caller computed it); it must agree with the note's.
    """
    step = note.step
    if report is None and not error:
        return CheckpointStatus(step=step, path=path, status=Status.UNVERIFIED, reasons=(f"checkpoint file {note.path} not found",))
    if error:
        return CheckpointStatus(step=step, path=path, status=Status.CORRUPT, reasons=(f"unreadable or malformed: {error}",))
    corrupt: list[str] = [f"{f.kind.value} {f.subject}: {f.detail}" for f in report.findings]
    if not note.blessed and not note.agreeing_ranks:
        corrupt.insert(0, f"saved from rank {note.saved_by_rank} with no strict majority among the replicas: "
                          "it may be a diverged replica, and the recorder did not bless it")
    elif note.saved_by_rank in note.diverged_ranks:
        corrupt.insert(0, f"saved from rank {note.saved_by_rank}, a diverged replica (not the majority's weights)")
    elif not note.blessed:
        corrupt.insert(0, "the recorder refused to bless it (no strict majority, or the saving rank was not in it)")
    if majority_digest and note.weights_digest and majority_digest != note.weights_digest:
        corrupt.append(f"the note's majority digest {note.weights_digest} differs from the trace's majority {majority_digest} for step {step}")
    tainted = first_divergent_step is not None and step > first_divergent_step
    taint_reason = f"holds state after the first divergent step {first_divergent_step} (step {step} > {first_divergent_step})"
    if corrupt:
        reasons = corrupt + ([taint_reason] if tainted else [])
        return CheckpointStatus(step=step, path=path, status=Status.CORRUPT, reasons=tuple(reasons), findings=report.findings, report=report)
    if tainted:
        return CheckpointStatus(step=step, path=path, status=Status.TAINTED, reasons=(taint_reason,), report=report)
    if not note.weights_digest:
        return CheckpointStatus(
            step=step, path=path, status=Status.UNVERIFIED, report=report,
            reasons=("no replicas' majority digest was recorded for this step, so its content cannot be confirmed",),
        )
    where = "no divergence found" if first_divergent_step is None else f"step {step} <= first divergent step {first_divergent_step}"
    content = "content as noted at save time and equal to the replicas' majority, no NaN/Inf"
    if replay_verified:
        return CheckpointStatus(step=step, path=path, status=Status.CLEAN_REPLAY_VERIFIED, report=report, reasons=(where, content, "a replay from it reproduced the trace"))
    if trace_consistent:
        return CheckpointStatus(step=step, path=path, status=Status.CLEAN_TRACE_CONSISTENT, report=report, reasons=(where, content, "not replayed"))
    return CheckpointStatus(
        step=step, path=path, status=Status.UNVERIFIED, report=report,
        reasons=(content, "the trace is damaged or inconsistent around it; replay from it to confirm"),
    )


def certify_checkpoints(
    notes: Sequence[CheckpointNote],
    *,
    checkpoints: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    first_divergent_step: int | None,
    replay_verified_steps: Collection[int] = frozenset(),
    trace_consistent: bool = True,
    majority_digests: Mapping[int, str] | None = None,
    base_dir: str | os.PathLike | None = None,
    options: VerifyOptions = VerifyOptions(),
) -> list[CheckpointStatus]:
    """Verify and certify every noted checkpoint of a run.

    Args:
        notes: the run's checkpoint notes (``trace.checkpoints.read_checkpoint_notes``).
        checkpoints: where the files are: a directory (matched by file name), a list of paths,
            or None for the paths the job wrote (relative ones resolved against ``base_dir``).
        first_divergent_step: ``s*``, or None when no divergence was found.
        replay_verified_steps: checkpoint steps a replay started from and confirmed.
        trace_consistent: False when the trace is too damaged to trust its evidence.
        majority_digests: optional ``{N: hex}`` majority weights digest of ``θ_N`` from STEP records.
        base_dir: directory that relative note paths are relative to.
        options: verification options (seed).

    Returns:
        One :class:`CheckpointStatus` per note, sorted by step.
    """
    statuses = []
    for note in sorted(notes, key=lambda n: n.step):
        path = locate_checkpoint(note, checkpoints, base_dir)
        report, error = None, ""
        if path is not None:
            try:
                report = verify_checkpoint(path, note=note, options=options)
            except CheckpointError as exc:
                error = str(exc)
        statuses.append(
            decide(
                note,
                report=report,
                error=error,
                path=str(path) if path is not None else "",
                first_divergent_step=first_divergent_step,
                replay_verified=note.step in replay_verified_steps,
                trace_consistent=trace_consistent,
                majority_digest=(majority_digests or {}).get(note.step),
            )
        )
    return statuses


def unnoted_checkpoints(notes: Sequence[CheckpointNote], directory: str | os.PathLike) -> list[Path]:
    """Checkpoint-looking entries of ``directory`` that no note names: saved without the recorder
    seeing it (or its note was lost), so nothing can be certified about them."""
    from sdc_forensics.checkpoint.formats import TORCH_SUFFIXES

    noted = {Path(n.path).name for n in notes}
    out = []
    for entry in sorted(Path(directory).iterdir()):
        if entry.name in noted:
            continue
        looks = entry.is_file() and entry.suffix in (*TORCH_SUFFIXES, ".safetensors")
        looks = looks or (entry.is_dir() and ((entry / ".metadata").exists() or any(entry.glob("*.safetensors"))))
        if looks:
            out.append(entry)
    return out


def last_clean(statuses: Sequence[CheckpointStatus]) -> CheckpointStatus | None:
    """The clean checkpoint with the highest step: the resume point (None if there is none)."""
    clean = [s for s in statuses if s.clean]
    return max(clean, key=lambda s: s.step) if clean else None
