"""A pipeline whose stages hold different numbers of ``fully_shard`` groups is recorded.

An uneven cut (stage 0 two blocks, stage 1 one) or a middle stage whose root holds no parameter
makes its ranks reduce-scatter a different number of times per step than the other stage's.
The reduce-scatter check once compared the counts across all ranks and refused every step; its
table now has as many call slots as the most any rank makes (gathered once), each rank's calls
in its own rows. PP 2 x DP 2 on 4 gloo processes, 1F1B, SGD: a clean run raises no alarm, a
flipped reduce-scatter output on a stage-1 rank is named at its step and rank, and recording at
once and deferred (``deferred_checks``, now a pipeline's too) gives the same trace, record for
record.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import gloo_job, records_by_rank

WORLD = 4
STEPS = 4
FAULT = "reduce-scatter-output:step=2:rank=3:bit=29"


def _job(rank: int, root: str, deferred: bool, faults: tuple[str, ...]) -> dict:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from sdc_forensics.recorder import Recorder, RecorderOptions

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_coordinate()
    torch.manual_seed(0)
    # stage 0 holds layers 0 and 1, stage 1 layer 2: three groups against two
    part = nn.Sequential()
    for i in (0, 1) if pp == 0 else (2,):
        block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        part.add_module(f"layer{i}", block)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(part, mesh=mesh["dp"])
    stage = PipelineStage(part, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, 2, loss_fn=lambda out, y: nn.functional.mse_loss(out, y))
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    options = RecorderOptions(policy="continue", deferred_checks=deferred)
    trace = Path(root, "trace")
    with Recorder(trace, schedule, optimizer, options=options, inject=faults) as rec:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(step * 10 + dp)
            x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
            with rec.step(step, microbatch_ids=[step * 2 + dp]) as handle:
                if pp == 0:
                    schedule.step(handle.input((x,))[0])
                else:
                    losses: list = []
                    schedule.step(target=y, losses=losses)
                    handle.loss(torch.stack(losses).sum())
                optimizer.step()
                optimizer.zero_grad()
    return {"alarms": [(a.step, a.rank, str(a.check)) for a in rec.alarms]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = {}
    for name, deferred, faults in (("clean", False, ()), ("at-once", False, (FAULT,)), ("deferred", True, (FAULT,))):
        root = tmp_path_factory.mktemp(name)
        found[name] = (root, gloo_job(_job, WORLD, root / "out", str(root), deferred, faults))
    return found


@pytest.mark.heavy
def test_an_uneven_pipeline_is_recorded_and_a_clean_run_raises_nothing(runs):
    _, results = runs["clean"]
    assert all(result["alarms"] == [] for result in results), results


@pytest.mark.heavy
def test_a_flipped_reduce_scatter_output_on_the_short_stage_is_named_at_its_step_and_rank(runs):
    for name in ("at-once", "deferred"):
        _, results = runs[name]
        for result in results:
            named = {(step, rank) for step, rank, _ in result["alarms"]}
            assert (2, 3) in named, (name, result)
            assert all(step >= 2 for step, _ in named), (name, result)


@pytest.mark.heavy
def test_recorded_at_once_and_deferred_the_traces_are_the_same_record_for_record(runs):
    at_once = records_by_rank(runs["at-once"][0] / "trace", WORLD)
    assert at_once == records_by_rank(runs["deferred"][0] / "trace", WORLD)
