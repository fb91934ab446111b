"""``sdc-forensics bisect`` and ``replay`` through click's CliRunner: one test per exit code, JSON, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from tests.factories import Fault, SimFault


@pytest.fixture
def clean_run(sim):
    return sim(steps=5, checkpoint_every=4)


@pytest.fixture
def faulty_run(sim):
    return sim(SimFault(where="grad", step=4, rank=3, bit=11), steps=5, checkpoint_every=4)


def _run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_exit_0_clean_with_replay(clean_run):
    result = _run("bisect", clean_run / "trace", "--checkpoints", clean_run / "checkpoints", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1 and doc["verdict"] == "clean" and doc["first_divergent_step"] is None
    assert doc["replayed"]["comparison"] == "exact" and doc["replayed"]["device"].startswith("cpu")
    assert doc["last_clean_checkpoint"]["step"] == 4
    assert list(doc) == sorted(doc)


def test_exit_1_corruption_json_document(faulty_run):
    result = _run("bisect", faulty_run / "trace", "--checkpoints", faulty_run / "checkpoints", "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert (doc["verdict"], doc["first_divergent_step"], doc["exit_code"]) == ("corruption", 4, 1)
    [suspect] = doc["suspects"]
    assert {k: suspect[k] for k in ("rank", "host", "gpu", "location", "recurring")} == {
        "rank": 3,
        "host": "sim1",
        "gpu": "GPU-sim-3",
        "location": "local_compute",
        "recurring": False,
    }
    assert suspect["evidence"][0]["kind"] == "replay_mismatch"
    assert doc["last_clean_checkpoint"] == {
        "path": str(faulty_run / "checkpoints/step-00000004.pt"),
        "status": "clean",
        "step": 4,
    }
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(0, "clean"), (4, "clean")]
    assert [(w["from"], w["last_replayed"]) for w in doc["replayed"]["windows"]] == [(0, 3), (4, 4)]
    # the documented schema (docs/bisect.md)
    assert set(doc) == {
        "schema_version",
        "verdict",
        "first_divergent_step",
        "suspects",
        "last_clean_checkpoint",
        "checkpoints",
        "replayed",
        "evidence",
        "hints",
        "mode",
        "scope",
        "settle",
        "notes",
        "trace",
        "divergence_window",
        "preflight",
        "exit_code",
    }  # issue 21: said before any replay
    assert set(suspect) == {"rank", "host", "gpu", "location", "recurring", "steps", "recommendation", "evidence"}
    assert set(suspect["evidence"][0]) == {
        "kind",
        "step",
        "ranks",
        "expected",
        "found",
        "location",
        "detail",
        "source",
        "affects_state",
        "strength",
        "earliest_step",
    }
    assert set(doc["replayed"]) == {
        "windows",
        "device",
        "comparison",
        "steps_replayed",
        "reduction_order",
        "settings",
        "notes",
    }
    assert set(doc["replayed"]["windows"][0]) == {
        "from",
        "to",
        "last_replayed",
        "comparison",
        "tolerant_from",
        "reason",
        "max_residual_ratio",
    }
    # people get the summary on stderr: verdict, what was replayed and why, where to resume
    for text in ("CORRUPTION", "first divergent step 4", "Replayed on cpu", "step 4 from checkpoint 4", "Resume from"):
        assert text in result.stderr


def test_exit_1_replay_command_diverges(faulty_run):
    result = _run(
        "replay", faulty_run / "trace", "--from", 4, "--to", 4, "--checkpoints", faulty_run / "checkpoints", "--json"
    )
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["first_divergent_step"] == 4 and doc["comparison"] == "exact"


def test_exit_2_usage(clean_run):
    result = _run("replay", clean_run / "trace", "--from", 4, "--to", 2)
    assert result.exit_code == 2
    assert "--to 2 is before --from 4" in result.stderr
    result = _run("replay", clean_run / "trace", "--from", 3, "--to", 4)
    assert result.exit_code == 2 and "not a checkpoint step" in result.stderr


def test_exit_2_unknown_device(clean_run):
    result = _run("bisect", clean_run / "trace", "--checkpoints", clean_run / "checkpoints", "--device", "tpu")
    assert result.exit_code == 2 and "'tpu' is not a torch device" in result.stderr
    assert "replaying" not in result.stderr


def test_exit_3_not_a_trace(tmp_path):
    result = _run("bisect", tmp_path)
    assert result.exit_code == 3
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr and "manifest.json" in result.stderr


def test_exit_4_inconclusive_without_recipe_says_what_would_settle_it(make_trace):
    path = make_trace(steps=10)
    result = _run("bisect", path, "--json")
    assert result.exit_code == 4, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "inconclusive" and doc["mode"] == "trace-only"
    assert any("--recipe" in line for line in doc["settle"])
    assert "to settle:" in result.stderr


def test_trace_only_verdict_without_recipe(make_trace):
    path = make_trace(fault=Fault(kind="nonfinite", step=6, rank=1))
    result = _run("bisect", path, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert (doc["first_divergent_step"], doc["suspects"][0]["rank"], doc["suspects"][0]["location"]) == (
        6,
        1,
        "local_compute",
    )


def test_recurring_rank_is_told_to_drain(make_trace):
    path = make_trace(fault=(Fault(kind="nonfinite", step=3, rank=2), Fault(kind="allreduce", step=9, rank=2)))
    doc = json.loads(_run("bisect", path, "--trace-only", "--json").stdout)
    [suspect] = doc["suspects"]
    assert suspect["recurring"] is True and suspect["steps"] == [3, 9] and "drain" in suspect["recommendation"]
    single = json.loads(
        _run("bisect", make_trace(fault=Fault(kind="nonfinite", step=3, rank=2)), "--trace-only", "--json").stdout
    )
    assert single["suspects"][0]["recurring"] is False and "DCGM diagnostic" in single["suspects"][0]["recommendation"]


def test_trace_only_never_imports_torch(faulty_run):
    code = (
        "import sys\nfrom sdc_forensics.cli.main import cli\n"
        f"try:\n    cli.main(['bisect', {str(faulty_run / 'trace')!r}, '--trace-only', '--json'], standalone_mode=False)\n"
        "except SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["mode"] == "trace-only"


def test_trace_only_with_outlier_hints_is_inconclusive(make_trace):
    result = _run("bisect", make_trace(fault=Fault(kind="outlier", step=3, rank=1)), "--trace-only", "--json")
    assert result.exit_code == 4
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "inconclusive" and doc["suspects"] == [] and doc["hints"][0]["step"] == 3
    assert "step(s) 3" in doc["settle"][0]


def test_exit_3_recipe_that_cannot_be_imported(clean_run):
    result = _run(
        "bisect", clean_run / "trace", "--checkpoints", clean_run / "checkpoints", "--recipe", "no_such_module:recipe"
    )
    assert result.exit_code == 3
    assert "cannot import recipe module 'no_such_module'" in result.stderr and "Traceback" not in result.stderr
