"""Issue 36: what the pipeline layout does not record is refused in one line before anything is
written (``recorder/pp_layout.py``): a schedule with several stages per rank, a schedule it does
not know, a stage whose module is not ``fully_shard``-ed, a parameter two stages hold, pipeline x
HSDP, audits.
2 gloo processes, a ``(pp, dp)`` mesh of 2 x 1; each case checks the line on every rank and that
the trace directory was never created, and the plain case records."""

from __future__ import annotations

from pathlib import Path

from tests.factories import gloo_job

WORLD = 2


def _refusals(rank: int, root: str) -> dict[str, list]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder import Recorder, RecorderOptions

    def loss_fn(out, target):
        return nn.functional.mse_loss(out, target)

    def attempt(name: str, schedule, params, **kwargs) -> list:
        trace = Path(root, f"trace-{name}")
        try:
            Recorder(trace, schedule, torch.optim.SGD(params, lr=0.1), recipe="x:y", **kwargs).close()
            line = "recorded"
        except UsageError as refusal:
            line = str(refusal)
        return [line, trace.exists()]

    found = {}
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    # each stage's parameters keep their whole-model names (stage r holds layer r)
    part = nn.Sequential()
    part.add_module(f"layer{rank}", nn.Linear(8, 8))
    fully_shard(part, mesh=mesh["dp"])
    stage = PipelineStage(part, rank, WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
    found["plain"] = attempt("plain", ScheduleGPipe(stage, 2, loss_fn=loss_fn), list(part.parameters()))
    found["audits"] = attempt(
        "audits",
        ScheduleGPipe(stage, 2, loss_fn=loss_fn),
        list(part.parameters()),
        options=RecorderOptions(audit_every=2),
    )

    # both stages hold a parameter of one name: a weight tied across stages (or a cut that renamed them)
    same = nn.Sequential(nn.Linear(8, 8))
    fully_shard(same, mesh=mesh["dp"])
    same_stage = PipelineStage(same, rank, WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
    found["tied"] = attempt("tied", ScheduleGPipe(same_stage, 2, loss_fn=loss_fn), list(same.parameters()))

    class MySchedule(ScheduleGPipe):
        pass

    found["unknown"] = attempt("unknown", MySchedule(stage, 2, loss_fn=loss_fn), list(part.parameters()))
    # two stages per rank: stages rank and rank + 2 of 4
    parts = [nn.Linear(8, 8) for _ in range(2)]
    stages = [
        PipelineStage(m, rank + WORLD * i, 2 * WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
        for i, m in enumerate(parts)
    ]
    params = [p for m in parts for p in m.parameters()]
    found["interleaved"] = attempt("interleaved", ScheduleInterleaved1F1B(stages, 2, loss_fn=loss_fn), params)
    bare = nn.Linear(8, 8)
    bare_stage = PipelineStage(bare, rank, WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
    found["not-sharded"] = attempt(
        "not-sharded", ScheduleGPipe(bare_stage, 2, loss_fn=loss_fn), list(bare.parameters())
    )
    # pipeline x HSDP: a (pp, dp_replicate, dp_shard) mesh
    mesh3 = init_device_mesh("cpu", (WORLD, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    hsdp_part = nn.Sequential()
    hsdp_part.add_module(f"layer{rank}", nn.Linear(8, 8))
    fully_shard(hsdp_part, mesh=mesh3["dp_replicate", "dp_shard"])
    hsdp_stage = PipelineStage(hsdp_part, rank, WORLD, torch.device("cpu"), group=mesh3["pp"].get_group())
    found["pp-hsdp"] = attempt("pp-hsdp", ScheduleGPipe(hsdp_stage, 2, loss_fn=loss_fn), list(hsdp_part.parameters()))
    return found


def test_what_the_pipeline_layout_does_not_record_is_refused_before_anything_is_written(tmp_path):
    expected = {
        "audits": "audits recompute a rank's microbatches on a whole model, which a pipeline stage is not",
        "tied": "parameter '0.weight' is held by two pipeline stages (tied across stages): not recorded yet",
        "unknown": "the pipeline schedule MySchedule is not recorded; the recorder records ScheduleGPipe, Schedule1F1B",
        "interleaved": "ScheduleInterleaved1F1B runs several stages per rank: not recorded yet",
        "not-sharded": "the pipeline stage's module is not sharded by fully_shard",
        "pp-hsdp": "a pipeline job on a mesh of dimensions ('pp', 'dp_replicate', 'dp_shard')",
    }
    for rank, found in enumerate(gloo_job(_refusals, WORLD, tmp_path / "results", str(tmp_path))):
        assert found["plain"] == ["recorded", True], (rank, found["plain"])
        for case, start in expected.items():
            line, written = found[case]
            # one line, this case's, on every rank, and no trace directory
            assert line.startswith(start) and "\n" not in line, (rank, case, line)
            assert not written, (rank, case)
