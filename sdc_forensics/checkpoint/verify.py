"""Content verification of one checkpoint: per-tensor digests and NaN/Inf, file checksums, and
the comparison with what the recorder noted at save time.

For every tensor (model weights and optimizer state alike): its exact digest
(:func:`sdc_forensics.fingerprint.core.digest`, the recorder's definition) and its count of
NaN/Inf; every file gets a checksum, the exact digest of its bytes on a zero-copy torch view of
its read-only map (``measure.py``, parallel over tensors and files).

Against a :class:`~sdc_forensics.trace.checkpoints.CheckpointNote` (what the recorder noted):

* a tensor digest that differs from the noted one -> ``digest-mismatch`` (storage corruption);
* noted tensors absent from the file, or tensors the note does not know -> missing/unexpected;
* the parameters' combined digest (``statedict`` order, ``param_names``) differs from the
  replicas' majority digest -> ``weights-not-majority`` (written from a diverged replica);
* a file checksum that differs from a noted one -> ``file-checksum-mismatch``.

Without a note: a file the reader could not verify (a checkpoint folder's file that cannot be
loaded safely, of unknown format, or a link out of the folder; ``folder.py``) ->
``not-verifiable``, and any finding at all means the checkpoint is not VERIFIED.

Findings are data (:class:`Finding`); whether they make a checkpoint clean is decided in
``certify.py``; exit codes only in the CLI.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

from sdc_forensics.checkpoint.base import CheckpointReader
from sdc_forensics.checkpoint.findings import ANOTHER_LAYOUT, FindingKind
from sdc_forensics.checkpoint.formats import open_checkpoint
from sdc_forensics.checkpoint.limits import ReadLimits
from sdc_forensics.checkpoint.measure import FileChecksum, default_workers, measure
from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint.core import combine_digests
from sdc_forensics.trace.checkpoints import CheckpointNote, hex64

_PARAM_PREFIXES = ("", "model.", "module.", "model.module.", "state_dict.", "model_state_dict.")
#: Lightning's ModelCheckpoint and EarlyStopping keep their scores in every .ckpt
#: (``callbacks.ModelCheckpoint{...}.kth_value``, ``callbacks.EarlyStopping{...}.best_score``): bookkeeping,
#: not training state, and ±inf by design (kth_value and best_score start at inf for mode "min", before the
#: first validation), so a non-finite value there is not a finding (in a distributed checkpoint, its
#: ``meta.pt/`` file holds them)
_SCORE_KEYS = re.compile(
    r"^(?:[^/]+/)?callbacks\.(?:ModelCheckpoint\{.*\}\.(kth_value|best_model_score|current_score)"
    r"|EarlyStopping\{.*\}\.best_score)$"
)


def is_score(key: str, shape: tuple[int, ...]) -> bool:
    """A Lightning callback's score (:data:`_SCORE_KEYS`), whose ±inf is by design, not a NaN/Inf finding."""
    return bool(_SCORE_KEYS.match(key)) and tuple(shape) in ((), (1,))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finding:
    """One reason against a checkpoint. ``subject`` is a tensor key or a file name."""

    kind: FindingKind
    subject: str
    expected: str = ""
    found: str = ""
    detail: str = ""

    def to_json(self) -> dict:
        """A JSON-ready dict (the kind as its value)."""
        return {
            "kind": self.kind.value,
            "subject": self.subject,
            "expected": self.expected,
            "found": self.found,
            "detail": self.detail,
        }


# slots: one per tensor, a file may list a million
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorResult:
    """What was measured for one tensor. ``expected_digest`` is "" when nothing was noted."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    digest: str
    nonfinite: int
    expected_digest: str = ""

    @property
    def status(self) -> str:
        """``ok``, ``nonfinite``, or ``mismatch`` (differs from the note)."""
        if self.expected_digest and self.expected_digest != self.digest:
            return "mismatch"
        if self.nonfinite:
            # a callback score is ±inf by design: ok, its count still shown
            return "ok" if is_score(self.key, self.shape) else "nonfinite"
        return "ok"


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """How to verify.

    Attributes:
        seed: fingerprint seed (the trace manifest's, when comparing with a trace).
        file_checksums: digest every file's bytes too (needed for certificates).
        populate: pre-fault memory maps (faster when every byte is read anyway).
        workers: parallel measuring tasks; 0 = the cores torch would use (``measure.py``).
        limits: what reading may cost and where links may lead; None = ``limits.current_limits()``
            (what the CLI's ``--max-inflate-bytes``, ``--max-tensors``, ``--allow-root``, ``--allow-numpy`` set).
    """

    seed: int = C.DEFAULT_SEED
    file_checksums: bool = True
    populate: bool = True
    workers: int = 0
    limits: ReadLimits | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerificationReport:
    """Everything measured about one checkpoint and every finding against it.

    Attributes:
        path: the checkpoint as given.
        format: reader format name.
        step: steps the checkpoint holds, from the note or the payload (None if unknown).
        files: checksums of every file.
        tensors: per-tensor results, in file order.
        findings: reasons it is not certifiable (empty = content verifies), ``not-verifiable``
            files included.
        weights_digest: combined parameter digest (hex), "" without ``param_names``.
        noted: whether a checkpoint note was compared.
        seed: fingerprint seed used.
        elapsed_s: wall time of the verification.
        ignored: paths deliberately not read (a folder's ``.git/``, ``.cache/huggingface/``).
    """

    path: str
    format: str
    step: int | None
    files: tuple[FileChecksum, ...]
    tensors: tuple[TensorResult, ...]
    findings: tuple[Finding, ...]
    weights_digest: str = ""
    noted: bool = False
    seed: int = C.DEFAULT_SEED
    elapsed_s: float = 0.0
    ignored: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when nothing was found against the checkpoint (a not-verifiable file is a finding)."""
        return not self.findings

    @property
    def unverifiable(self) -> tuple[str, ...]:
        """Files whose content could not be verified (subjects of ``not-verifiable`` findings)."""
        return tuple(f.subject for f in self.findings if f.kind is FindingKind.NOT_VERIFIABLE)

    @property
    def total_bytes(self) -> int:
        """Sum of the checkpoint's file sizes."""
        return sum(f.size_bytes for f in self.files)


def resolve_param_keys(keys, param_names) -> dict[str, str] | None:
    """Map parameter names to checkpoint keys (``0.weight`` -> ``model.0.weight``), or None."""
    keys = set(keys)
    for prefix in _PARAM_PREFIXES:
        if all(prefix + name in keys for name in param_names):
            return {name: prefix + name for name in param_names}
    return None


def verify_checkpoint(
    source: str | os.PathLike | CheckpointReader,
    *,
    note: CheckpointNote | None = None,
    options: VerifyOptions = VerifyOptions(),
) -> VerificationReport:
    """Verify one checkpoint's content, and compare it with its note when given.

    Args:
        source: a path (opened and closed here) or an already opened reader (left open).
        note: what the recorder noted when this checkpoint was saved.
        options: seed and what to compute.

    Returns:
        A :class:`VerificationReport`; ``report.ok`` when nothing was found.

    Raises:
        CheckpointError: the checkpoint is unreadable or malformed.
    """
    started = time.perf_counter()
    reader = (
        source
        if isinstance(source, CheckpointReader)
        else open_checkpoint(source, populate=options.populate, limits=options.limits)
    )
    try:
        infos = {info.key: info for info in reader.infos()}
        expected = note.tensors if note is not None else {}
        measured, files = measure(
            reader,
            seed=options.seed,
            workers=options.workers or default_workers(),
            file_checksums=options.file_checksums,
            populate=options.populate,
        )
        results = [
            TensorResult(
                key=m.key,
                dtype=m.dtype,
                shape=m.shape,
                file=infos[m.key].file if m.key in infos else "",
                digest=hex64(m.digest),
                nonfinite=m.nonfinite,
                expected_digest=expected.get(m.key, ""),
            )
            for m in measured
        ]
        findings = [
            Finding(kind=FindingKind.FILE_DAMAGED, subject=i.file, detail=i.detail) for i in reader.file_issues()
        ]
        findings += [
            Finding(kind=FindingKind.NOT_VERIFIABLE, subject=i.file, detail=i.detail) for i in reader.unverifiable()
        ]
        findings += [
            Finding(
                kind=FindingKind.NONFINITE,
                subject=r.key,
                expected="0",
                found=str(r.nonfinite),
                detail=f"{r.nonfinite} NaN/Inf value(s)",
            )
            for r in results
            if r.nonfinite and not is_score(r.key, r.shape)
        ]
        weights = ""
        if note is not None:
            weights, weight_findings = _weights_vs_majority(note, {m.key: m.digest for m in measured})
            if note.tensors and results and not any(r.key in note.tensors for r in results):
                # not the noted file's layout (a DeepSpeed folder, a converted or re-saved file): no tensor can be
                # compared with the note, none is missing from it; the weights, where found by name, still are
                findings.append(_another_layout(note, len(results)))
                findings += weight_findings if weights else []
            else:
                findings += _against_note(note, results, files, declined=[i.file for i in reader.unverifiable()])
                findings += weight_findings
        step = note.step if note is not None else reader.step()
        return VerificationReport(
            path=str(reader.path),
            format=reader.format,
            step=step,
            files=files,
            tensors=tuple(results),
            findings=tuple(findings),
            weights_digest=weights,
            noted=note is not None,
            seed=options.seed,
            elapsed_s=time.perf_counter() - started,
            ignored=reader.ignored(),
        )
    finally:
        if reader is not source:
            reader.close()


def _against_note(
    note: CheckpointNote, results: list[TensorResult], files: tuple[FileChecksum, ...], declined: list[str] = ()
) -> list[Finding]:
    """Findings against the save-time note. ``declined``: files the reader did not load (a
    NOT_VERIFIABLE finding each): their noted tensors are not verified, never "absent"."""
    findings = []
    present = {r.key for r in results}
    unread = tuple(f"{name}/" for name in declined)
    for r in results:
        if r.expected_digest and r.expected_digest != r.digest:
            findings.append(
                Finding(
                    kind=FindingKind.DIGEST_MISMATCH,
                    subject=r.key,
                    expected=r.expected_digest,
                    found=r.digest,
                    detail="bytes differ from what was saved (storage corruption)",
                )
            )
        elif note.tensors and r.key not in note.tensors:
            findings.append(
                Finding(
                    kind=FindingKind.UNEXPECTED_TENSOR,
                    subject=r.key,
                    found=r.digest,
                    detail="not in the checkpoint note",
                )
            )
    for key, value in note.tensors.items():
        if key not in present and not key.startswith(unread) and key not in declined:
            findings.append(
                Finding(
                    kind=FindingKind.MISSING_TENSOR,
                    subject=key,
                    expected=value,
                    detail="noted at save time, absent from the file",
                )
            )
    by_name = {Path(f.name).name: f for f in files}
    for name, value in note.file_digests.items():
        mine = by_name.get(Path(name).name)
        if mine is not None and mine.digest != value:
            findings.append(
                Finding(
                    kind=FindingKind.FILE_CHECKSUM_MISMATCH,
                    subject=mine.name,
                    expected=value,
                    found=mine.digest,
                    detail="file bytes changed since saving",
                )
            )
    return findings


def _another_layout(note: CheckpointNote, count: int) -> Finding:
    """A file none of whose tensors is named as checkpoint ``note``'s were: not verifiable against it."""
    return Finding(
        kind=FindingKind.NOT_VERIFIABLE,
        subject=ANOTHER_LAYOUT,
        expected=f"the tensors checkpoint {note.step} noted ({len(note.tensors)})",
        detail=f"none of its {count} tensors is named as checkpoint {note.step}'s noted ones (another layout: a DeepSpeed "
        f"folder, a converted or re-saved file), so it cannot be compared with the trace's note; verify the file the "
        f"recorder noted ({Path(note.path).name}) against the trace",
    )


def _weights_vs_majority(note: CheckpointNote, digests: dict[str, int]) -> tuple[str, list[Finding]]:
    """The parameters' combined digest, and a finding when it is not the replicas' majority."""
    if not note.param_names:
        return "", []
    keys = resolve_param_keys(digests, note.param_names)
    if keys is None:
        missing = [n for n in note.param_names if not any(p + n in digests for p in _PARAM_PREFIXES)]
        return "", [
            Finding(
                kind=FindingKind.WEIGHTS_NOT_MAJORITY,
                subject="parameters",
                expected=note.weights_digest,
                detail=f"{len(missing)} noted parameter(s) not found in the checkpoint, e.g. {missing[:3]}",
            )
        ]
    combined = hex64(combine_digests(digests[keys[name]] for name in note.param_names))
    if note.weights_digest and combined != note.weights_digest:
        return combined, [
            Finding(
                kind=FindingKind.WEIGHTS_NOT_MAJORITY,
                subject="parameters",
                expected=note.weights_digest,
                found=combined,
                detail="parameters are not the replicas' majority weights for this step",
            )
        ]
    return combined, []
