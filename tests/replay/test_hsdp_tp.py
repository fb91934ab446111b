"""Issue 36: HSDP x tensor parallel on torchtitan's ``(dp_replicate, dp_shard, tp)`` mesh, recorded
(``recorder/tp_layout.py``) and replayed exactly by the job's TP degree of processes
(``replay/tp_exact.py``).

The demo's TP job with 2 replicas x 2 shards x TP 2 (8 gloo processes): each rank's local gradient
is TP's slice of its microbatch's gradient, reduce-scattered over its replica's shards, then
all-reduced over the replicas of its shard (FSDP2's HSDP); the replicas of one (shard, TP) box
vote on the weights. A clean run (gloo's own order, and the ordered reduction, which redoes the
replicas' all-reduce in replica order) is certified bit for bit at every checkpoint by 2 replay
processes. A mantissa-bit-3 local-gradient flip, a weights-at-rest flip and a flip of HSDP's
all-reduce output on one rank are each named at their step and rank with the rank's three mesh
coordinates, no other rank suspected and the checkpoint after them not certified.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import torchrun_document
from tests.factories import gloo_job

# four 8-process jobs in one launch and their 2-process replays: a few minutes on 2 cores
pytestmark = pytest.mark.heavy

WORLD, STEPS, EVERY = 8, 7, 3
# name -> (spec, step, rank, coordinates); rank = replica * 4 + shard * 2 + tp (init_device_mesh's order)
FAULTS = {
    "local": ("local-gradient:step=4:rank=5:bit=3", 4, 5, "dp_replicate=1, dp_shard=0, tp=1"),
    "weights": ("weights:step=4:rank=6:bit=29", 4, 6, "dp_replicate=1, dp_shard=1, tp=0"),
    "all-reduce": ("all-reduce-output:step=4:rank=3:bit=30", 4, 3, "dp_replicate=0, dp_shard=1, tp=1"),
}


def _jobs(rank: int, root: str, runs: list) -> dict:
    from sdc_forensics.demo.tp import train

    out = {}
    for name, inject, reduction in runs:
        out[name] = train(
            rank,
            WORLD,
            str(Path(root, name, "trace")),
            str(Path(root, name, "ckpt")),
            steps=STEPS,
            checkpoint_every=EVERY,
            inject=tuple(inject),
            reduction=reduction,
            replicate=2,
        )
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("hsdp_tp")
    todo = [("clean", [], "native"), ("clean-ordered", [], "ordered")]
    todo += [(name, [spec], "ordered" if name == "local" else "native") for name, (spec, *_) in FAULTS.items()]
    results = gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    return {name: (root / name, results[0][name]) for name, *_ in todo}


def _run(job: Path, command: str) -> tuple[int, dict, str]:
    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)
    return torchrun_document([command, str(job / "trace"), "--checkpoints", str(job / "ckpt")])


def test_the_trace_notes_the_three_dimensional_mesh(traces):
    manifest = json.loads((traces["clean"][0] / "trace" / "manifest.json").read_text())
    mesh = manifest["parallel"]
    assert mesh["dim_names"] == ["dp_replicate", "dp_shard", "tp"] and mesh["shape"] == [2, 2, 2], mesh
    assert mesh["shard_dim"] == 1 and mesh["tp_dim"] == 2, mesh


@pytest.mark.parametrize("job", ["clean", "clean-ordered"])
def test_a_clean_hsdp_tp_run_is_certified_bit_for_bit(traces, job):
    path, result = traces[job]
    assert not result["alarms"], result
    rc, doc, err = _run(path, "certify")
    assert rc == 0 and doc["verdict"] == "clean", err[-3000:]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean", "clean"], doc["checkpoints"]
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]
    assert "x 2 processes (tensor parallel)" in err, err[-3000:]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_is_named_at_its_step_and_rank_with_its_mesh_coordinates(traces, name):
    _, step, rank, where = FAULTS[name]
    rc, doc, err = _run(traces[name][0], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, err[-3000:]
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses.get(3) == "clean" and statuses.get(6) != "clean", statuses
