"""Issue 36, a fault inside a TP collective: ``demo --parallel tp``'s ``tp-collective`` drill flips a
bit of rank 2's output of the MLP's row-parallel reduce-scatter (sequence parallel) in the forward
of one step. The flip is finite, so the online checks see nothing; the exact TP replay under
torchrun names the step and the ranks of the DP coordinate whose forward it corrupted, and certifies
the checkpoints before the step and none after.

Which ranks: rank 2 is (dp=1, tp=0). The corrupted element is in its sequence shard of the residual
stream; the head's input is all-gathered over ``tp``, so both TP ranks of DP coordinate 1 (ranks 2
and 3) compute their logits, loss and local gradients from it. The ranks of DP coordinate 0 (0 and
1) read other microbatches through a clean forward: their local gradients are the replay's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import torchrun

# one 4-process demo run and one torchrun replay of 2 processes (about a minute on 2 loaded cores)
pytestmark = pytest.mark.heavy

STEP, RANK = 4, 2
# bit 20 of a float32 mantissa: a change of about 1/8 of the value, finite
SPEC = f"tp-collective:step={STEP}:rank={RANK}:bit=20"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    from sdc_forensics.demo.tp import run_demo

    out = tmp_path_factory.mktemp("tp_collective") / "fault"
    # checkpoints 0, 3 and 6: two before the fault's step, one after
    run_demo(out, (SPEC,), steps=8, checkpoint_every=3)
    return out


def test_the_drill_flips_one_rank_and_no_online_check_fires(job):
    ranks = [json.loads((job / "demo" / f"rank-{r}.json").read_text()) for r in range(4)]
    fired = [f for doc in ranks for f in doc["fired"]]
    assert [(f["step"], f["rank"]) for f in fired] == [(STEP, RANK)], fired
    assert fired[0]["old"] != fired[0]["new"], fired
    assert all(not doc["alarms"] for doc in ranks), ranks


def test_the_exact_tp_replay_names_the_step_and_the_corrupted_dp_coordinate(job):
    trace = job / "trace"
    rc, out, err, _ = torchrun(2, ["-m", "sdc_forensics", "bisect", str(trace), "--json"], timeout_s=300)
    assert out.strip(), err[-3000:]
    doc = json.loads(out)
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == STEP, err[-3000:]
    # both TP ranks of DP coordinate 1 read the corrupted activation (the head's all-gather); never 0 or 1
    assert sorted((s["rank"], s["mesh"]) for s in doc["suspects"]) == [(2, "dp=1, tp=0"), (3, "dp=1, tp=1")], doc
    replayed = [e for e in doc["evidence"] if e["kind"] == "replay_mismatch"]
    assert replayed and all(e["step"] == STEP and set(e["ranks"]) <= {2, 3} for e in replayed), doc["evidence"]
    assert all(e["strength"] == "strong" for e in replayed), replayed
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses[0] == statuses[3] == "clean" and statuses[6] != "clean", doc["checkpoints"]
