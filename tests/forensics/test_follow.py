"""``certify --follow`` beside a real 4-process gloo demo job, started at the same time.

Every wait is bounded generously and every assertion is on an outcome (records, statuses, the
incident's step and rank, exit codes), never on how fast anything ran. The follower runs as its
own process, as it would beside training; what it wrote is checked against the ledger read back
and against the ground truth of the injected fault.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.forensics.certify import certify
from sdc_forensics.ledger import read_ledger
from sdc_forensics.replay.options import AnalysisOptions
from tests.schema_check import assert_valid

pytestmark = [pytest.mark.slow, pytest.mark.ledger]

STEPS, EVERY = 60, 10  # checkpoints 0, 10, ..., 60: six intervals
INTERVALS = [(a, a + EVERY) for a in range(0, STEPS, EVERY)]
WAIT_S = 600.0  # far beyond what a loaded 2-core machine needs (about 20 s here)


def _train(out: Path, injections: tuple[str, ...] = ()) -> subprocess.Popen:
    code = ("import sys; from sdc_forensics.demo.run import run_demo; "
            f"run_demo(sys.argv[1], injections={injections!r}, steps={STEPS}, checkpoint_every={EVERY})")
    return subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _follower(trace: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sdc_forensics", "certify", "--follow", str(trace), "--poll", "0.2", "--json", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(trace: Path) -> list:
    return list(read_ledger(trace / "ledger.jsonl").records)


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, out, err


def test_a_follower_killed_and_restarted_certifies_every_checkpoint_with_no_record_lost_or_duplicated(tmp_path):
    out = tmp_path / "run"
    trace = out / "trace"
    training = _train(out)
    first = _follower(trace)
    try:
        _wait_for(lambda: (trace / "ledger.jsonl").exists() and len(_records(trace)) >= 1, "the first follower's first record")
    finally:
        first.send_signal(signal.SIGKILL)  # mid-interval, most likely: that interval has no record yet
        first.communicate(timeout=WAIT_S)
    before = {(r.start_step, r.stop_step) for r in _records(trace)}
    second = _follower(trace, "--until-step", str(STEPS), "--idle-timeout", "300")
    code, stdout, stderr = _finish(second)
    assert training.wait(timeout=WAIT_S) == 0, training.stderr.read()
    assert code == 0, stderr
    records = _records(trace)
    intervals = sorted((r.start_step, r.stop_step) for r in records)
    assert intervals == INTERVALS  # each interval once: nothing lost, nothing replayed twice
    assert all(r.certifies for r in records)
    doc = assert_valid(json.loads(stdout), "certify")
    follow = doc["follow"]
    assert follow["stopped_by"] == "until-step" and follow["lag"] == 0 and follow["incident"] is None
    assert {(i["from"], i["last"] + 1) for i in follow["intervals"] if i["outcome"] == "reused"} == before
    assert {(i["from"], i["last"] + 1) for i in follow["intervals"] if i["outcome"] == "clean"} == set(INTERVALS) - before
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(n, "clean") for n in range(0, STEPS + 1, EVERY)]
    # what the follower recorded is what certify needs: it replays nothing and resumes from the last checkpoint
    again = certify(trace, AnalysisOptions())
    assert again.analysis.replayed.steps_replayed == 0 and again.resume.step == STEPS


def test_the_follower_names_the_step_and_rank_of_a_fault_within_one_interval(tmp_path):
    out = tmp_path / "run"
    trace = out / "trace"
    training = _train(out, ("grad:step=25:rank=2:bit=31",))
    follower = _follower(trace, "--idle-timeout", "300")
    code, stdout, stderr = _finish(follower)
    assert training.wait(timeout=WAIT_S) == 0, training.stderr.read()
    assert code == 1, stderr
    doc = assert_valid(json.loads(stdout), "certify")
    follow = doc["follow"]
    assert follow["stopped_by"] == "incident"
    incident = assert_valid({"schema_version": doc["schema_version"], **follow["incident"]}, "bisect")
    assert incident["first_divergent_step"] == 25 and [s["rank"] for s in incident["suspects"]] == [2]
    # the alarm came from the interval holding step 25, and the follower examined nothing after it
    assert follow["intervals"][-1]["from"] == 20 and follow["intervals"][-1]["outcome"] == "evidence"
    assert all(i["last"] < 20 and i["outcome"] == "clean" for i in follow["intervals"][:-1])
    assert doc["resume_step"] == 20 and "incident found" in stderr


def test_sigterm_stops_the_follower_cleanly(demo_run, tmp_path):
    shutil.copytree(demo_run((), steps=6, checkpoint_every=3), tmp_path / "run")
    trace = tmp_path / "run" / "trace"
    follower = _follower(trace)  # no --until-step, no --idle-timeout: it would wait for ever
    try:
        _wait_for(lambda: (trace / "ledger.jsonl").exists() and len(_records(trace)) == 2, "both intervals recorded")
    finally:
        follower.send_signal(signal.SIGTERM)
    code, stdout, stderr = _finish(follower)
    assert code == 0, stderr  # every closed interval examined and clean
    assert "SIGTERM received" in stderr and "Traceback" not in stderr
    doc = assert_valid(json.loads(stdout), "certify")
    assert doc["follow"]["stopped_by"] == "signal" and doc["resume_step"] == 6


def test_an_interval_whose_checkpoint_was_rotated_away_is_said_and_exits_4(demo_run, tmp_path):
    shutil.copytree(demo_run((), steps=6, checkpoint_every=3), tmp_path / "run")
    trace = tmp_path / "run" / "trace"
    os.remove(tmp_path / "run" / "checkpoints" / "step-00000003.pt")
    res = CliRunner().invoke(cli, ["certify", "--follow", str(trace), "--poll", "0.1", "--idle-timeout", "1", "--json",
                                   "--checkpoints", str(tmp_path / "run" / "checkpoints")])  # the job's own absolute paths still hold them
    assert res.exit_code == 4, res.output
    doc = assert_valid(json.loads(res.stdout), "certify")
    assert doc["follow"]["unreplayable"] == [[3, 6]] and doc["follow"]["stopped_by"] == "idle"
    assert [(r.start_step, r.stop_step) for r in _records(trace)] == [(0, 3)]
    assert "checkpoint 3's file is gone" in res.stderr


def test_follow_flags_without_follow_are_a_usage_error(tmp_path):
    res = CliRunner().invoke(cli, ["certify", str(tmp_path), "--until-step", "10"])
    assert res.exit_code == 2 and "go with --follow" in res.stderr
    res = CliRunner().invoke(cli, ["certify", "--follow", str(tmp_path), "--no-ledger", "--idle-timeout", "1"])
    assert res.exit_code == 2 and "--no-ledger" in res.stderr


def test_keep_going_reports_the_incident_and_examines_every_interval_once(demo_run, tmp_path):
    """A finished run with a fault at step 7 (checkpoints 0, 3, 6, 9, 12): the follower names it and goes on."""
    shutil.copytree(demo_run("grad:step=7:rank=2:bit=31", steps=12, checkpoint_every=3), tmp_path / "run")
    trace = tmp_path / "run" / "trace"
    res = CliRunner().invoke(cli, ["certify", "--follow", str(trace), "--poll", "0.1", "--idle-timeout", "2", "--keep-going", "--json",
                                   "--checkpoints", str(tmp_path / "run" / "checkpoints")])
    assert res.exit_code == 1, res.output
    follow = assert_valid(json.loads(res.stdout), "certify")["follow"]
    assert follow["stopped_by"] == "idle" and follow["incident"]["first_divergent_step"] == 7
    assert [s["rank"] for s in follow["incident"]["suspects"]] == [2]
    # 9..11: replayed by the incident's analysis (it walks back from the end), then found in the ledger
    assert [(i["from"], i["outcome"]) for i in follow["intervals"]] == [(0, "clean"), (3, "clean"), (6, "evidence"), (9, "reused")]
    # the follower's three records (its replay of 6.. stops at the divergence, 7) and the incident analysis': 6..7 again (the
    # evidence a verdict rests on is always replayed by the analysis itself) and 9..11; no clean interval twice
    records = sorted((r.start_step, r.last_step, r.outcome.value) for r in _records(trace))
    assert records == [(0, 2, "clean"), (3, 5, "clean"), (6, 7, "evidence"), (6, 7, "evidence"), (9, 11, "clean")]
