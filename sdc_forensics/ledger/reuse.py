"""Which ledger records still apply to a trace, and which checkpoints they cover exactly.

A valid record (``ledger/store.py`` checked its bytes) is reused only if the trace still holds
what it examined (:func:`reusable_records`):

1. **Same checkpoints.** For each end of its interval, the trace's checkpoint note of that step
   (the latest attempt's) has the record's path and content digests (weights digest and the
   digest of the per-tensor digests). Otherwise a later attempt saved another checkpoint there,
   or the note is gone: ignored, with a line.
2. **Same files, or rotated away.** Where the note's file is found (``checkpoint/locate.py``),
   its cheap stamps (``ledger/stamp.py``) must equal the record's: a file that exists with other
   stamps was replaced, and the record is ignored with a line. Where no file is found, the
   checkpoint was rotated away (deleted to save space): the record stands on its digests, which
   rule 1 matched against the trace.
3. **Same attempt.** The steps it replayed are still the trace's latest attempt's: no later
   attempt (a resumed run) restarted at or before its last step.

Coverage (:func:`exact_coverage`): checkpoint ``N`` is covered exactly when every step from the
run's first step to ``N - 1`` lies in the interval of a reused record that replayed it bit for
bit and found it clean, and no reused record holds strong evidence before ``N``. Each such
interval starts from a checkpoint whose digests are the trace's and whose own steps are covered,
so the records form a chain from the run's first checkpoint. Tolerant records never cover; a
weak tolerant residual does not undo an exact clean replay of the same step. Coverage is about
steps: the checkpoint file itself is still verified (read in full) before it is called clean.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from sdc_forensics.errors import InvalidInputError
from sdc_forensics.ledger.record import CheckpointRef, IntervalRecord
from sdc_forensics.ledger.stamp import stamp_checkpoint, tensors_digest
from sdc_forensics.trace.checkpoints import CheckpointNote
from sdc_forensics.trace.manifest import Attempt

#: Evidence strength (``Strength`` value) that blocks coverage whatever else covers the step.
STRONG = "strong"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reuse:
    """The records that still apply to the trace, and a line per record that does not.

    Attributes:
        records: still-valid records (exact or tolerant, clean or with evidence), ledger order.
        rotated: steps of checkpoints whose files are gone, vouched for by the records' digests.
        notes: one line per record ignored, for people.
    """

    records: tuple[IntervalRecord, ...] = ()
    rotated: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def certifying(self) -> tuple[IntervalRecord, ...]:
        """The records that replayed their interval bit for bit and found it clean."""
        return tuple(r for r in self.records if r.certifies)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointCoverage:
    """How the ledger covers the steps before checkpoint ``step``.

    Attributes:
        step: ``N``.
        exact: every step ``first_step .. N - 1`` replayed bit for bit and clean, no strong
            evidence before ``N``.
        gaps: ``(first, last)`` step ranges before ``N`` that no certifying record covers.
        record_ids: the certifying records whose intervals cover steps before ``N``.
        evidence_steps: steps before ``N`` at which a reused record holds strong evidence.
    """

    step: int
    exact: bool
    gaps: tuple[tuple[int, int], ...] = ()
    record_ids: tuple[str, ...] = ()
    evidence_steps: tuple[int, ...] = ()


def reusable_records(
    records: Iterable[IntervalRecord],
    notes: Sequence[CheckpointNote],
    *,
    trace_dir: str | os.PathLike,
    attempts: Sequence[Attempt] = (),
    checkpoints: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    locate: Callable[[CheckpointNote], Path | None] | None = None,
) -> Reuse:
    """The records that still apply to the trace (rules 1 to 3 of the module docstring).

    Args:
        records: valid records (``read_ledger(...).records``).
        notes: the trace's checkpoint notes (``trace.checkpoints.read_checkpoint_notes``).
        trace_dir: the trace directory (where relative note paths are found from).
        attempts: the manifest's attempts (``Manifest.attempts``); empty: one attempt, 0.
        checkpoints: ``--checkpoints``, as ``checkpoint.locate.locate_checkpoint`` takes it.
        locate: finds a note's file (default: ``locate_checkpoint`` with the two above).

    Never raises on what the records or the files hold: each record it cannot confirm is a note.
    """
    if locate is None:
        from sdc_forensics.checkpoint.locate import locate_checkpoint

        def locate(note: CheckpointNote) -> Path | None:
            return locate_checkpoint(note, checkpoints, base_dir=trace_dir)

    by_step = {n.step: n for n in notes}
    files = _FileCheck(locate)
    kept, rotated, lines = [], set(), []
    for record in records:
        why = _attempt_problem(record, attempts)
        for ref in (record.start, record.stop):
            if why is None and ref is not None:
                why = _checkpoint_problem(ref, by_step.get(ref.step), files)
        if why is not None:
            lines.append(f"ledger record {record.record_id} ({_interval(record)}) not reused: {why}")
            continue
        kept.append(record)
        rotated.update(
            ref.step for ref in (record.start, record.stop) if ref is not None and files.gone(by_step[ref.step])
        )
    return Reuse(records=tuple(kept), rotated=tuple(sorted(rotated)), notes=tuple(lines))


def _interval(record: IntervalRecord) -> str:
    return f"interval [{record.start_step}, {record.stop_step}], attempt {record.attempt}"


def _attempt_problem(record: IntervalRecord, attempts: Sequence[Attempt]) -> str | None:
    """Why the steps the record replayed are no longer the latest attempt's, or None."""
    started = {a.attempt: a.start_step for a in attempts} or {0: 0}
    if record.attempt not in started:
        return f"the trace has no attempt {record.attempt}"
    if started[record.attempt] > record.start_step:
        return f"attempt {record.attempt} starts at step {started[record.attempt]}, after the interval's start"
    later = sorted((s, a) for a, s in started.items() if a > record.attempt and s <= record.last_step)
    if later:
        step, attempt = later[0]
        return f"attempt {attempt} (a resumed run) re-executed the steps from {step}, so the trace's steps are not the ones replayed"
    return None


def _checkpoint_problem(ref: CheckpointRef, note: CheckpointNote | None, files: "_FileCheck") -> str | None:
    """Why the trace's checkpoint ``ref.step`` is not the one the record examined, or None."""
    if note is None:
        return f"the trace has no note of checkpoint {ref.step} any more"
    if note.path != ref.path:
        return f"checkpoint {ref.step} of the trace is {note.path!r}, not {ref.path!r} as examined"
    if note.weights_digest != ref.weights_digest or tensors_digest(note) != ref.tensors_digest:
        return f"checkpoint {ref.step} of the trace has other digests than the one examined (a later attempt saved another)"
    found = files.stamps(note)
    if found is None:
        # rotated away: the digests above vouch for it
        return None
    if isinstance(found, str):
        return f"checkpoint {ref.step}'s file cannot be checked ({found})"
    if not ref.files:
        return f"the record holds no file checksums for checkpoint {ref.step}, whose file exists"
    if found != ref.files:
        changed = next((f"{a.name}" for a, b in zip(found, ref.files) if a != b), files.path(note).name)
        return (
            f"checkpoint {ref.step}'s file {files.path(note)} was replaced since it was examined ({changed}: size, time or "
            "bytes differ)"
        )
    return None


class _FileCheck:
    """Each checkpoint's file located and stamped once, however many records cite it."""

    def __init__(self, locate: Callable[[CheckpointNote], Path | None]) -> None:
        self.locate = locate
        self._found: dict[int, tuple[Path | None, object]] = {}

    def _get(self, note: CheckpointNote) -> tuple[Path | None, object]:
        if note.step not in self._found:
            path = self.locate(note)
            if path is None:
                self._found[note.step] = (None, None)
            else:
                try:
                    self._found[note.step] = (path, stamp_checkpoint(path))
                except (OSError, InvalidInputError) as exc:
                    self._found[note.step] = (path, str(exc))
        return self._found[note.step]

    def stamps(self, note: CheckpointNote):
        """The file's stamps, a reason it cannot be stamped, or None when it is gone."""
        return self._get(note)[1]

    def path(self, note: CheckpointNote) -> Path:
        return self._get(note)[0]

    def gone(self, note: CheckpointNote) -> bool:
        return self._get(note)[0] is None


def exact_coverage(
    records: Iterable[IntervalRecord], checkpoint_steps: Iterable[int], *, first_step: int = 0
) -> tuple[CheckpointCoverage, ...]:
    """For each checkpoint step, whether the reused ``records`` cover every step before it exactly.

    Args:
        records: reused records (:attr:`Reuse.records`): certifying ones cover, strong evidence blocks.
        checkpoint_steps: the checkpoints to answer for.
        first_step: the run's first step (its first checkpoint holds the state before it).

    Returns:
        One :class:`CheckpointCoverage` per checkpoint step, in increasing step order.
    """
    records = list(records)
    # [start, stop) step ranges
    spans = _merged((r.start_step, r.stop_step) for r in records if r.certifies)
    starts = [s for s, _ in spans]
    strong = sorted({e.step for r in records for e in r.evidence if e.strength == STRONG})
    out = []
    for n in sorted(set(checkpoint_steps)):
        gaps, cursor = [], first_step
        for start, stop in spans[: bisect.bisect_left(starts, n)]:
            if start > cursor:
                gaps.append((cursor, start - 1))
            cursor = max(cursor, stop)
        if cursor < n:
            gaps.append((cursor, n - 1))
        evidence = tuple(s for s in strong if first_step <= s < n)
        ids = tuple(r.record_id for r in records if r.certifies and r.start_step < n and r.stop_step > first_step)
        out.append(
            CheckpointCoverage(
                step=n, exact=not gaps and not evidence, gaps=tuple(gaps), record_ids=ids, evidence_steps=evidence
            )
        )
    return tuple(out)


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Half-open step ranges merged where they overlap or touch, sorted."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out
