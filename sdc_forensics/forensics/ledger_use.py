"""An analysis' use of the ledger: which intervals it need not replay, and the record of each it did.

Every command that walks checkpoint intervals (``bisect``, ``certify``, ``verify-checkpoint
--trace``, ``report`` and ``certify --follow``; not ``replay``, which replays the one window it
is asked for) has one :class:`LedgerUse`, opened and asked by its interval runner
(``forensics/intervals.py``, the only module that imports this one):

1. **Before replaying** it reads the ledger (``ledger.store.read_ledger``) and keeps the records
   that still apply to the trace (``ledger.reuse.reusable_records``: same checkpoint digests,
   same files or rotated away, same attempt). An interval whose every step a kept record
   replayed bit for bit and found clean, and at which no kept record holds strong evidence, is
   *covered*: the runner takes it from the ledger (:meth:`LedgerUse.covering`) instead of
   replaying it, and the decision counts its steps as examined exactly
   (``decide.decision.Examined.replayed``). Evidence records are never reused as evidence:
   their interval is replayed again, so the evidence a verdict rests on is always this run's.
2. **After each replay** it appends one record (:meth:`LedgerUse.append`): exact or tolerant,
   clean or with evidence. A ledger that cannot be written is one warning line, and the
   analysis goes on (the ledger can only save work, never stop a command).

Under ``torchrun`` only process 0 appends, and every process takes process 0's reading of the
ledger (a record another writer appends meanwhile must not make the processes walk apart).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from sdc_forensics.decide.verdict import LedgerSummary, ReusedWindow
from sdc_forensics.forensics.files import checkpoint_file
from sdc_forensics.ledger import (
    Comparison,
    EvidenceEntry,
    IntervalRecord,
    Outcome,
    append_record,
    checkpoint_ref,
    exact_coverage,
    ledger_path,
    read_ledger,
    reusable_records,
)
from sdc_forensics.ledger.record import MAX_EVIDENCE, LedgerRecordError
from sdc_forensics.ledger.reuse import STRONG
from sdc_forensics.recipe import recipe_identity
from sdc_forensics.trace.checkpoints import CheckpointNote


class LedgerUse:
    """The ledger as one analysis reads and extends it.

    Args:
        path: the ledger file.
        notes: the trace's checkpoint notes.
        records: the records that still apply (``Reuse.records``).
        ignored: one line per record read but not reused.
        attempts: the manifest's attempts (the attempt each new record is written for).
        locate: finds a note's checkpoint file (the one a replay from it loads).
        say: prints one line for people (the progress' ``note``), or None.
        write: False: reuse only, never append (a process of a distributed replay that does not lead).
        guard: a context manager around each append (``certify --follow`` holds its stop signals off there).
    """

    def __init__(
        self,
        *,
        path: Path,
        notes: Sequence[CheckpointNote],
        records: Sequence[IntervalRecord],
        ignored: Sequence[str],
        attempts: Sequence[Any],
        locate: Callable[[CheckpointNote], Path | None],
        say: Callable[[str], None] | None,
        write: bool = True,
        guard: Callable[[], Any] | None = None,
    ) -> None:
        self.path, self.locate, self.say, self.write = path, locate, say, write
        self.notes_by_step = {n.step: n for n in notes}
        self.records = tuple(records)
        self.attempts = tuple(attempts)
        self.lines: list[str] = list(ignored)
        self.reused: list[ReusedWindow] = []
        self.appended: list[str] = []
        self.write_error = ""
        self.guard: Callable[[], Any] = guard if guard is not None else contextlib.nullcontext
        # the recipe this analysis replays with (``recipe.recipe_identity``), kept in each record it appends
        self.recipe: dict[str, str] | None = None

    @classmethod
    def open(
        cls,
        trace,
        notes: Sequence[CheckpointNote],
        options,
        say: Callable[[str], None] | None = None,
        guard: Callable[[], Any] | None = None,
    ) -> "LedgerUse | None":
        """The ledger of ``trace`` as ``options`` (``AnalysisOptions``) name it; None with ``no_ledger`` or ``trace_only``."""
        if options.no_ledger or options.trace_only:
            return None
        from sdc_forensics.replay import distributed

        def locate(note: CheckpointNote) -> Path | None:
            return checkpoint_file(note, trace.path, options)

        path = ledger_path(trace.path, options.ledger_path)
        contents = read_ledger(path)
        reuse = reusable_records(
            contents.records, notes, trace_dir=trace.path, attempts=trace.manifest.attempts, locate=locate
        )
        reference = options.recipe or trace.manifest.recipe
        recipe = recipe_identity(reference, trace.manifest.recipe_args) if reference else None
        records, other = _same_recipe(reuse.records, recipe)
        ignored = (*contents.notes, *reuse.notes, *other)
        # every process walks on process 0's reading: a record appended meanwhile
        if distributed.current() is not None:
            records, ignored = distributed.exchange_objects((records, ignored))[
                0
                # (a follower's) must not split the walk
            ]
        use = cls(
            path=path,
            notes=notes,
            records=records,
            ignored=ignored,
            attempts=trace.manifest.attempts,
            locate=locate,
            say=say,
            write=distributed.is_lead(),
            guard=guard,
        )
        use.recipe = recipe
        for line in use.lines:
            use._say(line)
        return use

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)

    def covering(self, start_step: int, last_step: int) -> tuple[str, ...]:
        """The ids of the records that cover steps ``start_step..last_step`` exactly and clean
        (empty when any step is not covered, or a reused record holds strong evidence in it):
        ``ledger.reuse.exact_coverage``'s rule, for the steps between two checkpoints."""
        if last_step < start_step:
            return ()
        (span,) = exact_coverage(self.records, [last_step + 1], first_step=start_step)
        return span.record_ids if span.exact else ()

    def known_reduction(self) -> str:
        """The summation order (``ReplayResult.reduction_order``) that the kept records' exact replays
        reproduced the run's all-reduce with ("" when none names one): a property of the run, which a
        replay need not learn again."""
        for r in self.records:
            if r.comparison is Comparison.EXACT and r.reduction and r.reduction != "unspecified":
                return r.reduction
        return ""

    def strong_evidence(self) -> tuple[int, str] | None:
        """``(step, record id)`` of the earliest strong evidence a kept exact record holds (None: none):
        where a walk starts, to replay it again, instead of at the trace's end."""
        found = [
            (e.step, r.record_id)
            for r in self.records
            if r.comparison is Comparison.EXACT
            for e in r.evidence
            if e.strength == STRONG
        ]
        return min(found) if found else None

    def certifies_before(self, step: int) -> bool:
        """True when some kept record replayed steps before ``step`` exactly and found them clean."""
        return any(r.certifies and r.start_step < step for r in self.records)

    def reuse(self, start_step: int, last_step: int, reason: str) -> ReusedWindow | None:
        """Take steps ``start_step..last_step`` from the ledger when it covers them (:meth:`covering`)."""
        ids = self.covering(start_step, last_step)
        if not ids:
            return None
        window = ReusedWindow(start=start_step, last=last_step, record_ids=ids, reason=reason)
        self.reused.append(window)
        return window

    def append(
        self, note: CheckpointNote, stop_step: int, result, evidence: Sequence[Any], wall_s: float
    ) -> IntervalRecord | None:
        """Append the record of a replay from checkpoint ``note`` asked to run through ``stop_step - 1``.

        Args:
            note: the checkpoint replayed from.
            stop_step: one past the last step asked for (the next checkpoint's step for a whole interval).
            result: the ``ReplayResult``.
            evidence: the evidence kept from it (after a second opinion on weak residuals).
            wall_s: seconds the replay took.

        Returns the record appended, or None (nothing replayed, not this process's to write, or
        the ledger cannot be written: then one warning line, once, and no further attempt).
        """
        if not self.write or self.write_error or result.last_step < note.step:
            return None
        try:
            record = self._record(note, stop_step, result, evidence, wall_s)
        except (OSError, LedgerRecordError) as exc:
            self._say(f"ledger: the replay of steps {note.step}..{result.last_step} is not recorded ({exc})")
            return None
        from sdc_forensics.errors import LedgerWriteError

        try:
            with self.guard():
                append_record(self.path, record)
        except LedgerWriteError as exc:
            self.write_error = str(exc)
            self._say(f"warning: {exc}")
            return None
        # not added to ``records``: what this analysis reuses is what every process of a distributed
        # replay read at the start (only process 0 appends), so that they all walk alike
        self.appended.append(record.record_id)
        return record

    def _record(
        self, note: CheckpointNote, stop_step: int, result, evidence: Sequence[Any], wall_s: float
    ) -> IntervalRecord:
        entries = tuple(
            EvidenceEntry(
                kind=e.kind.value, step=e.step, ranks=tuple(e.ranks), strength=e.strength.value, detail=e.detail[:4096]
            )
            for e in evidence
            if note.step <= e.step <= result.last_step and not e.is_hint
        )[:MAX_EVIDENCE]
        exact = result.comparison == "exact" and result.tolerant_from is None
        if not entries:
            # clean as far as it went: the record claims no more
            stop_step = result.last_step + 1
        stop_note = self.notes_by_step.get(stop_step)
        return IntervalRecord(
            attempt=self._attempt(note.step),
            start_step=note.step,
            stop_step=stop_step,
            last_step=result.last_step,
            start=checkpoint_ref(note, self.locate(note)),
            stop=None if stop_note is None else checkpoint_ref(stop_note, self.locate(stop_note)),
            comparison=Comparison.EXACT if exact else Comparison.TOLERANT,
            reduction=result.reduction_order or "unspecified",
            device=str(result.device),
            settings={**_json_safe(result.settings), **({"recipe": self.recipe} if self.recipe else {})},
            outcome=Outcome.EVIDENCE if entries else Outcome.CLEAN,
            evidence=entries,
            wall_s=max(0.0, float(wall_s)),
            device_s=max(0.0, float(wall_s)),
        )

    def _attempt(self, step: int) -> int:
        """The attempt whose steps the trace holds from ``step`` (the latest one started at or before it)."""
        started = [(a.attempt, a.start_step) for a in self.attempts if a.start_step <= step]
        return max(started)[0] if started else 0

    def summary(self) -> LedgerSummary:
        """What this analysis took from and gave to the ledger, for the result."""
        return LedgerSummary(
            path=str(self.path),
            reused=tuple(self.reused),
            appended=tuple(self.appended),
            notes=tuple(self.lines) + ((self.write_error,) if self.write_error else ()),
        )


def _json_safe(settings: dict) -> dict:
    """The replay's settings as JSON the ledger's canonical form accepts (anything else as text)."""
    import json
    import math

    out = {}
    for key, value in (settings or {}).items():
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            value = str(value)
        out[str(key)] = value
    return out


def _same_recipe(
    records: Sequence[IntervalRecord], recipe: dict[str, str] | None
) -> tuple[tuple[IntervalRecord, ...], list[str]]:
    """The records made with ``recipe`` (its reference, job settings and source file's digest), and a
    line per record made with another: a replay with another recipe, or with this one before its
    file was edited, says nothing of what this one computes (a recipe whose learning rate is 1 %
    off was certified from the records of the right one). A record that names no recipe (written
    before the ledger kept it) is kept."""
    kept, lines = [], []
    for r in records:
        theirs = r.settings.get("recipe") if isinstance(r.settings, dict) else None
        if recipe is None or not isinstance(theirs, dict) or theirs == recipe:
            kept.append(r)
            continue
        what = (
            f"recipe {theirs.get('reference')}"
            if theirs.get("reference") != recipe["reference"]
            else f"recipe {recipe['reference']} "
            + ("with other job settings" if theirs.get("args") != recipe["args"] else "before its source file changed")
        )
        lines.append(
            f"ledger record {r.record_id} (steps {r.start_step}..{r.last_step}) was made with {what}: not reused, "
            "those steps are replayed with this recipe"
        )
    return tuple(kept), lines
