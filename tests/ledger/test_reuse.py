"""Reuse rules and exact coverage: records bound to the trace's checkpoints, files and attempts."""

from __future__ import annotations

import os

import pytest

from sdc_forensics.ledger import Comparison, EvidenceEntry, append_record, exact_coverage, read_ledger, reusable_records
from sdc_forensics.trace.checkpoints import write_checkpoint_note
from sdc_forensics.trace.manifest import read_manifest
from tests.factories import write_trace
from tests.ledger.conftest import CHECKPOINT_STEPS


def _reuse(run, *, checkpoints=None):
    contents = read_ledger(run.ledger)
    assert contents.notes == ()
    return reusable_records(
        contents.records,
        list(run.notes().values()),
        trace_dir=run.trace,
        attempts=read_manifest(run.trace).attempts,
        checkpoints=checkpoints,
    )


def _exact(reuse):
    return {c.step: c.exact for c in exact_coverage(reuse.records, CHECKPOINT_STEPS)}


def _write(run, *records):
    for record in records:
        append_record(run.ledger, record)
    return records


def test_a_chain_of_clean_exact_intervals_covers_each_checkpoint_it_reaches(ledger_run):
    records = _write(ledger_run, ledger_run.record(0, 10), ledger_run.record(10, 20))
    reuse = _reuse(ledger_run)
    assert reuse.records == records and reuse.notes == () and reuse.rotated == ()
    coverage = {c.step: c for c in exact_coverage(reuse.records, CHECKPOINT_STEPS)}
    assert [coverage[n].exact for n in CHECKPOINT_STEPS] == [True, True, True, False]
    assert coverage[30].gaps == ((20, 29),)
    assert coverage[20].record_ids == tuple(r.record_id for r in records)


def test_a_record_citing_a_replaced_checkpoint_file_is_ignored_with_a_line(ledger_run):
    _write(ledger_run, ledger_run.record(0, 10), ledger_run.record(10, 20), ledger_run.record(20, 30))
    path = ledger_run.file(10)  # 3 MiB: the stamp samples its first and last MiB
    stat = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the same size and, below, the same time: only the bytes differ
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    reuse = _reuse(ledger_run)
    assert [(r.start_step, r.stop_step) for r in reuse.records] == [(20, 30)]
    assert len(reuse.notes) == 2 and all(
        f"checkpoint 10's file {path} was replaced since it was examined" in n for n in reuse.notes
    )
    assert _exact(reuse) == {0: True, 10: False, 20: False, 30: False}


def test_a_new_modification_time_is_a_replaced_file_too(ledger_run):
    _write(ledger_run, ledger_run.record(0, 10))
    os.utime(ledger_run.file(0), ns=(0, 10**18))
    reuse = _reuse(ledger_run)
    assert reuse.records == () and "checkpoint 0's file" in reuse.notes[0]


def test_checkpoints_rotated_away_stay_covered_through_the_records_digests(ledger_run):
    records = _write(ledger_run, ledger_run.record(0, 10), ledger_run.record(10, 20), ledger_run.record(20, 30))
    for step in (0, 10, 20):
        ledger_run.file(step).unlink()
    reuse = _reuse(ledger_run)
    assert reuse.records == records and reuse.notes == () and reuse.rotated == (0, 10, 20)
    assert _exact(reuse) == {0: True, 10: True, 20: True, 30: True}


def test_a_rotated_checkpoint_whose_note_now_holds_other_digests_is_not_vouched_for(ledger_run):
    _write(ledger_run, ledger_run.record(0, 10), ledger_run.record(10, 20))
    ledger_run.file(10).unlink()
    note = ledger_run.notes()[10]
    write_checkpoint_note(
        ledger_run.trace, type(note)(**{**note.__dict__, "attempt": 1, "weights_digest": "0123456789abcdef"})
    )
    reuse = _reuse(ledger_run)
    assert reuse.records == ()
    assert (
        all("checkpoint 10 of the trace has other digests than the one examined" in n for n in reuse.notes)
        and len(reuse.notes) == 2
    )


def test_a_record_whose_checkpoint_note_is_gone_is_ignored(ledger_run):
    _write(ledger_run, ledger_run.record(10, 20))
    next((ledger_run.trace / "checkpoints").glob("step-00000020.*")).unlink()
    reuse = _reuse(ledger_run)
    assert reuse.records == () and "the trace has no note of checkpoint 20 any more" in reuse.notes[0]


def test_a_resumed_attempt_takes_the_steps_it_reexecuted_from_older_records(ledger_run):
    _write(ledger_run, ledger_run.record(0, 10), ledger_run.record(10, 20))
    write_trace(
        ledger_run.trace, ranks=2, steps=25, bulk=True, attempt=1, start_step=15
    )  # resumed at 15, re-ran 15..39
    reuse = _reuse(ledger_run)
    assert [(r.start_step, r.stop_step) for r in reuse.records] == [(0, 10)]
    assert reuse.notes[0].endswith(
        "attempt 1 (a resumed run) re-executed the steps from 15, so the trace's steps are not the ones replayed"
    )


def test_tolerant_records_never_cover_and_strong_evidence_blocks_what_follows(ledger_run):
    weak = EvidenceEntry(kind="replay_mismatch", step=12, ranks=(0,), strength="weak")
    strong = EvidenceEntry(kind="replay_mismatch", step=23, ranks=(1,), strength="strong")
    _write(
        ledger_run,
        ledger_run.record(0, 10, comparison=Comparison.TOLERANT),
        ledger_run.record(0, 10),
        ledger_run.record(10, 20, comparison=Comparison.TOLERANT, evidence=(weak,), last=12),
        ledger_run.record(10, 20),
        ledger_run.record(20, 30, evidence=(strong,), last=23),
        ledger_run.record(20, 30),
    )
    coverage = {c.step: c for c in exact_coverage(_reuse(ledger_run).records, CHECKPOINT_STEPS)}
    assert [coverage[n].exact for n in CHECKPOINT_STEPS] == [True, True, True, False]
    assert coverage[30].gaps == () and coverage[30].evidence_steps == (23,)


def test_only_tolerant_records_cover_nothing(ledger_run):
    _write(ledger_run, ledger_run.record(0, 10, comparison=Comparison.TOLERANT))
    assert _exact(_reuse(ledger_run)) == {0: True, 10: False, 20: False, 30: False}


def test_checkpoints_found_by_name_in_the_checkpoints_option(ledger_run, tmp_path):
    _write(ledger_run, ledger_run.record(0, 10))
    moved = tmp_path / "moved"
    ledger_run.checkpoints.rename(moved)  # the stamps moved with the files (rename keeps them)
    reuse = _reuse(ledger_run, checkpoints=moved)
    assert len(reuse.records) == 1 and reuse.rotated == ()


@pytest.mark.parametrize(
    ("spans", "first", "expected"),
    [
        # (start, stop) of clean exact records; the run's first step; gaps before checkpoints 10, 20, 30 (by hand)
        ([(0, 10), (10, 20), (20, 30)], 0, {10: (), 20: (), 30: ()}),
        ([(0, 20), (10, 30)], 0, {10: (), 20: (), 30: ()}),
        ([(10, 20)], 0, {10: ((0, 9),), 20: ((0, 9),), 30: ((0, 9), (20, 29))}),
        ([(0, 10), (20, 30)], 0, {10: (), 20: ((10, 19),), 30: ((10, 19),)}),
        ([(10, 20)], 10, {10: (), 20: (), 30: ((20, 29),)}),
        ([], 0, {10: ((0, 9),), 20: ((0, 19),), 30: ((0, 29),)}),
    ],
)
def test_coverage_gaps_are_the_steps_no_clean_exact_record_replayed(ledger_run, spans, first, expected):
    records = [ledger_run.record(a, b) for a, b in spans]
    got = {c.step: c.gaps for c in exact_coverage(records, (10, 20, 30), first_step=first)}
    assert got == expected
