"""Issue 10, item 3, through the installed command (stderr to a file): a trace whose notes hold the
checkpoint paths as the job wrote them (relative to where it ran) gives the same ``bisect``
verdict from another directory, after the whole folder was moved, and with ``--checkpoints``."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cli.installed import run_installed

pytestmark = pytest.mark.slow


def _verdict(ran) -> dict:
    doc = json.loads(ran.stdout)
    return {
        "rc": ran.returncode,
        "verdict": doc["verdict"],
        "first": doc["first_divergent_step"],
        "suspects": [s["rank"] for s in doc["suspects"]],
        "resume": (doc["last_clean_checkpoint"] or {}).get("step"),
        "statuses": {c["step"]: c["status"] for c in doc["checkpoints"]},
        "replayed": [(w["from"], w["last_replayed"], w["comparison"]) for w in doc["replayed"]["windows"]],
    }


def test_bisect_finds_the_checkpoints_from_anywhere(tmp_path):
    job, other = tmp_path / "job", tmp_path / "other"
    job.mkdir()
    other.mkdir()
    ran = run_installed(
        [
            "demo",
            "--out",
            "sdc-demo",
            "--steps",
            "8",
            "--checkpoint-every",
            "4",
            "--audit-every",
            "0",
            "--inject",
            "grad:step=5:rank=2:bit=30",
        ],
        tmp_path,
        cwd=job,
    )
    assert ran.returncode == 0, ran.stderr
    note = json.loads((job / "sdc-demo/trace/checkpoints/step-00000004.attempt-000.json").read_text())
    assert (note["path"], note["path_from_trace"]) == (
        "sdc-demo/checkpoints/step-00000004.pt",
        "../checkpoints/step-00000004.pt",
    )

    in_place = _verdict(run_installed(["bisect", "sdc-demo/trace", "--json"], tmp_path, cwd=job))
    assert in_place["rc"] == 1 and in_place["first"] == 5 and in_place["suspects"] == [2]
    assert sorted(in_place["statuses"]) == [0, 4, 8] and in_place["resume"] == 4
    assert (in_place["statuses"][0], in_place["statuses"][4]) == ("clean", "clean") and in_place["statuses"][
        8
    ] != "clean"
    assert in_place["replayed"] and all(c == "exact" for *_, c in in_place["replayed"])

    from_elsewhere = run_installed(["bisect", str(job / "sdc-demo" / "trace"), "--json"], tmp_path, cwd=other)
    assert "not found" not in from_elsewhere.stderr
    assert _verdict(from_elsewhere) == in_place

    moved = shutil.move(job / "sdc-demo", other / "incident-42")  # trace and checkpoints together, renamed
    after_move = run_installed(["bisect", "incident-42/trace", "--json"], tmp_path, cwd=other)
    assert _verdict(after_move) == in_place
    assert all(c["path"].startswith(str(moved)) for c in json.loads(after_move.stdout)["checkpoints"])

    # the trace alone elsewhere: --checkpoints DIR still finds the files by name
    shutil.move(other / "incident-42" / "trace", tmp_path / "trace-only")
    with_dir = run_installed(
        ["bisect", "trace-only", "--checkpoints", str(moved / "checkpoints"), "--json"], tmp_path, cwd=tmp_path
    )
    assert _verdict(with_dir) == in_place
    without = run_installed(["bisect", "trace-only", "--json"], tmp_path, cwd=tmp_path)
    assert (
        without.returncode == 4 and "not found" in without.stderr + without.stdout
    )  # nothing to find: inconclusive, said so
