"""Certificates: the JSON record of a certification, checked later against the files.

Layout (sorted keys, 1-space indent)::

    {"format": "sdc-forensics-certificate", "certificate_version": 2,
     "tool_version": "0.1.0", "created_utc": "2026-11-29T09:00:00Z", "seed": SEED,
     "trace_dir": "...", "first_divergent_step": S | null,
     "resume_step": N | null, "resume_path": "..." | null,
     "checkpoints": [{"step": N, "path": "...", "status": "clean", "reasons": [...],
                      "format": "torch", "weights_digest": "hex16",
                      "files": [{"name": "step-00000004.pt", "size_bytes": B, "digest": "hex16"}],
                      "evidence": [{"kind": ..., "subject": ..., "expected": ..., "found": ..., "detail": ...}]}]}

Statuses are ``decide.decision.Status`` values. Version 1 certificates (whose "clean" did not
require every earlier step to be replayed) are refused with a line asking to certify again.
A file's checksum is the exact digest of its bytes (``verify.FileChecksum``); confirming a file
later means recomputing it with the certificate's seed and comparing, file by file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from sdc_forensics import __version__
from sdc_forensics.checkpoint.verify import FileChecksum, Finding, FindingKind, VerificationReport
from sdc_forensics.errors import InvalidInputError, reader
from sdc_forensics.fingerprint import constants as C
from sdc_forensics.decide.decision import CheckpointStatus, Status, last_clean
from sdc_forensics.trace.format import MAX_STEP
from sdc_forensics.untrusted import Fields, describe, is_int, load_json

FORMAT_NAME = "sdc-forensics-certificate"
# 2: statuses clean / unverified / tainted / corrupt from decide.decision
CERTIFICATE_VERSION = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class CertifiedCheckpoint:
    """One checkpoint's entry in a certificate."""

    step: int
    path: str
    status: Status
    reasons: tuple[str, ...]
    format: str = ""
    weights_digest: str = ""
    files: tuple[FileChecksum, ...] = ()
    evidence: tuple[Finding, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Certificate:
    """A certification of a run's checkpoints."""

    tool_version: str
    created_utc: str
    seed: int
    trace_dir: str
    first_divergent_step: int | None
    resume_step: int | None
    resume_path: str | None
    checkpoints: tuple[CertifiedCheckpoint, ...]

    def entry_for(self, path: str | os.PathLike) -> CertifiedCheckpoint | None:
        """The entry of ``path``: same resolved path, else the one entry with that file name."""
        target = Path(path).resolve()
        for entry in self.checkpoints:
            if entry.path and Path(entry.path).resolve() == target:
                return entry
        by_name = [e for e in self.checkpoints if e.path and Path(e.path).name == target.name]
        return by_name[0] if len(by_name) == 1 else None


def build_certificate(
    statuses: Sequence[CheckpointStatus],
    *,
    trace_dir: str | os.PathLike,
    first_divergent_step: int | None,
    seed: int = C.DEFAULT_SEED,
) -> Certificate:
    """A :class:`Certificate` of ``statuses`` (``BisectResult.checkpoints``: ``decide.decision``)."""
    resume = last_clean(statuses)
    entries = []
    for s in statuses:
        report = s.report
        entries.append(
            CertifiedCheckpoint(
                step=s.step,
                path=str(Path(s.path).resolve()) if s.path else "",
                status=s.status,
                reasons=s.reasons,
                format=report.format if report else "",
                weights_digest=report.weights_digest if report else "",
                files=report.files if report else (),
                evidence=s.findings,
            )
        )
    return Certificate(
        tool_version=__version__,
        created_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        seed=seed,
        trace_dir=str(Path(trace_dir).resolve()),
        first_divergent_step=first_divergent_step,
        resume_step=resume.step if resume else None,
        resume_path=str(Path(resume.path).resolve()) if resume else None,
        checkpoints=tuple(entries),
    )


def certificate_to_json(cert: Certificate) -> dict:
    """The certificate as a JSON-ready dict (enums as their values)."""
    doc = dataclasses.asdict(cert)
    for entry in doc["checkpoints"]:
        entry["status"] = Status(entry["status"]).value
        for finding in entry["evidence"]:
            finding["kind"] = FindingKind(finding["kind"]).value
    return {"format": FORMAT_NAME, "certificate_version": CERTIFICATE_VERSION, **doc}


def write_certificate(path: str | os.PathLike, cert: Certificate, *, force: bool = False) -> Path:
    """Write ``cert`` to ``path`` whole or not at all, never over an existing file unless ``force``.

    Raises:
        UsageError: ``path`` exists and ``force`` is False.
    """
    from sdc_forensics.newfile import write_new_file

    path = Path(path)
    write_new_file(
        path,
        force,
        lambda handle: handle.write(json.dumps(certificate_to_json(cert), indent=1, sort_keys=True) + "\n"),
        flag="--certificate-out",
    )
    return path


_HINT = "it was not written by sdc-forensics or is damaged: run `sdc-forensics certify TRACE_DIR --certificate-out FILE` again"


def _enum(f: Fields, key: str, enum_cls):
    value = f.str(key)
    try:
        return enum_cls(value)
    except ValueError:
        raise f.fail(key, "one of " + ", ".join(m.value for m in enum_cls), value) from None


def _path(f: Fields, key: str, *args, **kwargs) -> str | None:
    """A string field that names a file: no NUL byte, encodable for the file system (``f.str``'s arguments)."""
    value = f.str(key, *args, **kwargs)
    if value is not None:
        try:
            if "\0" in value:
                raise ValueError
            os.fsencode(value)
        # Path.resolve() would raise it later, outside the reader
        except (ValueError, UnicodeError):
            raise f.fail(key, "a file path (no NUL byte, no lone surrogate)", value) from None
    return value


def _file_checksum(doc, where: str) -> FileChecksum:
    f = Fields(doc, where, InvalidInputError, _HINT)
    return FileChecksum(
        name=f.str("name"), size_bytes=f.int("size_bytes", lo=0, hi=(1 << 63) - 1), digest=f.str("digest", max_len=64)
    )


def _finding(doc, where: str) -> Finding:
    f = Fields(doc, where, InvalidInputError, _HINT)
    return Finding(
        kind=_enum(f, "kind", FindingKind),
        **{key: f.str(key, "") for key in ("subject", "expected", "found", "detail")},
    )


def _entry(doc, where: str) -> CertifiedCheckpoint:
    f = Fields(doc, where, InvalidInputError, _HINT)
    return CertifiedCheckpoint(
        step=f.int("step", lo=0, hi=MAX_STEP),
        path=_path(f, "path"),
        status=_enum(f, "status", Status),
        reasons=f.strs("reasons", ()),
        format=f.str("format", "", max_len=64),
        weights_digest=f.str("weights_digest", "", max_len=64),
        files=tuple(_file_checksum(x, f"{where}, file {i}") for i, x in enumerate(f.list("files", ()))),
        evidence=tuple(_finding(x, f"{where}, evidence {i}") for i, x in enumerate(f.list("evidence", ()))),
    )


@reader
def read_certificate(path: str | os.PathLike) -> Certificate:
    """Read and validate a certificate; raises :class:`InvalidInputError` if it is not one.

    Every field is type- and range-checked here (a number where a path belongs, a list where a
    status belongs, JSON nested deeper than Python can decode all end in one line).
    """
    path = Path(path)
    try:
        doc = load_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{path} is not a readable JSON certificate ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise InvalidInputError(f'{path} is not an sdc-forensics certificate (no "format": "{FORMAT_NAME}")')
    version = doc.get("certificate_version")
    if not is_int(version) or version != CERTIFICATE_VERSION:
        raise InvalidInputError(
            f"{path} has certificate version {version if is_int(version) else describe(version)}; this tool reads "
            f"{CERTIFICATE_VERSION}: run `sdc-forensics certify TRACE_DIR --certificate-out FILE` again"
        )
    f = Fields(doc, str(path), InvalidInputError, _HINT)
    return Certificate(
        tool_version=f.str("tool_version", "", max_len=256),
        created_utc=f.str("created_utc", "", max_len=256),
        seed=f.int("seed", lo=0, hi=(1 << 64) - 1),
        trace_dir=_path(f, "trace_dir", ""),
        first_divergent_step=f.int("first_divergent_step", None, lo=0, hi=MAX_STEP, none=True),
        resume_step=f.int("resume_step", None, lo=0, hi=MAX_STEP, none=True),
        resume_path=_path(f, "resume_path", None, none=True),
        checkpoints=tuple(_entry(e, f"{path}, checkpoint entry {i}") for i, e in enumerate(f.list("checkpoints"))),
    )


def check_against_certificate(report: VerificationReport, entry: CertifiedCheckpoint) -> list[Finding]:
    """Findings when ``report``'s files are not what ``entry`` certified (or it was not clean)."""
    findings = []
    mine = {f.name: f for f in report.files}
    for certified in entry.files:
        now = mine.get(certified.name)
        if now is None:
            findings.append(
                Finding(
                    kind=FindingKind.FILE_CHECKSUM_MISMATCH,
                    subject=certified.name,
                    expected=certified.digest,
                    detail="certified file is missing now",
                )
            )
        elif now.digest != certified.digest or now.size_bytes != certified.size_bytes:
            findings.append(
                Finding(
                    kind=FindingKind.FILE_CHECKSUM_MISMATCH,
                    subject=certified.name,
                    expected=certified.digest,
                    found=now.digest,
                    detail="file changed since it was certified",
                )
            )
    if not entry.files:
        findings.append(
            Finding(
                kind=FindingKind.FILE_CHECKSUM_MISMATCH,
                subject=entry.path,
                detail="the certificate holds no file checksums for it",
            )
        )
    return findings
