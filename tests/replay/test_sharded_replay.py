"""Issue 35, a sharded replay under torchrun: an FSDP job over 4 gloo ranks (the demo MLP, SGD with
momentum, ordered reduce-scatter, float32, no clipping) replayed with the model fully_shard-ed over
k = 2 and k = 4 processes: the clean run certified bit for bit under a memory budget that refuses
the one-process replay, and a local-gradient fault found at its step and rank, with the evidence
of the one-process replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.replay import memory, sharded

from tests.distributed.launch import torchrun

pytestmark = pytest.mark.heavy  # torchrun launches of 2 and 4 processes, about 2.5 minutes in all

FAULT = ("local-gradient:step=4:rank=2:bit=20", 4, 2)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    from sdc_forensics.demo.sharded import run_demo

    root = tmp_path_factory.mktemp("sharded_replay")
    run_demo(root / "clean", "fsdp", (), steps=6, checkpoint_every=3)
    run_demo(root / "fault", "fsdp", (FAULT[0],), steps=6, checkpoint_every=3)
    return {"clean": root / "clean" / "trace", "fault": root / "fault" / "trace"}


def _budget(trace: Path, k: int, monkeypatch) -> dict[str, str]:
    """The environment of a replay whose per-process budget is the memory plan's own estimate for ``k`` processes."""
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    monkeypatch.setenv(memory.ACTIVATIONS_ENV, "0")
    plan = memory.plan_trace(trace)
    return {memory.BUDGET_ENV: str(plan.per_process(k)), memory.ACTIVATIONS_ENV: "0"}


def _bisect(trace: Path, k: int, env=None) -> tuple[int, dict]:
    (trace / "ledger.jsonl").unlink(missing_ok=True)  # every run replays, none reuses another's records
    if k == 1:
        result = CliRunner().invoke(cli, ["bisect", str(trace), "--json"], env=env)
        return result.exit_code, json.loads(result.stdout)
    rc, out, err, _ = torchrun(k, ["-m", "sdc_forensics", "bisect", str(trace), "--json"], timeout_s=240, env=env)
    assert out.strip(), err[-3000:]
    return rc, json.loads(out)


def _evidence(doc: dict) -> list:
    return sorted((e["kind"], e["step"], tuple(e["ranks"]), e.get("location")) for e in doc["evidence"])


@pytest.mark.parametrize("k", [2, 4])
def test_sharded_replay_certifies_under_a_budget_one_process_cannot_meet(jobs, k, monkeypatch):
    """The budget is the plan's estimate for 2 processes: the one-process replay exceeds it, 2 and 4 fit."""
    small = _budget(jobs["clean"], 2, monkeypatch)
    for name, value in small.items():
        monkeypatch.setenv(name, value)
    plan = memory.plan_trace(jobs["clean"])
    assert plan.processes_needed() == 2 and not plan.fits(1) and plan.fits(4)
    monkeypatch.delenv(memory.BUDGET_ENV)
    rc, doc = _bisect(jobs["clean"], k, env=small)
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert all(c["status"] == "clean" for c in doc["checkpoints"])
    assert f"x {k} processes (sharded)" in json.dumps(doc)


def test_a_model_that_fits_one_process_keeps_the_whole_model_replay_under_torchrun(jobs):
    """The sharded replay is for what does not fit (or asked for): under torchrun with no budget the
    replay every sharded layout certifies on (the whole model per process) runs, as before."""
    rc, doc = _bisect(jobs["clean"], 2)
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert "(sharded)" not in json.dumps(doc)


def test_local_gradient_fault_found_as_by_one_process(jobs):
    rc1, one = _bisect(jobs["fault"], 1)
    assert rc1 == 1
    for k in (2, 4):
        rc, doc = _bisect(jobs["fault"], k, env={sharded.SHARDED_ENV: "1"})  # asked for: the whole model would fit
        assert rc == 1 and doc["verdict"] == one["verdict"] == "corruption"
        assert _evidence(doc) == _evidence(one)
        assert ("replay_mismatch", FAULT[1], (FAULT[2],), "local_compute") in _evidence(doc)


def test_a_model_that_needs_four_processes_is_certified_on_four(jobs, monkeypatch):
    """A per-process budget (the memory plan's estimate for 4 processes) that the whole model's replay
    and a replay on 2 processes exceed: one process and 2 processes are refused up front (exit 2, one
    line naming 4 processes), 4 processes certify, each planned under the limit."""
    budget = _budget(jobs["clean"], 4, monkeypatch)
    for name, value in budget.items():
        monkeypatch.setenv(name, value)
    plan = memory.plan_trace(jobs["clean"])
    assert plan.processes_needed() == 4 and plan.per_process(4) <= plan.budget < plan.per_process(2)
    for k in (1, 2):
        if k == 1:
            result = CliRunner().invoke(cli, ["bisect", str(jobs["clean"]), "--json"])
            rc, err = result.exit_code, result.output
        else:
            args = ["-m", "sdc_forensics", "bisect", str(jobs["clean"]), "--json"]
            rc, _, err, _ = torchrun(k, args, timeout_s=240, env=budget)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        # a process still starting when another refused is stopped by torchrun, and says so (CI saw
        # one importing the recipe then): every other error line is the refusal
        refused = [line for line in errors if "the launcher stopped this replay process (SIGTERM)" not in line]
        # the CLI's exit 2 (torchrun itself exits 1 when its workers fail)
        assert (
            rc in ((2,) if k == 1 else (1, 2)) and refused and all("it needs 4 processes" in line for line in refused)
        ), err[-2000:]
    rc, doc = _bisect(jobs["clean"], 4, env=budget)
    assert rc == 0 and doc["verdict"] == "clean" and "x 4 processes (sharded)" in json.dumps(doc)
