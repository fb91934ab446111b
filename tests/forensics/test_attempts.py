"""Every attempt is judged (issue 33): a resumed run's earlier attempt, whose steps a later attempt
re-executed, is still checked and replayed against its own records.

A 3-rank demo with a flipped local gradient at step 5 on rank 1 runs 8 steps (checkpoint every
2); it is then resumed from checkpoint 4 clean, as an on-call engineer would after the alarm. The
latest lineage (steps 0..3 of attempt 0, 4..7 of attempt 1) is clean, so before this rule bisect
said ``clean`` and rank 1's GPU went back into service. Now the run's verdict is corruption with
rank 1 named for attempt 0 at step 5, while every checkpoint of the lineage the resumed job
continues from certifies on its own replay.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.decide.decision import Status, Verdict
from sdc_forensics.demo.run import run_demo
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.replay.options import BisectOptions
from tests.schema_check import assert_valid

pytestmark = pytest.mark.slow

RUN = dict(steps=8, checkpoint_every=2, world_size=3)


def _resumed(out, injections):
    run_demo(out, injections=injections, **RUN)
    run_demo(out, injections=(), resume_from=4, **RUN)
    return out / "trace"


@pytest.fixture(scope="module")
def faulted(tmp_path_factory):
    return _resumed(tmp_path_factory.mktemp("attempts") / "run", ("grad:step=5:rank=1:bit=30",))


def test_a_fault_in_the_re_executed_steps_of_an_earlier_attempt_is_reported(faulted):
    result = bisect(faulted, BisectOptions())
    assert result.verdict is Verdict.CORRUPTION
    assert [(s.rank, s.attempt, s.steps, s.location.value) for s in result.suspects] == [(1, 0, (5,), "local_compute")]
    assert result.first_divergent_step is None  # the latest lineage did not diverge
    # the resumed attempt's checkpoints (6 and 8 written again by attempt 1) certify on their own replay
    assert [(c.step, c.status) for c in result.checkpoints] == [(s, Status.CLEAN) for s in (0, 2, 4, 6, 8)]
    assert result.last_clean_checkpoint.step == 8
    assert any(line.startswith("attempt 0 went wrong at step 5: rank 1") for line in result.settle), result.settle
    assert any("attempt 0's steps 4..7, re-executed by attempt 1, were replayed" in n for n in result.notes), (
        result.notes
    )
    # attempt 0's own files of checkpoints 6 and 8 (the table lists attempt 1's): said to hold the fault's state
    superseded = [n for n in result.notes if n.startswith("attempt 0's checkpoint ")]
    assert [n.split(" (")[0] for n in superseded] == ["attempt 0's checkpoint 6", "attempt 0's checkpoint 8"]
    assert all("saved again by attempt 1" in n and "step 5: tainted" in n for n in superseded), superseded


def test_the_cli_documents_say_so_and_certify_still_names_the_resume_point(faulted):
    runner = CliRunner()
    ran = runner.invoke(cli, ["bisect", str(faulted), "--json"])
    assert ran.exit_code == 1, ran.output
    doc = json.loads(ran.stdout)
    assert_valid(doc, "bisect")
    assert [(s["rank"], s["attempt"], s["steps"]) for s in doc["suspects"]] == [(1, 0, [5])]
    certified = runner.invoke(cli, ["certify", str(faulted), "--json"])
    assert certified.exit_code == 0, certified.output  # a resume point is certified; the corruption is in the document
    cert = json.loads(certified.stdout)
    assert cert["verdict"] == "corruption" and cert["resume_step"] == 8, cert


def test_a_checkpoint_only_the_faulty_attempt_saved_is_tainted_and_the_resumed_one_certifies(tmp_path):
    """Attempt 0 (faulty at step 5) saves checkpoints 0, 2, 4, 6, 8; attempt 1 resumes from 4 and
    saves every 4 steps (8, 12). Checkpoint 6 holds attempt 0's faulty state and no later attempt
    saved it again. Before, the latest lineage judged it with attempt 1's records (and replayed
    attempt 1's steps 6..7 from it): an FSDP2 run certified it clean and resumed from it; this DDP
    run called it storage corruption and left 8 and 12 unverified."""
    out = tmp_path / "run"
    # a mantissa bit: the state stays finite (an exponent bit makes Adam's state inf: corrupt in content)
    run_demo(out, injections=("grad:step=5:rank=1:bit=22",), **RUN)
    run_demo(out, injections=(), resume_from=4, **{**RUN, "steps": 12, "checkpoint_every": 4})
    result = bisect(out / "trace", BisectOptions())
    statuses = {c.step: c for c in result.checkpoints}
    assert {s: c.status for s, c in statuses.items()} == {
        0: Status.CLEAN,
        2: Status.CLEAN,
        4: Status.CLEAN,
        6: Status.TAINTED,
        8: Status.CLEAN,
        12: Status.CLEAN,
    }, {s: (c.status, c.reasons) for s, c in statuses.items()}
    assert "holds attempt 0's state after its first divergent step 5" in statuses[6].reasons[0]
    assert result.last_clean_checkpoint.step == 12


def test_an_earlier_attempt_s_file_of_a_checkpoint_saved_again_is_judged_as_that_attempt_s(tmp_path):
    """Lightning writes a resumed run's checkpoint 6 as ``...-v1.ckpt`` and an HF Trainer into another
    output_dir: attempt 0's checkpoint 6 stays on disk under its own name. Before, verify-checkpoint
    matched it to attempt 1's note (by name) and called it storage corruption, or could not tell its
    step; certify listed it as having no note. Here attempt 0's file is moved aside (its note with it)
    before attempt 1 resumes from 4 and saves 6 anew."""
    out = tmp_path / "run"
    run_demo(out, injections=("grad:step=5:rank=1:bit=22",), **RUN)
    old = out / "old"
    old.mkdir()
    note_file = out / "trace" / "checkpoints" / "step-00000006.attempt-000.json"
    note = json.loads(note_file.read_text())
    first = (out / "trace" / note["path_from_trace"]).resolve()
    moved = old / first.name
    first.rename(moved)
    note_file.write_text(json.dumps({**note, "path": str(moved), "path_from_trace": f"../old/{moved.name}"}))
    run_demo(out, injections=(), resume_from=4, **RUN)
    runner = CliRunner()
    earlier = runner.invoke(cli, ["verify-checkpoint", str(moved), "--trace", str(out / "trace"), "--no-ledger"])
    assert earlier.exit_code == 1, earlier.output
    assert "tainted" in earlier.output and "attempt 0's checkpoint 6" in earlier.output, earlier.output
    assert "storage corruption" not in earlier.output
    later = runner.invoke(cli, ["verify-checkpoint", str(first), "--trace", str(out / "trace"), "--no-ledger"])
    assert later.exit_code == 0, later.output  # attempt 1's checkpoint 6, on the resumed lineage
    certified = runner.invoke(cli, ["certify", str(out / "trace"), "--no-ledger"])
    assert certified.exit_code == 0, certified.output
    assert f"earlier attempt: {moved} is attempt 0's checkpoint 6" in " ".join(certified.output.split())


def test_a_clean_resumed_run_stays_clean(tmp_path):
    trace = _resumed(tmp_path / "run", ())
    result = bisect(trace, BisectOptions())
    assert result.verdict is Verdict.CLEAN and result.suspects == ()
    assert [c.status for c in result.checkpoints] == [Status.CLEAN] * 5
    assert any(
        "attempt 0's steps 4..7, re-executed by attempt 1, were replayed and compared with its own records: clean" in n
        for n in result.notes
    ), result.notes


def test_trace_evidence_of_an_earlier_attempt_is_reported_without_a_replay(tmp_path):
    """A wrong all-reduce result on one rank shows in the trace itself: --trace-only names it too."""
    trace = _resumed(tmp_path / "run", ("allreduce:step=6:rank=2:bit=30",))
    result = bisect(trace, BisectOptions(trace_only=True))
    assert result.verdict is Verdict.CORRUPTION
    assert [(s.rank, s.attempt) for s in result.suspects] == [(2, 0)] and 6 in result.suspects[0].steps


@pytest.mark.parametrize("injections", [("grad:step=5:rank=1:bit=30",), ()], ids=["faulted", "clean"])
def test_a_resumed_attempt_that_has_not_reached_the_earlier_one_s_last_step_ends_the_lineage(tmp_path, injections):
    """The rollback after an alarm, while the resumed job still runs: attempt 0 ran steps 0..11,
    attempt 1 resumed from checkpoint 4 and has reached step 7. Attempt 0's steps 8..11 followed its
    own state, not attempt 1's step 7: they are not the run's next steps. Before, the latest lineage
    went on with them, so bisect replayed attempt 1's checkpoint 8 against attempt 0's step-8 records
    and, after attempt 0's fault, told the user the replay did not compute what the job computed
    (the recipe, the thread count) at step 8. Attempt 0's own checkpoints 10 and 12 are judged by its
    own replay: corrupt after its fault, clean without one."""
    out = tmp_path / "run"
    run_demo(out, injections=injections, **{**RUN, "steps": 12})
    run_demo(out, injections=(), resume_from=4, **RUN)
    trace = out / "trace"
    from sdc_forensics.trace.reader import Trace

    assert Trace.open(trace).step_range() == (0, 7)
    result = bisect(trace, BisectOptions())
    assert not any(e.is_weak for e in result.evidence) and not any("step 8" in line for line in result.settle), (
        result.settle
    )
    assert result.first_divergent_step is None
    statuses = {c.step: c.status for c in result.checkpoints}
    assert {s: statuses[s] for s in (0, 2, 4, 6, 8)} == dict.fromkeys((0, 2, 4, 6, 8), Status.CLEAN), result.checkpoints
    if injections:
        assert result.verdict is Verdict.CORRUPTION
        assert [(s.rank, s.attempt, s.steps) for s in result.suspects] == [(1, 0, (5,))]
        assert statuses[10] is not Status.CLEAN and statuses[12] is not Status.CLEAN
        assert result.last_clean_checkpoint.step == 8
    else:
        assert result.verdict is Verdict.CLEAN
        # certified by attempt 0's own replay of its steps 4..11
        assert statuses[10] is Status.CLEAN and statuses[12] is Status.CLEAN, result.checkpoints
        assert result.last_clean_checkpoint.step == 12


@pytest.mark.ledger
def test_an_earlier_attempts_steps_are_judged_from_the_ledger_once_its_checkpoint_is_rotated_away(tmp_path):
    """A trial user's HF run with ``save_total_limit``: attempt 0 was certified (its ledger records), resumed from
    checkpoint 4, and the rotation deleted checkpoint 4. Attempt 0's re-executed steps 4..7 'could not be settled'
    though the ledger held their exact clean replay, made while the file existed."""
    out = tmp_path / "run"
    run_demo(out, injections=(), **RUN)
    assert CliRunner().invoke(cli, ["certify", str(out / "trace")]).exit_code == 0  # the ledger: attempt 0's steps
    run_demo(out, injections=(), resume_from=4, **RUN)
    (out / "checkpoints" / "step-00000004.pt").unlink()
    result = bisect(out / "trace", BisectOptions())
    assert result.verdict is Verdict.CLEAN, result.settle
    assert any("attempt 0's steps 4..7: from the ledger" in n for n in result.notes), result.notes
    assert not any("could not be settled" in line for line in (*result.notes, *result.settle))
