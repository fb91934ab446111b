"""Issue 36: what the pipeline layout does not record is refused in one line before anything is
written (``recorder/pp_layout.py``): the schedules whose backwards do not accumulate each stage's
microbatches in order as full backwards (``ScheduleLoopedBFS``, the zero-bubble ones), a schedule
it does not know, a stage whose module is not ``fully_shard``-ed, a parameter two stages hold,
pipeline x context parallel, audits.
2 gloo processes, a ``(pp, dp)`` mesh of 2 x 1; each case checks the line on every rank and that
the trace directory was never created; the plain case and an interleaved one (two stages per rank)
record."""

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
    from torch.distributed.pipelining import schedules

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

    def two_stages(ids: list[int]) -> tuple[list, list]:
        """This rank's two stages ``ids`` of 4, each ``fully_shard``-ed, holding ``layer{stage}``."""
        parts = []
        for i in ids:
            part = nn.Sequential()
            part.add_module(f"layer{i}", nn.Linear(8, 8))
            fully_shard(part, mesh=mesh["dp"])
            parts.append(part)
        stages = [
            PipelineStage(m, i, 2 * WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
            for i, m in zip(ids, parts)
        ]
        return stages, [p for m in parts for p in m.parameters()]

    # two stages per rank, loop placement: stages rank and rank + 2 of 4
    stages, params = two_stages([rank, rank + WORLD])
    found["interleaved"] = attempt("interleaved", ScheduleInterleaved1F1B(stages, 2, loss_fn=loss_fn), params)
    for name in ("ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"):
        stages, params = two_stages([rank, rank + WORLD])
        found[name] = attempt(name, getattr(schedules, name)(stages, 2, loss_fn=loss_fn), params)
    # V placement: stages rank and 3 - rank
    for name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        stages, params = two_stages([rank, 2 * WORLD - 1 - rank])
        # (DualPipeV needs a microbatch per stage)
        found[name] = attempt(name, getattr(schedules, name)(stages, 4, loss_fn=loss_fn), params)
    bare = nn.Linear(8, 8)
    bare_stage = PipelineStage(bare, rank, WORLD, torch.device("cpu"), group=mesh["pp"].get_group())
    found["not-sharded"] = attempt(
        "not-sharded", ScheduleGPipe(bare_stage, 2, loss_fn=loss_fn), list(bare.parameters())
    )
    # pipeline x context parallel: a (pp, dp_shard, cp) mesh (PP x HSDP, with or without TP, is
    # recorded: tests/replay/test_pp_hsdp.py, tests/replay/test_4d_replay.py)
    mesh_cp = init_device_mesh("cpu", (WORLD, 1, 1), mesh_dim_names=("pp", "dp_shard", "cp"))
    cp_part = nn.Sequential()
    cp_part.add_module(f"layer{rank}", nn.Linear(8, 8))
    fully_shard(cp_part, mesh=mesh_cp["dp_shard"])
    cp_stage = PipelineStage(cp_part, rank, WORLD, torch.device("cpu"), group=mesh_cp["pp"].get_group())
    found["pp-cp"] = attempt("pp-cp", ScheduleGPipe(cp_stage, 2, loss_fn=loss_fn), list(cp_part.parameters()))
    return found


def test_what_the_pipeline_layout_does_not_record_is_refused_before_anything_is_written(tmp_path):
    expected = {
        "audits": "audits recompute a rank's microbatches on a whole model, which a pipeline stage is not",
        "tied": "parameter '0.weight' is held by two pipeline stages (tied across stages): not recorded yet",
        "unknown": "the pipeline schedule MySchedule is not recorded; the recorder records ScheduleGPipe, Schedule1F1B",
        "ScheduleLoopedBFS": "ScheduleLoopedBFS runs each stage's backwards from the last microbatch to the first",
        "ScheduleInterleavedZeroBubble": "ScheduleInterleavedZeroBubble splits each microbatch's backward into input "
        "and weight gradients (zero bubble): not recorded yet",
        "ScheduleZBVZeroBubble": "ScheduleZBVZeroBubble splits each microbatch's backward into input and weight",
        "ScheduleDualPipeV": "ScheduleDualPipeV splits each microbatch's backward into input and weight gradients",
        "not-sharded": "the pipeline stage's module is not sharded by fully_shard",
        "pp-cp": "a pipeline job on a mesh of dimensions ('pp', 'dp_shard', 'cp')",
    }
    for rank, found in enumerate(gloo_job(_refusals, WORLD, tmp_path / "results", str(tmp_path))):
        assert found["plain"] == ["recorded", True], (rank, found["plain"])
        assert found["interleaved"] == ["recorded", True], (rank, found["interleaved"])
        for case, start in expected.items():
            line, written = found[case]
            # one line, this case's, on every rank, and no trace directory
            assert line.startswith(start) and "\n" not in line, (rank, case, line)
            assert not written, (rank, case)
