"""Issue 36: torchtitan's four dimensions together, ``(pp, dp_replicate, dp_shard, tp)``, recorded
(``recorder/pp_layout.py`` with the TP layout's boxes on each stage's ``(dp_replicate, dp_shard,
tp)`` sub-mesh) and replayed exactly by the job's TP degree of processes (``replay/tp_exact.py``:
each process plays every stage's, replica's and shard's rank of its TP coordinate).

The demo's PP job with 2 stages x 2 replicas x 2 shards x TP 2 (16 gloo processes), clipping as
torchtitan does on every step: a clean run is certified bit for bit at every checkpoint; a
mantissa-bit-3 flip of one rank's local gradient is named at its step and rank with its four
coordinates, no other rank suspected and the checkpoint after it not certified; the job itself
goes on past it (policy ``continue``), its next checkpoint saved but not blessed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.launch import torchrun_document
from tests.factories import gloo_job

# two 16-process jobs in one launch and their 2-process replays: a few minutes on 2 cores
pytestmark = pytest.mark.heavy

WORLD, STEPS, EVERY, CLIP = 16, 7, 3, 0.05
# rank = pp * 8 + replica * 4 + shard * 2 + tp (init_device_mesh's order)
FAULT = ("local-gradient:step=4:rank=13:bit=3", 4, 13, "pp=1, dp_replicate=1, dp_shard=0, tp=1")


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
            max_norm=CLIP,
            tp=2,
            replicate=2,
        )
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("4d")
    todo = [("clean", []), ("fault", [FAULT[0]])]
    results = gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    return {name: (root / name, results[0][name]) for name, _ in todo}


def _run(job: Path, command: str) -> tuple[int, dict, str]:
    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)
    return torchrun_document([command, str(job / "trace"), "--checkpoints", str(job / "ckpt")])


def test_a_clean_4d_run_clipping_every_step_is_certified_bit_for_bit(traces):
    path, result = traces["clean"]
    assert not result["alarms"] and all(n > CLIP for n in result["grad_norms"]), result
    mesh = json.loads((path / "trace" / "manifest.json").read_text())["parallel"]
    assert mesh["dim_names"] == ["pp", "dp_replicate", "dp_shard", "tp"] and mesh["shape"] == [2, 2, 2, 2], mesh
    rc, doc, err = _run(path, "certify")
    assert rc == 0 and doc["verdict"] == "clean", err[-3000:]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean", "clean"], doc["checkpoints"]
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]


def test_a_local_gradient_flip_is_named_with_its_four_coordinates(traces):
    _, step, rank, where = FAULT
    path, result = traces["fault"]
    # the flip lands in a TP-replicated parameter: its TP copies differ from then on, which the
    # checkpoint after it reports (a weights alarm, saved unblessed) without stopping the job
    assert all(a["check"] == "weights" and a["step"] >= step for a in result["alarms"]), result
    assert (path / "ckpt" / "step-00000006").is_dir()
    rc, doc, err = _run(path, "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, err[-3000:]
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses.get(3) == "clean" and statuses.get(6) != "clean", statuses
