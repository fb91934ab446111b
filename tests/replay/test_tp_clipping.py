"""Issue 36: a tensor-parallel job that clips, replayed exactly under torchrun (``replay/tp_exact.py``
with ``replay/clipping.tp_total_norm``).

torchtitan clips every step (``max_norm`` 1.0 by default): torch's ``clip_grad_norm_`` on the job's
``(dp, tp)`` DTensors takes each rank's norm of its FSDP rows of its TP slice, makes replicated
parameters' norms partial over ``tp``, and reduces over ``dp`` then ``tp``. Its last bits are not
the whole model's norm, so a replay that clipped with the unsharded norm would certify nothing. Here
the demo's TP job clips at 0.05 (engaged on every step: its total norm is about 0.6), and:

* DP 2 x TP 2 (gloo's own order) and DP 3 x TP 2 (the ordered reduction; three-term sums are not
  order-free) are certified bit for bit at every checkpoint by 2 replay processes;
* a mantissa-bit-3 flip of one rank's local gradient is named at its step and rank, nothing after
  it certified;
* a recipe whose clipping threshold is 1 % off certifies nothing after checkpoint 0.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.demo.tp import ClippedTpRecipe

from tests.distributed.launch import torchrun_document
from tests.factories import gloo_job

# three recorded jobs (4, 6 and 4 processes) and four torchrun replays of 2 processes
pytestmark = pytest.mark.heavy

MAX_NORM = 0.05
FAULT = ("local-gradient:step=4:rank=2:bit=3", 4, 2, "dp=1, tp=0")


@dataclasses.dataclass(kw_only=True)
class ClipOff(ClippedTpRecipe):
    """The clipped job's recipe with a subtle mistake: it clips at a threshold 1 % above the job's
    (the trace's ``recipe_args`` set ``max_norm`` to the job's, so the mistake is in the hook)."""

    def before_step(self, model, optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm * 1.01)


#: what torchrun's processes import (``--recipe``)
clip_off = ClipOff(max_norm=MAX_NORM)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    from sdc_forensics.demo.tp import run_demo

    root = tmp_path_factory.mktemp("tp_clipping")
    found = {
        "dp2": run_demo(root / "dp2", (), steps=4, checkpoint_every=2, max_norm=MAX_NORM),
        "dp3": run_demo(root / "dp3", (), steps=4, checkpoint_every=2, max_norm=MAX_NORM, dp=3, reduction="ordered"),
        "fault": run_demo(root / "fault", (FAULT[0],), steps=7, checkpoint_every=3, max_norm=MAX_NORM),
    }
    return {name: (root / name / "trace", result) for name, result in found.items()}


def _run(trace: Path, command: str, processes: int, *extra: str) -> tuple[int, dict, str]:
    # every run replays, none reuses another's ledger records
    (trace / "ledger.jsonl").unlink(missing_ok=True)
    args = [command, str(trace), "--json", *extra]
    if processes == 1:
        result = CliRunner().invoke(cli, args)
        return result.exit_code, json.loads(result.stdout), result.output
    return torchrun_document([command, str(trace), *extra], processes, timeout_s=300)


def test_clipping_engages_on_every_step_of_every_job(jobs):
    for name, (_, result) in jobs.items():
        norms = result["grad_norms"]
        assert norms and all(n > MAX_NORM for n in norms), (name, norms)


@pytest.mark.parametrize("job", ["dp2", "dp3"])
def test_a_clean_clipped_tp_run_is_certified_bit_for_bit(jobs, job):
    trace, _ = jobs[job]
    rc, doc, err = _run(trace, "certify", 2)
    assert rc == 0 and doc["verdict"] == "clean", err[-3000:]
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses == {0: "clean", 2: "clean"}, doc["checkpoints"]
    coverage = {c["step"]: c for c in doc["coverage"]}
    assert coverage[2]["exact_now"] == [[0, 1]] and not coverage[2]["tolerant"], coverage
    assert "x 2 processes (tensor parallel)" in err, err[-3000:]


def test_a_local_gradient_flip_in_a_clipped_job_is_named_at_its_step_and_rank(jobs):
    _, step, rank, where = FAULT
    trace, _ = jobs["fault"]
    rc, doc, err = _run(trace, "bisect", 2)
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, err[-3000:]
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    # checkpoint 3 holds the weights before the faulty step; checkpoint 6, after it, is not certified
    assert statuses.get(0) == "clean" and statuses.get(3) == "clean", statuses
    assert statuses.get(6) not in (None, "clean"), statuses


def test_a_recipe_whose_clipping_threshold_is_one_percent_off_certifies_nothing_after_checkpoint_0(jobs):
    trace, _ = jobs["dp2"]
    rc, doc, err = _run(trace, "certify", 2, "--recipe", "tests.replay.test_tp_clipping:clip_off")
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses == {0: "clean", 2: "unverified"} and doc["verdict"] == "inconclusive", (statuses, err[-3000:])
    assert rc != 0 and doc["first_divergent_step"] is None, doc
    # the weights after step 0's update differ on every rank while its gradients matched: the recipe, said so
    assert any("does not reproduce the update of step(s)" in line for line in doc["settle"]), doc["settle"]


def _pipelined(rank: int, root: str) -> dict:
    from sdc_forensics.demo.pp import train

    return train(rank, 8, f"{root}/trace", f"{root}/ckpt", steps=4, checkpoint_every=2, tp=2, max_norm=MAX_NORM)


def test_a_clean_clipped_3d_run_is_certified_bit_for_bit(tmp_path):
    """PP 2 x DP 2 x TP 2 clipping as torchtitan does (each stage's norm over its (dp, tp) DTensors,
    combined across the stages): the exact replay's norm is the job's, so every checkpoint certifies."""
    results = gloo_job(_pipelined, 8, tmp_path / "results", str(tmp_path))
    assert all(n > MAX_NORM for n in results[0]["grad_norms"]), results[0]
    rc, doc, err = torchrun_document(["certify", str(tmp_path / "trace"), "--checkpoints", str(tmp_path / "ckpt")])
    assert rc == 0 and doc["verdict"] == "clean", err[-3000:]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc["checkpoints"]
    assert all(not c["tolerant"] for c in doc["coverage"]), doc["coverage"]
