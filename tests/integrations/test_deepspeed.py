"""Issue 38: a DeepSpeed engine under ZeRO stage 1, 2 and 3 recorded with
``sdc_forensics.integrations.deepspeed.record`` (tests/integrations/dsjob.py, 2 gloo processes on
DeepSpeed's CPU accelerator, fp32, torch's AdamW) is replayed exactly and judged by the unchanged
CLI: a clean run certifies every checkpoint, also clipped under ZeRO 1 and 2 (the recipe's
``before_step`` calls ``clip_grad_norm_``), a gradient bit flip is found at its step and rank.
Skipped, with the reason, without the ``deepspeed`` extra.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed: pip install -e '.[deepspeed]'")

from tests.cli.installed import run_installed  # noqa: E402
from tests.integrations.launch import REPO, assert_ok, run_ranks  # noqa: E402

JOB = "tests.integrations.dsjob"
ENV = {"PYTHONPATH": str(REPO)}


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def _assert_certified_exactly(tmp_path):
    """``certify`` of the job's trace: exit 0, checkpoints 0, 3 and 6 clean, every step replayed exactly."""
    certified = run_installed(["certify", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert certified.returncode == 0, certified.stderr
    doc = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert "exact now 0..5" in certified.stderr, certified.stderr


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_clean_zero_run_is_certified_with_every_step_replayed_exactly(tmp_path, stage):
    assert_ok(run_ranks(JOB, ["--stage", str(stage), "--trace", "trace", "--out", "out"], cwd=tmp_path))
    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)
    assert inspected["framework"]["adapter"] == "sdc_forensics.integrations.deepspeed"
    _assert_certified_exactly(tmp_path)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("stage", [2, 3])
def test_a_gradient_fault_under_zero_is_found_at_its_step_and_rank(tmp_path, stage):
    # bit 29: a high exponent bit of one element of rank 1's local gradient, which ZeRO then reduces
    argv = ["--stage", str(stage), "--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=1:bit=29"]
    assert_ok(run_ranks(JOB, argv, cwd=tmp_path))
    ran = run_installed(["bisect", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    assert (doc["verdict"], doc["first_divergent_step"], [s["rank"] for s in doc["suspects"]]) == ("corruption", 4, [1])
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "tainted"}


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("stage", [1, 2])
def test_a_clipped_zero_run_is_certified_with_deepspeeds_norm_replayed_exactly(tmp_path, stage):
    # 0.05: below every step's total norm (0.5 to 0.84 here), so DeepSpeed clips every step
    ranks = run_ranks(JOB, ["--stage", str(stage), "--trace", "trace", "--out", "out", "--clip", "0.05"], cwd=tmp_path)
    assert_ok(ranks)
    norms = [float(line.rsplit(" ", 1)[1]) for line in ranks[0].stderr.splitlines() if " grad_norm " in line]
    assert len(norms) == 6 and min(norms) > 0.05, ranks[0].stderr[-2000:]
    _assert_certified_exactly(tmp_path)


@pytest.mark.slow
@pytest.mark.heavy
def test_clipping_under_zero_3_is_refused_in_one_line_before_anything_is_written(tmp_path):
    ranks = run_ranks(JOB, ["--stage", "3", "--trace", "trace", "--out", "out", "--clip", "1.0"], cwd=tmp_path)
    _assert_refused_in_one_line(ranks, '"gradient_clipping": 0.0', "ZeRO stage 3")
    assert not (tmp_path / "trace" / "manifest.json").exists()


def _assert_refused_in_one_line(ranks, *words: str) -> None:
    """Every rank exits 2 (an adapter's Refusal), rank 0 says why in one line, nobody prints a traceback."""
    assert all(r.returncode == 2 for r in ranks), [r.returncode for r in ranks]
    assert all(w in ranks[0].stderr for w in words), ranks[0].stderr[-2000:]
    assert not any("Traceback" in r.stderr for r in ranks), ranks[0].stderr[-2000:]


@pytest.mark.slow
@pytest.mark.heavy
def test_gradient_accumulation_under_zero_1_is_certified_with_every_step_replayed_exactly(tmp_path):
    # 2 microbatches per rank-step: engine.step() at the boundary only, ZeRO 1 reduces once there
    argv = ["--stage", "1", "--trace", "trace", "--out", "out", "--accumulation", "2"]
    assert_ok(run_ranks(JOB, argv, cwd=tmp_path))
    _assert_certified_exactly(tmp_path)


@pytest.mark.slow
@pytest.mark.heavy
def test_gradient_accumulation_under_zero_2_is_refused_in_one_line_before_anything_is_written(tmp_path):
    ranks = run_ranks(JOB, ["--stage", "2", "--trace", "trace", "--out", "out", "--accumulation", "2"], cwd=tmp_path)
    _assert_refused_in_one_line(ranks, "gradient_accumulation_steps=2 under ZeRO stage 2")
    assert not (tmp_path / "trace" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.heavy
def test_a_three_rank_zero_2_run_is_never_certified(tmp_path):
    # docs/integrations.md: above 2 ranks ZeRO's summation order is none the replay knows, so the
    # replay is compared within tolerance and certifies nothing (exit 4), never a false certificate
    argv = ["--stage", "2", "--trace", "trace", "--out", "out", "--clip", "0.05"]
    assert_ok(run_ranks(JOB, argv, world=3, cwd=tmp_path))
    certified = run_installed(["certify", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    doc = json.loads(certified.stdout)
    assert certified.returncode == 4 and doc["verdict"] != "corruption", certified.stderr
    assert all(c["status"] != "clean" or c["step"] == 0 for c in doc["checkpoints"]), doc["checkpoints"]
