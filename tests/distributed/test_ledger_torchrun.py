"""The ledger under torchrun: every process reads it alike, process 0 alone appends, once per window.

A 14-step demo run with a checkpoint every 2 steps and a fault at step 9 (the run of
test_torchrun_cli.py's interval sharing): the 3-process ``bisect`` shares whole intervals out;
its records must be exactly the windows its document lists, and a later single-process
``bisect`` reuses them and names the same answer.
"""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.ledger import read_ledger
from tests.distributed.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.ledger]

STEPS, EVERY = 14, 2


def test_torchrun_appends_each_replayed_window_once_and_a_later_bisect_reuses_them(demo_run, tmp_path):
    shutil.copytree(demo_run("grad:step=9:rank=2:bit=31", steps=STEPS, checkpoint_every=EVERY), tmp_path / "run")
    trace = tmp_path / "run" / "trace"
    code, out, err, _ = torchrun(3, ["-m", "sdc_forensics", "bisect", str(trace), "--json"], timeout_s=600)
    assert code == 1, err  # torchrun's own exit 1 for a verdict other than clean
    doc = json.loads(out)
    assert doc["first_divergent_step"] == 9 and [s["rank"] for s in doc["suspects"]] == [2]
    appended = doc["replayed"]["ledger"]["appended"]
    records = read_ledger(trace / "ledger.jsonl").records
    assert (
        len(appended) == len(doc["replayed"]["windows"]) == len(records)
    )  # one record per window, not one per process
    assert sorted(r.record_id for r in records) == sorted(appended)
    assert sorted((r.start_step, r.last_step) for r in records) == sorted(
        (w["from"], w["last_replayed"]) for w in doc["replayed"]["windows"]
    )

    again = CliRunner().invoke(cli, ["bisect", str(trace), "--json"])
    second = json.loads(again.stdout)
    assert again.exit_code == 1
    assert (
        second["first_divergent_step"],
        [s["rank"] for s in second["suspects"]],
        second["last_clean_checkpoint"]["step"],
    ) == (9, [2], doc["last_clean_checkpoint"]["step"])
    assert second["replayed"]["steps_replayed"] <= EVERY  # the interval holding step 9, at most


def test_a_follower_under_torchrun_shares_the_intervals_and_records_each_once(demo_run, tmp_path):
    """``certify --follow`` on 2 processes: process 0's look at the trace is every process's, so they replay the
    same intervals together (whole intervals dealt out, or each step's ranks shared) and process 0 appends each once."""
    shutil.copytree(demo_run((), steps=12, checkpoint_every=3), tmp_path / "run")
    trace = tmp_path / "run" / "trace"
    code, out, err, _ = torchrun(
        2,
        [
            "-m",
            "sdc_forensics",
            "certify",
            "--follow",
            str(trace),
            "--poll",
            "0.2",
            "--until-step",
            "12",
            "--idle-timeout",
            "300",
            "--json",
        ],
        timeout_s=600,
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["follow"]["stopped_by"] == "until-step" and doc["follow"]["lag"] == 0
    assert [(i["from"], i["outcome"]) for i in doc["follow"]["intervals"]] == [
        (0, "clean"),
        (3, "clean"),
        (6, "clean"),
        (9, "clean"),
    ]
    records = read_ledger(trace / "ledger.jsonl").records
    assert sorted((r.start_step, r.stop_step) for r in records) == [
        (0, 3),
        (3, 6),
        (6, 9),
        (9, 12),
    ]  # once each, not once per process
    assert all(r.certifies for r in records)
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(n, "clean") for n in range(0, 13, 3)]
