"""Issue 36: pipeline parallel x HSDP on torchtitan's ``(pp, dp_replicate, dp_shard)`` mesh, recorded
(``recorder/pp_layout.py``) and replayed exactly on one process (``replay/pp.py``).

The demo's PP job with 2 stages x 2 replicas x 2 shards (8 gloo processes): each stage
``fully_shard``-ed over ``mesh["dp_replicate", "dp_shard"]``, so its gradient is reduce-scattered
over a replica's shards, then all-reduced over the replicas of each shard; the replicas of one
(stage, shard) vote on its weights. The replay reduces stage 0's ranks as HSDP does (each replica's
mean, then the replicas'). A clean run in gloo's own order and one with the ordered reduction and
clipping that engages on every step are certified bit for bit at every checkpoint; a mantissa-bit-3
local-gradient flip, a weights-at-rest flip and a flip of HSDP's all-reduce output on one rank are
each named at their step and rank with the rank's three coordinates, no other rank suspected and
the checkpoint after them not certified.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from tests.factories import gloo_job

# five 8-process jobs in one launch, replayed on one process: a few minutes on 2 cores
pytestmark = pytest.mark.heavy

WORLD, STEPS, EVERY, CLIP = 8, 7, 3, 0.05
# name -> (spec, step, rank, coordinates); rank = pp * 4 + replica * 2 + shard (init_device_mesh's order)
FAULTS = {
    "local": ("local-gradient:step=4:rank=6:bit=3", 4, 6, "pp=1, dp_replicate=1, dp_shard=0"),
    "weights": ("weights:step=4:rank=3:bit=29", 4, 3, "pp=0, dp_replicate=1, dp_shard=1"),
    "all-reduce": ("all-reduce-output:step=4:rank=5:bit=30", 4, 5, "pp=1, dp_replicate=0, dp_shard=1"),
}


def _jobs(rank: int, root: str, runs: list) -> dict:
    from sdc_forensics.demo.pp import train

    out = {}
    for name, inject, reduction, max_norm in runs:
        out[name] = train(
            rank,
            WORLD,
            str(Path(root, name, "trace")),
            str(Path(root, name, "ckpt")),
            steps=STEPS,
            checkpoint_every=EVERY,
            inject=tuple(inject),
            reduction=reduction,
            max_norm=max_norm,
            replicate=2,
        )
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("pp_hsdp")
    todo = [("clean", [], "native", 0.0), ("clipped-ordered", [], "ordered", CLIP)]
    todo += [(name, [spec], "native", 0.0) for name, (spec, *_) in FAULTS.items()]
    results = gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    return {name: (root / name, results[0][name]) for name, *_ in todo}


def _run(job: Path, command: str) -> tuple[int, dict]:
    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)
    args = [command, str(job / "trace"), "--checkpoints", str(job / "ckpt"), "--json"]
    result = CliRunner().invoke(cli, args)
    return result.exit_code, json.loads(result.stdout)


def test_the_trace_notes_the_pipeline_and_hsdp_dimensions(traces):
    mesh = json.loads((traces["clean"][0] / "trace" / "manifest.json").read_text())["parallel"]
    assert mesh["dim_names"] == ["pp", "dp_replicate", "dp_shard"] and mesh["shape"] == [2, 2, 2], mesh
    assert mesh["kind"] == "pp" and mesh["pp_dim"] == 0 and mesh["shard_dim"] == 2, mesh


@pytest.mark.parametrize("job", ["clean", "clipped-ordered"])
def test_a_clean_pp_hsdp_run_is_certified_bit_for_bit(traces, job):
    path, result = traces[job]
    assert not result["alarms"], result
    if job.startswith("clipped"):
        assert result["grad_norms"] and all(n > CLIP for n in result["grad_norms"]), result
    rc, doc = _run(path, "certify")
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean", "clean"], doc["checkpoints"]
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_is_named_at_its_step_and_rank_with_its_mesh_coordinates(traces, name):
    _, step, rank, where = FAULTS[name]
    rc, doc = _run(traces[name][0], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, doc
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses.get(3) == "clean" and statuses.get(6) != "clean", statuses
