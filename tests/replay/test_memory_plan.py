"""Issue 35, memory planned: a sharded demo job (FSDP over 4 gloo ranks, the demo MLP, SGD with
momentum) sized from its DCP checkpoint's metadata, and a one-process replay refused up front
(exit 2, one line naming the processes it needs) under a budget the plan derives for 2 processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.replay import memory, preflight
from sdc_forensics.trace.manifest import read_manifest

NUMEL = 24 * 96 + 96 + 96 + 96 + 96 * 5 + 5  # Linear(24, 96), LayerNorm(96), Linear(96, 5)


@pytest.fixture(scope="module")
def fsdp_demo(tmp_path_factory) -> Path:
    from sdc_forensics.demo.sharded import run_demo

    out = tmp_path_factory.mktemp("memory_plan") / "demo"
    run_demo(out, "fsdp", (), steps=4, checkpoint_every=2)
    return out


def _budget_for(trace: Path, k: int, monkeypatch) -> str:
    """The plan's own estimate for ``k`` processes, as a budget (bytes)."""
    monkeypatch.delenv(memory.BUDGET_ENV, raising=False)
    monkeypatch.setenv(memory.ACTIVATIONS_ENV, "0")
    return str(memory.plan_trace(trace).per_process(k))


def test_plan_from_the_checkpoint(fsdp_demo, monkeypatch):
    budget = _budget_for(fsdp_demo / "trace", 2, monkeypatch)
    monkeypatch.setenv(memory.BUDGET_ENV, budget)
    plan = memory.plan_trace(fsdp_demo / "trace")
    assert plan is not None and plan.sharded and plan.world_size == 4
    assert plan.numel == NUMEL and plan.params_bytes == 4 * NUMEL
    assert plan.optimizer_bytes == 4 * NUMEL and not plan.optimizer_assumed  # SGD momentum, read from the checkpoint
    grad = 4 * NUMEL
    # state + 4 ranks' local gradients + the reduced one + the reduction's three temporaries
    assert plan.one_process() == 3 * grad + 8 * grad + memory.RUNTIME_BYTES
    # the recorded groups: Linear(24, 96) and its bias the largest; its weight the largest parameter
    group = 4 * (24 * 96 + 96)
    assert plan.largest_group_bytes == group and plan.largest_param_bytes == 4 * 24 * 96
    # the state and the float32 accumulator halved; the unsharded gradient, its largest parameter, three all-gathers not
    expected_2 = -(-3 * grad // 2) + -(-grad // 2) + grad + 4 * 24 * 96 + 3 * group + memory.RUNTIME_BYTES
    assert plan.per_process(2) == expected_2 == plan.budget < plan.one_process()
    assert plan.processes_needed() == 2
    assert "the replay needs 2 processes" in plan.lines()[1]
    flight = preflight.check(read_manifest(fsdp_demo / "trace"), trace_dir=fsdp_demo / "trace")
    assert flight.memory == plan and flight.to_json()["memory"]["processes_needed"] == 2
    assert any("needs 2 processes" in line for line in flight.lines())


def test_optimizer_assumed_when_not_saved(fsdp_demo):
    from sdc_forensics.checkpoint.base import TensorInfo

    infos = [TensorInfo(key="w", dtype="bfloat16", shape=(1000, 10), file="f")]
    plan = memory.plan_from_infos(infos, read_manifest(fsdp_demo / "trace"))
    assert plan.optimizer_assumed and plan.optimizer_bytes == 8 * 10_000 and plan.params_bytes == 2 * 10_000
    assert "assumed: AdamW" in plan.lines()[0]
    # no parameter names: the groups cannot be sized, so the whole model counts as all-gathered at once
    assert plan.largest_group_bytes == plan.params_bytes == plan.largest_param_bytes
    # bfloat16 parameters: the accumulator is float32; state 12 bytes per element (2 + 2 + AdamW's 8)
    assert plan.acc_itemsize == 4
    assert plan.per_process(2) - plan.per_process(4) == (-(-12 * 10_000 // 2) + -(-4 * 10_000 // 2)) - (
        -(-12 * 10_000 // 4) + -(-4 * 10_000 // 4)
    )


def test_one_process_replay_refused(fsdp_demo, monkeypatch):
    monkeypatch.setenv(memory.BUDGET_ENV, _budget_for(fsdp_demo / "trace", 2, monkeypatch))
    result = CliRunner().invoke(
        cli,
        ["bisect", str(fsdp_demo / "trace"), "--no-ledger"]
        if _has_no_ledger()
        else ["bisect", str(fsdp_demo / "trace")],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "needs 2 processes" in lines[0] and "--nproc-per-node 2" in lines[0]
    inspected = CliRunner().invoke(cli, ["inspect", str(fsdp_demo / "trace")])
    assert inspected.exit_code == 0 and "the replay needs 2 processes" in inspected.output


def _has_no_ledger() -> bool:
    help_text = CliRunner().invoke(cli, ["bisect", "--help"]).output
    return "--no-ledger" in help_text
