"""Every analysis reuses the ledger: an interval replayed exactly and clean once is not replayed again.

Real 4-process gloo demo runs (made once per session, copied before a ledger is written beside
their trace). What is checked against something independent of the ledger code: the statuses and
the answer of a run analysed without any ledger (``--no-ledger``), and the step counts of the
intervals, from the checkpoint spacing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.forensics.certify import certify
from sdc_forensics.ledger import read_ledger
from sdc_forensics.replay.options import AnalysisOptions
from tests.schema_check import assert_valid

pytestmark = [pytest.mark.slow, pytest.mark.ledger]

STEPS, EVERY = 12, 3  # checkpoints 0, 3, 6, 9, 12: four intervals of three steps
FAULT = "grad:step=7:rank=2:bit=31"


def _copy(demo_run, tmp_path: Path, spec) -> Path:
    out = tmp_path / "run"
    shutil.copytree(demo_run(spec, steps=STEPS, checkpoint_every=EVERY), out)
    return out / "trace"


def _statuses(result) -> list[tuple[int, str]]:
    return [(c.step, c.status.value) for c in result.checkpoints]


def _answer(result) -> tuple:
    last = result.last_clean_checkpoint
    return (
        result.verdict.value,
        result.first_divergent_step,
        tuple(s.rank for s in result.suspects),
        None if last is None else last.step,
    )


def test_a_clean_run_certified_twice_replays_nothing_the_second_time(demo_run, tmp_path):
    trace = _copy(demo_run, tmp_path, ())
    first = certify(trace, AnalysisOptions())
    assert first.analysis.replayed.steps_replayed == STEPS  # every step replayed once: 0..11
    assert first.exit_code == 0 and first.resume is not None and first.resume.step == 12
    ledger = first.analysis.replayed.ledger
    assert ledger is not None and len(ledger.appended) == STEPS // EVERY and not ledger.reused
    assert [r.record_id for r in read_ledger(trace / "ledger.jsonl").records] == list(ledger.appended)

    second = certify(trace, AnalysisOptions())
    assert second.analysis.replayed.steps_replayed == 0
    assert _statuses(second.analysis) == _statuses(first.analysis)
    again = second.analysis.replayed.ledger
    assert not again.appended and again.steps_reused == STEPS
    assert {i for w in again.reused for i in w.record_ids} == set(ledger.appended)  # every record cited
    assert "from the ledger" in second.analysis.scope
    # options that cannot change what the ledger's exact replays showed are said to be unused, and a
    # replay that "could not be exact" is not claimed when nothing was replayed
    third = certify(trace, AnalysisOptions(num_threads=2))
    assert third.exit_code == 0 and third.analysis.replayed.steps_replayed == 0
    assert any("--threads 2 changed nothing: pass --no-ledger" in n for n in third.analysis.notes), third.analysis.notes
    assert not any("could not be exact" in line for line in third.analysis.settle), third.analysis.settle

    # coverage in plain view: every step before each checkpoint replayed exactly, earlier, by the records cited
    runner = CliRunner()
    doc = assert_valid(runner.invoke(cli, ["certify", str(trace), "--json"]).stdout, "certify")
    assert [(c["step"], c["exact_ledger"], c["exact_now"], c["lacking_replay"]) for c in doc["coverage"]] == [
        (n, [[0, n - 1]] if n else [], [], []) for n in range(0, STEPS + 1, EVERY)
    ]
    assert set(doc["coverage"][-1]["ledger_records"]) == set(ledger.appended)

    # --no-ledger: everything replayed again, the ledger neither read nor extended
    res = runner.invoke(cli, ["certify", str(trace), "--json", "--no-ledger"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == _statuses(first.analysis)
    assert len(read_ledger(trace / "ledger.jsonl").records) == STEPS // EVERY
    res = runner.invoke(cli, ["bisect", str(trace), "--json", "--no-ledger"])
    assert json.loads(res.stdout)["replayed"]["steps_replayed"] == STEPS
    assert "ledger" not in json.loads(res.stdout)["replayed"]

    # a ledger that cannot be written is one warning line, never a failure
    res = runner.invoke(
        cli, ["certify", str(trace), "--json", "--ledger", str(trace.parent / "no-such-folder" / "ledger.jsonl")]
    )
    assert res.exit_code == 0 and res.stderr.count("cannot append to the ledger") == 1
    assert [(c["step"], c["status"]) for c in json.loads(res.stdout)["checkpoints"]] == _statuses(first.analysis)


def test_a_fault_run_bisected_twice_replays_at_most_one_interval_and_names_the_same_answer(demo_run, tmp_path):
    trace = _copy(demo_run, tmp_path, FAULT)
    plain = bisect(trace, AnalysisOptions(no_ledger=True))
    assert plain.first_divergent_step == 7 and [s.rank for s in plain.suspects] == [2]
    assert not (trace / "ledger.jsonl").exists()

    first = bisect(trace, AnalysisOptions())
    second = bisect(trace, AnalysisOptions())
    assert _answer(first) == _answer(second) == _answer(plain)
    assert _statuses(second) == _statuses(plain)
    assert second.replayed.steps_replayed <= EVERY  # the interval holding the evidence, at most
    reused = {s for w in second.replayed.ledger.reused for s in range(w.start, w.last + 1)}
    assert set(range(0, 6)) <= reused  # the clean intervals before the fault came from the ledger

    # through the CLI, --json says which intervals came from the ledger (with their records)
    res = CliRunner().invoke(cli, ["bisect", str(trace), "--json"])
    doc = assert_valid(json.loads(res.stdout), "bisect")
    assert res.exit_code == 1 and doc["first_divergent_step"] == 7
    ids = {r.record_id for r in read_ledger(trace / "ledger.jsonl").records}
    assert doc["replayed"]["ledger"]["reused"] and all(
        set(w["records"]) <= ids for w in doc["replayed"]["ledger"]["reused"]
    )


def test_a_record_citing_a_replaced_checkpoint_file_is_not_reused(demo_run, tmp_path):
    trace = _copy(demo_run, tmp_path, ())
    certify(trace, AnalysisOptions())
    checkpoint = trace.parent / "checkpoints" / "step-00000003.pt"
    info = checkpoint.stat()
    os.utime(checkpoint, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))  # same bytes, saved again later
    again = certify(trace, AnalysisOptions())
    # the records from or to checkpoint 3 (steps 0..2 and 3..5) are replayed again; the others are reused
    assert sorted((w.start, w.last) for w in again.analysis.replayed.windows) == [(0, 2), (3, 5)]
    assert sorted((w.start, w.last) for w in again.analysis.replayed.ledger.reused) == [(6, 8), (9, 11)]
    replaced = [n for n in again.analysis.replayed.ledger.notes if "was replaced" in n]
    assert len(replaced) == 2 and all("step-00000003.pt" in n for n in replaced)
    assert again.exit_code == 0 and again.resume.step == 12
    # the new records cite the file as it is now: a third analysis replays nothing
    res = CliRunner().invoke(cli, ["bisect", str(trace), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["replayed"]["steps_replayed"] == 0


def test_checkpoints_rotated_away_after_the_ledger_covered_them_still_certify_the_later_ones(demo_run, tmp_path):
    """A trial user's Hugging Face job with ``save_total_limit``: checkpoint 0 is deleted first. The walk offered the
    ledger only the intervals of checkpoints whose file exists, so the exact records of steps 0..2 were never asked
    for and nothing was certified again (exit 4), though every step had been replayed while the files were there."""
    trace = _copy(demo_run, tmp_path, ())  # (--checkpoints: the job's own absolute paths still hold the files)
    assert (
        certify(trace, AnalysisOptions(checkpoints_dir=trace.parent / "checkpoints")).exit_code == 0
    )  # the ledger now covers 0..11
    for step in (0, 3):  # the two oldest, as a checkpoint limit deletes them
        os.remove(trace.parent / "checkpoints" / f"step-{step:08d}.pt")
    again = certify(trace, AnalysisOptions(checkpoints_dir=trace.parent / "checkpoints"))
    assert again.exit_code == 0 and again.resume.step == 12
    assert again.analysis.replayed.steps_replayed == 0
    assert _statuses(again.analysis) == [
        (0, "unverified"),
        (3, "unverified"),
        (6, "clean"),
        (9, "clean"),
        (12, "clean"),
    ]
    gone = again.analysis.checkpoints[0].reasons[0]
    assert "not found, while later checkpoints' files were" in gone and "certify --follow" in gone
    # without the ledger, steps 0..5 cannot be replayed: nothing is certified, and the walk says why
    plain = certify(trace, AnalysisOptions(no_ledger=True, checkpoints_dir=trace.parent / "checkpoints"))
    assert plain.exit_code == 4 and plain.resume is None
    assert any("steps 0..5 not replayed" in n for n in plain.analysis.replayed.notes), plain.analysis.replayed.notes


def test_a_rotated_checkpoint_whose_interval_the_ledger_lacks_is_replayed_from_the_one_before(demo_run, tmp_path):
    trace = _copy(demo_run, tmp_path, ())  # (--checkpoints: the job's own absolute paths still hold the files)
    assert certify(trace, AnalysisOptions(checkpoints_dir=trace.parent / "checkpoints")).exit_code == 0
    kept = [r for r in (trace / "ledger.jsonl").read_text().splitlines() if '"start_step":3,' not in r]
    assert len(kept) == STEPS // EVERY - 1  # the record of steps 3..5 dropped
    (trace / "ledger.jsonl").write_text("\n".join(kept) + "\n")
    os.remove(trace.parent / "checkpoints" / "step-00000003.pt")
    again = certify(trace, AnalysisOptions(checkpoints_dir=trace.parent / "checkpoints"))
    assert again.exit_code == 0 and again.resume.step == 12
    assert [(w.start, w.last) for w in again.analysis.replayed.windows] == [(0, 5)]  # from checkpoint 0, through 3..5


def test_a_checkpoint_name_written_again_by_a_later_checkpoint_is_gone_not_damaged(demo_run, tmp_path):
    """A trial user's Accelerate job (automatic names, ``total_limit``): after a resume its counter restarted, the
    rotation deleted ``checkpoint_1`` (step 4) and wrote step 16 there. Both notes led to one file, whose content
    was step 16's: bisect said ``CORRUPTION``, storage, 'check the disk', on a clean run (exit 1)."""
    trace = _copy(demo_run, tmp_path, ())
    folder = trace.parent / "checkpoints"
    shutil.copyfile(folder / "step-00000009.pt", folder / "step-00000003.pt")  # step 9 saved under step 3's name
    note = trace / "checkpoints" / "step-00000009.attempt-000.json"
    doc = json.loads(note.read_text())
    doc["path"] = doc["path"].replace("step-00000009.pt", "step-00000003.pt")
    doc.pop("path_from_trace", None)
    note.write_text(json.dumps(doc))
    os.remove(folder / "step-00000009.pt")
    result = certify(trace, AnalysisOptions(checkpoints_dir=folder, no_ledger=True))
    assert result.analysis.verdict.value == "clean" and result.exit_code == 0, result.analysis.checkpoints
    assert _statuses(result.analysis) == [(0, "clean"), (3, "unverified"), (6, "clean"), (9, "clean"), (12, "clean")]
    reason = result.analysis.checkpoints[1].reasons[0]
    assert "written again by checkpoint 9" in reason and "not damaged" in reason


def test_an_all_reduce_corrupted_at_the_first_step_gives_the_same_answer_whatever_ran_before(demo_run, tmp_path):
    """Every rank's reduced gradient flipped at step 0: the replay cannot learn the run's summation order from that
    step. Without a ledger the walk learns it from the last interval first; with one, the clean later intervals come
    from the ledger, and the order must come with them (their records name it), or the replay of 0..2 turns tolerant
    and the answer depends on which command ran first (found by the issue-22 campaign, runs 024 and 057)."""
    trace = _copy(demo_run, tmp_path, "allreduce-all:step=0:rank=1:bit=3")  # below the online sketch check: no alarm
    plain = bisect(trace, AnalysisOptions(no_ledger=True))
    assert plain.first_divergent_step == 0 and plain.replayed.comparison == "exact"
    first = bisect(trace, AnalysisOptions())
    clean = [r for r in read_ledger(trace / "ledger.jsonl").records if r.certifies]
    assert clean and all(
        r.reduction == plain.replayed.reduction_order != "" for r in clean
    )  # the later intervals name the order
    then_certify = certify(trace, AnalysisOptions())
    again = bisect(trace, AnalysisOptions())
    for result in (first, then_certify.analysis, again):
        assert _answer(result) == _answer(plain) and _statuses(result) == _statuses(plain)
        assert result.replayed.comparison in ("exact", "none")  # never tolerant: the order came from the ledger


def test_a_followers_evidence_is_where_bisect_starts_when_the_trace_shows_none(demo_run, tmp_path):
    """A local-gradient flip at step 7 leaves nothing in the trace, so without a ledger the walk starts at the run's end.
    A follower that replayed 0..2, 3..5 and 6..7 (where it found the divergence) and stopped, while training went on,
    left no record of 9..11: bisect then starts at the ledger's evidence, replays its interval again and nothing after
    it, and names what a full replay names (the 200-step follower test found a walk from the end instead)."""
    from sdc_forensics.forensics.intervals import interval_runner
    from sdc_forensics.forensics.ledger_use import LedgerUse
    from sdc_forensics.trace.reader import Trace

    trace = _copy(demo_run, tmp_path, FAULT)
    plain = bisect(trace, AnalysisOptions(no_ledger=True))
    opened = Trace.open(trace)
    notes = {n.step: n for n in opened.checkpoint_notes()}
    ledger = LedgerUse.open(opened, sorted(notes.values(), key=lambda n: n.step), AnalysisOptions())
    runner = interval_runner(opened, AnalysisOptions(), ledger=ledger)
    for start in (0, 3, 6):  # what the follower replayed before its alarm
        runner.replay(notes[start], start + EVERY - 1, "a follower's interval")
    assert {(r.start_step, r.outcome.value) for r in read_ledger(trace / "ledger.jsonl").records} == {
        (0, "clean"),
        (3, "clean"),
        (6, "evidence"),
    }
    reused = bisect(trace, AnalysisOptions())
    assert _answer(reused) == _answer(plain) and _statuses(reused) == _statuses(plain)
    assert reused.replayed.steps_replayed == 2  # steps 6..7 again, up to the divergence; 0..5 from the ledger
    assert "confirm the ledger's evidence at step 7" in reused.replayed.windows[0].reason
