"""Issue 36: what the recorder does not record is refused in one line before anything is written
(``recorder/tp_layout.py``, ``recorder/pp_layout.py``): a pipeline stage alone (the schedule is
what the recorder takes), a stage's module, and a
model sharded over a mesh (or a sub-mesh of one) with a pipeline, context or expert parallel
dimension, or a dimension name it does not know. 2 gloo processes; each case checks the line on
every rank and that the trace directory was never created."""

from __future__ import annotations

from pathlib import Path

from tests.factories import gloo_job

WORLD = 2
#: case: (mesh shape, dimension names, the FSDP2 dimension, the TP dimension or ""). The parameters
#: sit on sub-meshes; two sub-meshes equal by value (same ranks, same names) are one to torch's
#: caches within a process, so no two cases' parameter meshes are equal
MESHES = {
    "pp": ((1, 2), ("pp", "dp"), "dp", ""),
    "cp": ((2, 1), ("dp_shard", "cp"), "dp_shard", ""),
    "ep": ((1, 2, 1), ("dp", "tp", "ep"), "dp", "tp"),
    "unknown": ((1, 2), ("x", "tp"), "x", "tp"),
}


def _refusals(rank: int, root: str) -> dict[str, list]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder import Recorder

    def attempt(name: str, model, params) -> list:
        trace = Path(root, f"trace-{name}")
        try:
            Recorder(trace, model, torch.optim.SGD(params, lr=0.1), recipe="x:y").close()
            line = "recorded"
        except UsageError as refusal:
            line = str(refusal)
        return [line, trace.exists()]

    found = {}
    # a two-stage pipeline: each rank one stage
    stage = PipelineStage(nn.Linear(8, 8), rank, WORLD, torch.device("cpu"))
    found["stage"] = attempt("stage", stage, list(stage.submod.parameters()))
    for name, (shape, names, dp, tp) in MESHES.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        if tp:
            parallelize_module(model, mesh[tp], {"0": ColwiseParallel()})
        fully_shard(model, mesh=mesh[dp])
        found[name] = attempt(name, model, list(model.parameters()))
    # trial users' TP jobs: TP without fully_shard, and a first layer left out of the TP plan (no sequence parallel)
    # (dp_shard, tp): no sub-mesh equal by value to an earlier case's
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel()})
    found["tp-only"] = attempt("tp-only", model, list(model.parameters()))
    fully_shard(model, mesh=mesh["dp_shard"])
    found["outside-tp-plan"] = attempt("outside-tp-plan", model, list(model.parameters()))
    return found


def test_pipeline_context_expert_and_unknown_dimensions_are_refused_before_anything_is_written(tmp_path):
    expected = {
        "stage": "a PipelineStage alone: pass the pipeline schedule (ScheduleGPipe or Schedule1F1B) to the Recorder",
        "pp": "a pipeline stage's module (mesh dimension 'pp'): pass the pipeline schedule to the Recorder",
        "cp": "mesh dimension 'cp' (context parallelism): not recorded yet",
        "ep": "mesh dimension 'ep' (expert parallelism): not recorded yet",
        "unknown": "a mesh of dimensions ('x', 'tp'): the recorder records tensor parallelism on a mesh named (dp, tp)",
        "tp-only": "a tensor-parallel model without fully_shard is not recorded: apply fully_shard over mesh['dp']",
        "outside-tp-plan": "parameter 0 is on a mesh without 'tp' (('dp_shard',)) while others are on ('dp_shard', "
        "'tp'): every parameter must be in the TP plan",
    }
    for rank, found in enumerate(gloo_job(_refusals, WORLD, tmp_path / "results", str(tmp_path))):
        for case, start in expected.items():
            line, written = found[case]
            # one line, this case's, on every rank, and no trace directory
            assert line.startswith(start) and "\n" not in line, (rank, case, line)
            assert not written, (rank, case)
