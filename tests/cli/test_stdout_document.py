"""Issue 33, "stdout belongs to the document": under ``--json`` nothing but the document reaches
stdout, whatever the recipe or the training code prints, in every command, in the follower and
under torchrun fan-out.

The job is the demo trained with ``tests/cli/printing_recipe.py``, which writes lines to stdout
in ``build``, ``fetch_microbatch`` and ``load_checkpoint`` three ways (``print``, a raw write to
file descriptor 1, a subprocess). Every command runs in its own process (``python -m
sdc_forensics``, as a script would call it): click's ``CliRunner`` has no file descriptor 1 to
test. Each command's stdout must be one JSON document, and its stderr must hold the recipe's
lines (so the recipe did run and print, and the test could fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli.printing_recipe import MARK
from tests.distributed.launch import ROOT, torchrun

pytestmark = pytest.mark.slow

RECIPE = "tests.cli.printing_recipe:recipe"
TIMEOUT_S = 300


def _run(args: list[str], *, env: dict | None = None) -> tuple[int, str, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "sdc_forensics", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _document(out: str, err: str, what: str) -> dict:
    assert MARK not in out, f"{what}: the recipe's lines reached stdout:\n{out[:2000]}"
    try:
        return json.loads(out)
    except json.JSONDecodeError as exc:  # pragma: no cover - the failure being tested
        raise AssertionError(
            f"{what}: stdout is not one JSON document ({exc}):\n{out[:2000]}\n--- stderr:\n{err[-2000:]}"
        ) from None


@pytest.fixture(scope="module")
def printing_run(tmp_path_factory):
    """A 4-process demo run of the printing recipe, a gradient fault at step 4 on rank 2, a
    checkpoint every 3 steps; ``demo --json`` itself must keep its stdout for the ground truth."""
    out = tmp_path_factory.mktemp("printing") / "run"
    code, stdout, stderr = _run(
        [
            "demo",
            "--out",
            str(out),
            "--inject",
            "grad:step=4:rank=2:bit=31",
            "--steps",
            "6",
            "--checkpoint-every",
            "3",
            "--recipe",
            RECIPE,
            "--json",
        ]
    )
    assert code == 0, stderr[-3000:]
    truth = _document(stdout, stderr, "demo --json")
    assert f"{MARK} number of parameters" in stderr  # the training processes printed, to stderr
    assert [c["step"] for c in truth["checkpoints"]] == [0, 3, 6]
    return out


def test_every_json_command_keeps_stdout_for_its_document(printing_run, tmp_path):
    trace, ckpt = printing_run / "trace", printing_run / "checkpoints" / "step-00000003.pt"
    cases = {
        "bisect": (["bisect", str(trace), "--json"], 1),
        "certify": (["certify", str(trace), "--json"], 0),
        "replay": (["replay", str(trace), "--from", "3", "--to", "5", "--json"], 1),
        "verify-checkpoint": (["verify-checkpoint", str(ckpt), "--trace", str(trace), "--json"], 0),
        "report": (["report", str(trace), "--format", "json"], 1),
        "report --json -o": (["report", str(trace), "--json", "-o", str(tmp_path / "review.md")], 1),
    }
    for name, (args, expected) in cases.items():
        code, out, err = _run(args)
        doc = _document(out, err, name)
        assert code == expected, (name, err[-2000:])
        assert doc["schema_version"] == 1
        # build, load_checkpoint and fetch_microbatch all ran and printed (to stderr)
        for said in ("number of parameters", "load ", "fetch ", "build (subprocess)"):
            assert f"{MARK} {said}" in err, (name, said)
    code, out, err = _run(["inspect", str(trace), "--json"])
    assert code == 0 and _document(out, err, "inspect")["schema_version"] == 1


def test_the_follower_keeps_stdout_for_its_document(printing_run, tmp_path):
    # the follower needs the ledger: its own file here, so the shared run stays untouched
    env = {k: v for k, v in os.environ.items() if k != "SDC_FORENSICS_NO_LEDGER"}
    full = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdc_forensics",
            "certify",
            str(printing_run / "trace"),
            "--follow",
            "--json",
            "--ledger",
            str(tmp_path / "ledger.jsonl"),
            "--idle-timeout",
            "1",
            "--poll",
            "0.2",
        ],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    doc = _document(full.stdout, full.stderr, "certify --follow")
    assert full.returncode == 1 and doc["follow"]["stopped_by"] == "incident", full.stderr[-2000:]
    assert f"{MARK} fetch " in full.stderr


def test_torchrun_fan_out_keeps_stdout_for_the_document(printing_run):
    """Two replay processes: process 0 writes the document; neither's recipe lines reach stdout
    (torchrun passes every worker's stdout through to its own)."""
    code, out, err, _ = torchrun(
        2, ["-m", "sdc_forensics", "bisect", str(printing_run / "trace"), "--json"], timeout_s=TIMEOUT_S
    )
    doc = _document(out, err, "torchrun bisect --json")
    assert code == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == 4, err[-3000:]
    assert err.count(f"{MARK} number of parameters: 26.1K (fd 1)") >= 2  # both processes built the model and printed


@pytest.mark.heavy
def test_torchrun_certify_and_verify_keep_stdout_for_the_document(printing_run):
    """The other fan-out commands a script parses: ``certify --json`` and ``verify-checkpoint
    --trace --json`` under two replay processes print one document and none of the recipe's lines."""
    code, out, err, _ = torchrun(
        2, ["-m", "sdc_forensics", "certify", str(printing_run / "trace"), "--json"], timeout_s=TIMEOUT_S
    )
    doc = _document(out, err, "torchrun certify --json")
    assert code == 0 and doc["resume_step"] == 3, err[
        -3000:
    ]  # the fault is at step 4: checkpoint 3 is the resume point
    assert f"{MARK} fetch " in err
    checkpoint = printing_run / "checkpoints" / "step-00000006.pt"
    code, out, err, _ = torchrun(
        2,
        ["-m", "sdc_forensics", "verify-checkpoint", str(checkpoint), "--trace", str(printing_run / "trace"), "--json"],
        timeout_s=TIMEOUT_S,
    )
    doc = _document(out, err, "torchrun verify-checkpoint --trace --json")
    assert code == 1 and doc["certification"]["status"] == "tainted", err[-3000:]
