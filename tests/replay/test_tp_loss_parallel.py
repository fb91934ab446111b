"""Issue 36, loss parallel: a TP job whose head keeps its logits sharded on the vocabulary (a
DTensor, ``use_local_output=False``) and computes the cross entropy and its backward inside
torch's ``loss_parallel()``, as torchtitan trains by default (``demo/tp.py``, ``loss_parallel=True``;
TP 2 x FSDP2 DP 2 on 4 gloo processes, AdamW). The recorder keeps the replicated DTensor loss as
its value; the exact replay runs the recipe's ``train_context()`` around each microbatch's loss and
backward (``recipe.loss_and_backward``). A clean run is certified bit for bit; a recipe that
replays the plain cross entropy of gathered logits (one of the settings a user can get wrong) is
not exact and certifies nothing after checkpoint 0; a low-bit local-gradient flip is named at its
step and rank."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest

from sdc_forensics.demo.tp import TpRecipe, tensor_parallel

from tests.distributed.launch import torchrun

# two 4-process demo runs and three torchrun replays of 2 processes
pytestmark = pytest.mark.heavy

FAULT = ("local-gradient:step=3:rank=2:bit=3", 3, 2, "dp=1, tp=0")


@dataclasses.dataclass(kw_only=True)
class GatheredLoss(TpRecipe):
    """The job's recipe with the loss written as if the logits were gathered: the head's replicated
    output and the plain cross entropy, whatever ``loss_parallel`` the trace's recipe arguments say."""

    def parallelize(self, model, tp_mesh):
        return tensor_parallel(model, tp_mesh, loss_parallel=False)

    def train_context(self):
        return contextlib.nullcontext()


#: what torchrun's processes import (``--recipe``)
gathered_loss = GatheredLoss()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    from sdc_forensics.demo.tp import run_demo

    root = tmp_path_factory.mktemp("loss_parallel")
    run_demo(root / "clean", (), steps=4, checkpoint_every=2, loss_parallel=True)
    run_demo(root / "fault", (FAULT[0],), steps=6, checkpoint_every=2, loss_parallel=True)
    return {name: root / name / "trace" for name in ("clean", "fault")}


def _run(trace: Path, command: str, *extra: str) -> tuple[int, dict, str]:
    (trace / "ledger.jsonl").unlink(missing_ok=True)
    rc, out, err, _ = torchrun(2, ["-m", "sdc_forensics", command, str(trace), "--json", *extra], timeout_s=300)
    assert out.strip(), err[-3000:]
    return rc, json.loads(out), err


def test_the_recorded_recipe_says_loss_parallel_and_a_clean_run_certifies_bit_for_bit(jobs):
    manifest = json.loads((jobs["clean"] / "manifest.json").read_text())
    assert json.dumps(manifest).count('"loss_parallel": true') >= 1, manifest
    rc, doc, err = _run(jobs["clean"], "certify")
    assert rc == 0 and doc["verdict"] == "clean", err[-3000:]
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 2: "clean"}, doc["checkpoints"]
    coverage = {c["step"]: c for c in doc["coverage"]}
    assert coverage[2]["exact_now"] == [[0, 1]] and not coverage[2]["tolerant"], coverage


def test_a_recipe_with_the_gathered_loss_certifies_nothing_after_checkpoint_0(jobs):
    rc, doc, err = _run(jobs["clean"], "certify", "--recipe", "tests.replay.test_tp_loss_parallel:gathered_loss")
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses[0] == "clean" and statuses[2] != "clean", (statuses, err[-3000:])
    assert rc != 0 and doc["verdict"] != "clean", doc["verdict"]


def test_a_low_bit_local_gradient_flip_is_named_at_its_step_and_rank(jobs):
    _, step, rank, where = FAULT
    rc, doc, err = _run(jobs["fault"], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, err[-3000:]
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean", "tainted"], doc["checkpoints"]
