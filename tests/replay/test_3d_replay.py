"""Issue 36, the 3-D layout: PP 2 x FSDP2 DP 2 x TP 2 on 8 gloo processes (``sdc_forensics/demo/pp.py``
with ``tp=2``: the transformer cut into two stages as torchtitan cuts it, each stage given the TP
plan with sequence parallel on ``tp``, then ``fully_shard`` over ``dp``, 4 microbatches per step,
AdamW). The exact replay runs the recipe's TP plan on the whole model over 2 processes
(``torchrun --nproc-per-node 2``), each process playing every recorded rank of its TP coordinate,
stage by stage; at the job's layout (``--nproc-per-node 4``) each process holds one stage's TP
slice and the stages hand their sequence shards on point to point. A clean run is certified bit for bit; a fault at the layout's locations (a low
mantissa bit of one rank's local gradient, the reduce-scatter's output, weights at rest, the
update, a token id of one TP rank's microbatch) is named at its step and rank with its (pp, dp, tp)
coordinates and nothing after it is certified; a flip inside a TP collective of the forward names the
ranks of its data-parallel coordinate, which all computed from it, and no other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import torchrun
from tests.factories import gloo_job

# seven 8-process jobs and their 2-process replays: several minutes on 2 cores
pytestmark = pytest.mark.heavy

WORLD, STEPS, EVERY = 8, 6, 3
# name -> (spec, step, rank)
FAULTS = {
    "local": ("local-gradient:step=4:rank=5:bit=3", 4, 5),
    "reduce-scatter": ("reduce-scatter-output:step=4:rank=2:bit=30", 4, 2),
    "weights": ("weights:step=4:rank=7:bit=29", 4, 7),
    "update": ("update:step=3:rank=1:bit=29", 3, 1),
    # label 7 (in TP rank 0's vocabulary shard of the head) becomes 3 on stage 1's TP rank 0: its TP peer
    # computes the loss's backward with it
    "input": ("input:step=4:rank=6:bit=2:element=1", 4, 6),
    # a flip of rank 5's output of stage 1's row-parallel reduce-scatter (pp=1, dp=0, tp=1), in the forward
    "tp-collective": ("tp-collective:step=4:rank=5:bit=20", 4, 5),
}
#: a fault in one rank's forward reaches every rank of its data-parallel coordinate (its TP peer through
#: the collectives, the other stage through the backward): those are named, no other
FORWARD = {"tp-collective": {0, 1, 4, 5}}


def _jobs(rank: int, root: str, runs: list) -> dict:
    from sdc_forensics.demo.pp import train

    out = {}
    for name, inject in runs:
        out[name] = train(
            rank,
            WORLD,
            str(Path(root, name, "trace")),
            str(Path(root, name, "ckpt")),
            steps=STEPS,
            checkpoint_every=EVERY,
            inject=tuple(inject),
            tp=2,
        )
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("3d")
    todo = [("clean", [])] + [(name, [spec]) for name, (spec, *_) in FAULTS.items()]
    gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    return {name: root / name for name, _ in todo}


def _run(job: Path, command: str, processes: int = 2) -> tuple[int, dict]:
    """``command`` under torchrun: 2 processes (TP's, each holding every stage) or 4 (the job's layout)."""
    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)
    args = ["-m", "sdc_forensics", command, str(job / "trace"), "--checkpoints", str(job / "ckpt"), "--json"]
    rc, out, err, _ = torchrun(processes, args, timeout_s=600)
    assert out.strip(), err[-3000:]
    return rc, json.loads(out)


def test_a_clean_3d_run_is_certified_bit_for_bit_by_the_tp_processes(traces):
    rc, doc = _run(traces["clean"], "certify")
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc["checkpoints"]
    assert "x 2 processes (tensor parallel)" in json.dumps(doc)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_is_named_at_its_step_and_rank_with_its_coordinates(traces, name):
    _, step, rank = FAULTS[name]
    rc, doc = _run(traces[name], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, doc
    assert {s["rank"] for s in doc["suspects"]} == FORWARD.get(name, {rank}), doc["suspects"]
    where = f"pp={rank // 4}, dp={rank // 2 % 2}, tp={rank % 2}"
    assert any(where in json.dumps(s) for s in doc["suspects"]), doc["suspects"]
    if name == "input":
        assert [s["location"] for s in doc["suspects"]] == ["input_data"], doc["suspects"]
    for c in doc["checkpoints"]:
        assert c["status"] != "clean" or c["step"] <= step, doc["checkpoints"]


# -- the replay at the job's layout: PP x TP = 4 processes, one stage and TP slice each (replay/pp_exact.py)


def test_a_clean_3d_run_is_certified_at_the_jobs_layout(traces):
    rc, doc = _run(traces["clean"], "certify", 4)
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc["checkpoints"]
    assert "x 4 processes (pipeline parallel)" in json.dumps(doc), doc


#: at the job's layout the hand-offs the job recorded show which stage the forward went wrong in:
#: stage 1's TP pair, not stage 0's ranks, which were handed back gradients computed from it
FORWARD_AT_LAYOUT = {"tp-collective": {4, 5}}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_the_jobs_layout_names_each_fault_and_a_forward_fault_on_its_stage_only(traces, name):
    _, step, rank = FAULTS[name]
    rc, doc = _run(traces[name], "bisect", 4)
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, doc
    assert {s["rank"] for s in doc["suspects"]} == FORWARD_AT_LAYOUT.get(name, {rank}), doc["suspects"]
    if name == "input":
        assert [s["location"] for s in doc["suspects"]] == ["input_data"], doc["suspects"]
    for c in doc["checkpoints"]:
        assert c["status"] != "clean" or c["step"] <= step, doc["checkpoints"]
