"""``sdc-forensics demo`` through click: exit codes, the ground truth on stdout, one-line errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli


def _run(*args):
    return CliRunner().invoke(cli, ["demo", *args])


@pytest.mark.slow
def test_demo_json_ground_truth(tmp_path):
    out = tmp_path / "demo"
    result = _run(
        "--out",
        str(out),
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--audit-every",
        "0",
        "--inject",
        "weights:step=2:rank=1:bit=20",
        "--json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1 and doc["world_size"] == 4 and doc["steps"] == 4
    assert doc["injected"] == ["weights:step=2:rank=1:bit=20"]
    assert [(f["location"], f["step"], f["rank"]) for f in doc["fired"]] == [("weights", 2, 1)]
    assert [c["step"] for c in doc["checkpoints"]] == [0, 2, 4]
    assert all((out / "checkpoints" / f"step-{s:08d}.pt").is_file() for s in (0, 2, 4))
    assert (out / "trace" / "manifest.json").is_file() and doc["trace_dir"] == str(out / "trace")
    assert [(a["check"], a["step"], a["rank"]) for a in doc["alarms"]][0] == ("weights", 2, 1)
    assert f"sdc-forensics bisect {out / 'trace'}" in result.stderr.replace("\n", "")
    again = _run("--out", str(out), "--steps", "4")
    assert again.exit_code == 2 and "already holds a demo trace" in again.stderr
    assert "→" not in again.stderr  # one line: the error, before anything ran


@pytest.mark.parametrize(
    "args, message",
    [
        (["--inject", "grad:step=1:rank=0"], "lacks bit"),
        (["--inject", "grad:step=99:rank=0:bit=1"], "outside the run"),
        (["--inject", "grad:step=1:rank=7:bit=1"], "does not exist"),
        (["--steps", "0"], "must be >= 1"),
    ],
)
def test_demo_usage_errors_exit_2_without_traceback(tmp_path, args, message):
    result = _run("--out", str(tmp_path / "x"), *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_default_fault_scales_with_the_run():
    from sdc_forensics.demo.run import DEFAULT_INJECTION, default_injection

    assert DEFAULT_INJECTION == "grad:step=23:rank=2:bit=30"
    for steps, every in ((4, 2), (10, 10), (7, 3), (100, 25)):
        step = int(default_injection(steps, every).split("step=")[1].split(":")[0])
        assert 0 < step < steps and step % every != 0
