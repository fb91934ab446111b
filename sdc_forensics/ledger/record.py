"""One ledger record: an examined checkpoint interval, as a frozen dataclass and as one JSON line.

Layout, version 1 (``docs/trace-format.md``, "Ledger")::

    {"attempt": 0, "comparison": "exact", "created_utc": "2026-12-01T09:00:00Z",
     "device": "cpu", "device_s": 0.0, "evidence": [], "last_step": 19,
     "ledger_version": 1, "outcome": "clean", "record_id": "9f1c…(32 hex)",
     "reduction": "gloo-ring", "settings": {...}, "start": CHECKPOINT, "start_step": 10,
     "stop": CHECKPOINT | null, "stop_step": 20, "tool_version": "0.1.0", "wall_s": 12.5,
     "sha256": "64 hex"}

    CHECKPOINT = {"step": 10, "path": "checkpoints/step-00000010.pt",
                  "weights_digest": "hex16", "tensors_digest": "64 hex" | "",
                  "files": [{"name": "step-00000010.pt", "size_bytes": B, "mtime_ns": T,
                             "sample_sha256": "64 hex"}]}
    EVIDENCE   = {"kind": "replay_mismatch", "step": 13, "ranks": [2],
                  "strength": "strong", "detail": "..."}

A line is the canonical JSON of the record (keys sorted, no spaces, ASCII, no NaN) followed by
``\\n``; ``sha256`` is the SHA-256 of the canonical JSON of every other key. The checksum finds a
damaged, torn or hand-edited record; it is not a signature (anyone who can write the file can
compute it), which is why a record is also bound to the trace: its checkpoint digests must still
be the trace's (``ledger/reuse.py``).

The interval ``[start_step, stop_step]`` is the replay from checkpoint ``start_step`` (it holds
``θ_start``) through steps ``start_step .. stop_step - 1``, ending at checkpoint ``stop_step``
(``stop`` is null for a window that ends between checkpoints); ``last_step`` is the last step
replayed (``stop_step - 1`` when the whole interval was). Evidence kinds and strengths are the
published values of the analysis' ``EvidenceKind`` and ``Strength`` (``replay_mismatch``,
``strong``...); this module checks their spelling only, so it depends on nothing above ``trace/``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import re
import time
import uuid
from typing import Any

from sdc_forensics import __version__
from sdc_forensics.errors import InvalidInputError
from sdc_forensics.trace.format import MAX_STEP
from sdc_forensics.trace.manifest import MAX_ATTEMPT, MAX_WORLD_SIZE
from sdc_forensics.untrusted import Fields

LEDGER_VERSION = 1
CHECKSUM_KEY = "sha256"
#: Bounds of one record, far above anything the tool writes: a reader refuses more.
MAX_EVIDENCE = 64
MAX_FILES = 10_000
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_WORD = re.compile(r"[a-z][a-z0-9_]{0,63}")
_HINT = "the record is ignored (it was damaged, edited, or not written by sdc-forensics)"


class Comparison(str, enum.Enum):
    """How a replay's fingerprints were compared with the recorded ones."""

    # bit for bit: the only comparison that certifies
    EXACT = "exact"
    # within the sketch tolerance: never certifies
    TOLERANT = "tolerant"


class Outcome(str, enum.Enum):
    """What the replay of an interval found."""

    # every step replayed, nothing found
    CLEAN = "clean"
    # evidence found (the record lists it)
    EVIDENCE = "evidence"


class LedgerRecordError(InvalidInputError):
    """A ledger record that cannot be used; the reader turns it into one ignored-record line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileStamp:
    """The cheap checksum of one checkpoint file (``ledger/stamp.py``).

    Attributes:
        name: the file's name relative to the checkpoint (its own name for a one-file checkpoint).
        size_bytes: its size.
        mtime_ns: its modification time.
        sample_sha256: SHA-256 of its first and last ``stamp.SAMPLE_BYTES`` bytes (the whole
            file when it is smaller than twice that).
    """

    name: str
    size_bytes: int
    mtime_ns: int
    sample_sha256: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointRef:
    """A checkpoint at one end of an interval, as the trace named it and as the file was then.

    Attributes:
        step: ``N``: the checkpoint holds θ_N.
        path: the path as the trace's checkpoint note names it (``CheckpointNote.path``).
        weights_digest: the note's majority weights digest (16 hex digits).
        tensors_digest: :func:`~sdc_forensics.ledger.reuse.tensors_digest` of the note's
            per-tensor digests ("" when the note lists none).
        files: the cheap checksums of the checkpoint's files when the interval was examined.
    """

    step: int
    path: str
    weights_digest: str
    tensors_digest: str = ""
    files: tuple[FileStamp, ...] = ()

    def __post_init__(self) -> None:
        if not _HEX16.fullmatch(self.weights_digest):
            raise LedgerRecordError(
                f"checkpoint {self.step} has no majority weights digest in the trace "
                f"({self.weights_digest!r}): no interval from or to it can be recorded"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvidenceEntry:
    """One piece of evidence a replay found (``EvidenceKind`` / ``Strength`` values as strings)."""

    kind: str
    step: int
    ranks: tuple[int, ...] = ()
    strength: str = "strong"
    detail: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntervalRecord:
    """One examined interval (see the module docstring for the meaning of each field).

    ``record_id`` (a random 128-bit id, how reports cite the record), ``tool_version`` and
    ``created_utc`` default to a new id, this package's version and now.

    Raises:
        LedgerRecordError: the fields contradict each other (a clean outcome with evidence, or
            that stopped early; an exact comparison without a reduction mechanism; a step
            outside the interval). The reader ignores such a record; a writer has a bug.
    """

    attempt: int
    start_step: int
    stop_step: int
    last_step: int
    start: CheckpointRef
    stop: CheckpointRef | None
    comparison: Comparison
    reduction: str
    device: str
    settings: dict[str, Any]
    outcome: Outcome
    evidence: tuple[EvidenceEntry, ...]
    wall_s: float
    device_s: float
    record_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    tool_version: str = __version__
    created_utc: str = dataclasses.field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def __post_init__(self) -> None:
        if all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in (self.wall_s, self.device_s)):
            # one JSON spelling: 0.0, never 0
            object.__setattr__(self, "wall_s", float(self.wall_s))
            object.__setattr__(self, "device_s", float(self.device_s))
        problems = [
            (self.stop_step <= self.start_step, f"the interval [{self.start_step}, {self.stop_step}] holds no step"),
            (
                not self.start_step <= self.last_step < self.stop_step,
                f"last_step {self.last_step} is outside [{self.start_step}, {self.stop_step})",
            ),
            (
                self.start.step != self.start_step,
                f"start checkpoint {self.start.step} is not start_step {self.start_step}",
            ),
            (
                self.stop is not None and self.stop.step != self.stop_step,
                f"stop checkpoint is not stop_step {self.stop_step}",
            ),
            (self.outcome is Outcome.CLEAN and bool(self.evidence), "a clean outcome lists evidence"),
            (
                self.outcome is Outcome.CLEAN and self.last_step != self.stop_step - 1,
                "a clean outcome did not replay the whole interval",
            ),
            (self.outcome is Outcome.EVIDENCE and not self.evidence, "an evidence outcome lists none"),
            (
                self.comparison is Comparison.EXACT and not self.reduction,
                "an exact comparison names no reduction mechanism",
            ),
            (
                any(not self.start_step <= e.step <= self.last_step for e in self.evidence),
                "evidence outside the steps replayed",
            ),
            (
                not all(math.isfinite(s) and s >= 0 for s in (self.wall_s, self.device_s)),
                "seconds are not finite and >= 0",
            ),
        ]
        bad = [why for failed, why in problems if failed]
        if bad:
            raise LedgerRecordError(f"ledger record {self.record_id}: {bad[0]}")

    @property
    def certifies(self) -> bool:
        """True when this record, still valid, says its steps were replayed bit for bit and clean."""
        return self.comparison is Comparison.EXACT and self.outcome is Outcome.CLEAN

    @property
    def steps(self) -> range:
        """The steps replayed: ``start_step .. last_step``."""
        return range(self.start_step, self.last_step + 1)


def canonical_json(doc: Any) -> str:
    """The one spelling of ``doc`` that the checksum covers: sorted keys, no spaces, ASCII, no NaN."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def record_checksum(doc: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of ``doc`` without its checksum key."""
    body = {k: v for k, v in doc.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(canonical_json(body).encode("ascii")).hexdigest()


def record_to_json(record: IntervalRecord) -> dict[str, Any]:
    """The record as a JSON-ready dict (enums as values), without the checksum."""
    doc = dataclasses.asdict(record)
    doc.update(ledger_version=LEDGER_VERSION, comparison=record.comparison.value, outcome=record.outcome.value)
    return doc


def encode_record(record: IntervalRecord) -> bytes:
    """One ledger line: the canonical JSON of the record and its checksum, then ``\\n``."""
    doc = record_to_json(record)
    doc[CHECKSUM_KEY] = record_checksum(doc)
    return (canonical_json(doc) + "\n").encode("ascii")


def decode_record(doc: Any, where: str) -> IntervalRecord:
    """A decoded JSON line as a record: version, checksum, then every field's type and range.

    Raises:
        LedgerRecordError: anything that makes the record unusable, in one sentence.
    """
    if not isinstance(doc, dict):
        raise LedgerRecordError(f"{where}: not a JSON object; {_HINT}")
    version = doc.get("ledger_version")
    if version != LEDGER_VERSION or isinstance(version, bool):
        raise LedgerRecordError(
            f"{where}: ledger record version {str(version)[:20]}, this sdc-forensics reads version "
            f"{LEDGER_VERSION}; the record is ignored (upgrade sdc-forensics to reuse it)"
        )
    stored = doc.get(CHECKSUM_KEY)
    if not isinstance(stored, str) or stored != record_checksum(doc):
        raise LedgerRecordError(f"{where}: checksum mismatch (the record was damaged or edited); {_HINT}")
    f = Fields(doc, where, LedgerRecordError, _HINT)
    stop = f.doc.get("stop")
    return IntervalRecord(
        record_id=_match(f, "record_id", _HEX32, "32 lowercase hex digits"),
        attempt=f.int("attempt", lo=0, hi=MAX_ATTEMPT),
        start_step=f.int("start_step", lo=0, hi=MAX_STEP),
        stop_step=f.int("stop_step", lo=0, hi=MAX_STEP),
        last_step=f.int("last_step", lo=0, hi=MAX_STEP),
        start=_checkpoint(f.doc.get("start"), f'{where}, "start"'),
        stop=None if stop is None else _checkpoint(stop, f'{where}, "stop"'),
        comparison=_enum(f, "comparison", Comparison),
        reduction=f.str("reduction", max_len=64),
        device=f.str("device", max_len=1024),
        settings=f.obj("settings"),
        outcome=_enum(f, "outcome", Outcome),
        evidence=tuple(
            _evidence(e, f"{where}, evidence {i}") for i, e in enumerate(_bounded(f, "evidence", MAX_EVIDENCE))
        ),
        tool_version=f.str("tool_version", max_len=256),
        wall_s=_seconds(f, "wall_s"),
        device_s=_seconds(f, "device_s"),
        created_utc=f.str("created_utc", "", max_len=64),
    )


def _checkpoint(doc: Any, where: str) -> CheckpointRef:
    f = Fields(doc, where, LedgerRecordError, _HINT)
    tensors = f.str("tensors_digest", "", max_len=64)
    if tensors and not _HEX64.fullmatch(tensors):
        raise f.fail("tensors_digest", '64 lowercase hex digits or ""', tensors)
    return CheckpointRef(
        step=f.int("step", lo=0, hi=MAX_STEP),
        path=f.str("path", max_len=4096),
        weights_digest=_match(f, "weights_digest", _HEX16, "16 lowercase hex digits"),
        tensors_digest=tensors,
        files=tuple(_stamp(s, f"{where}, file {i}") for i, s in enumerate(_bounded(f, "files", MAX_FILES))),
    )


def _stamp(doc: Any, where: str) -> FileStamp:
    f = Fields(doc, where, LedgerRecordError, _HINT)
    return FileStamp(
        name=f.str("name", max_len=4096),
        size_bytes=f.int("size_bytes", lo=0, hi=(1 << 63) - 1),
        mtime_ns=f.int("mtime_ns", lo=-(1 << 63), hi=(1 << 63) - 1),
        sample_sha256=_match(f, "sample_sha256", _HEX64, "64 lowercase hex digits"),
    )


def _evidence(doc: Any, where: str) -> EvidenceEntry:
    f = Fields(doc, where, LedgerRecordError, _HINT)
    ranks = f.ints("ranks", (), lo=0)
    if len(ranks) > MAX_WORLD_SIZE or any(r >= MAX_WORLD_SIZE for r in ranks):
        raise f.fail("ranks", f"at most {MAX_WORLD_SIZE} ranks below {MAX_WORLD_SIZE}", list(ranks))
    return EvidenceEntry(
        kind=_match(f, "kind", _WORD, "a lowercase evidence kind"),
        step=f.int("step", lo=0, hi=MAX_STEP),
        ranks=ranks,
        strength=_match(f, "strength", _WORD, "a lowercase strength"),
        detail=f.str("detail", "", max_len=4096),
    )


def _bounded(f: Fields, key: str, most: int) -> list:
    items = f.list(key)
    if len(items) > most:
        raise f.fail(key, f"a list of at most {most} items", items)
    return items


def _match(f: Fields, key: str, pattern: re.Pattern, expected: str) -> str:
    value = f.str(key, max_len=256)
    if not pattern.fullmatch(value):
        raise f.fail(key, expected, value)
    return value


def _enum(f: Fields, key: str, enum_cls):
    value = f.str(key, max_len=64)
    try:
        return enum_cls(value)
    except ValueError:
        raise f.fail(key, " or ".join(f'"{m.value}"' for m in enum_cls), value) from None


def _seconds(f: Fields, key: str) -> float:
    value = f.doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise f.fail(key, "a number of seconds >= 0", value)
    return float(value)
