"""Issue 36, the exact replay of a tensor-parallel job under torchrun (``replay/tp_exact.py``): the
``demo --parallel tp`` job (TP 2 x FSDP2 DP 2 on 4 gloo processes) replayed with its own TP plan
on 2 processes. A clean run is certified bit for bit (``certify`` exit 0, coverage "exact now"),
and a local-gradient flip in a low mantissa bit, below every tolerance (the one-process replay,
tolerant, cannot see it), is named at its step and rank by a firm verdict, as are a flip of one rank's
reduce-scatter output, of its weights at rest, of its update, and of a token id of its microbatch (its
TP peer, which computes the forward with it, not suspected). A recipe that rebuilds the
job wrong (a learning rate 1 % off from its second step) shows up as a mismatch of the weights, never as a certificate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.demo.tp import TpRecipe

from tests.distributed.launch import torchrun

# six 4-process demo runs and eight torchrun replays of 2 processes (about 4 minutes on 2 loaded cores)
pytestmark = pytest.mark.heavy

# bit 3 of a float32 mantissa: a change of ~1e-6 relative, far below the sketch tolerance
FAULT = ("local-gradient:step=5:rank=3:bit=3", 5, 3, "dp=1, tp=1")
# the other locations of one rank's own state, each named at its step and rank alone
OWN_STATE = {
    "reduce-scatter-output": ("reduce-scatter-output:step=2:rank=1:bit=30", 2, 1, "dp=0, tp=1"),
    "weights": ("weights:step=2:rank=2:bit=29", 2, 2, "dp=1, tp=0"),
    "update": ("update:step=1:rank=3:bit=29", 1, 3, "dp=1, tp=1"),
}
# token 3 (of TP rank 0's vocabulary shard) becomes 7 in rank 0's microbatch: rank 1 computes the forward with it
INPUT = ("input:step=1:rank=0:bit=2:element=3", 1, 0, "dp=0, tp=0")


@dataclasses.dataclass(kw_only=True)
class LrOff(TpRecipe):
    """The demo's recipe with a scheduler's mistake: after each update it sets AdamW's learning rate 1 % off
    (the checkpoint's own rate is loaded with its optimizer state, so the first step is right)."""

    def after_step(self, model, optimizer, scheduler):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 1.01


#: what torchrun's processes import (``--recipe``)
lr_off = LrOff()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    from sdc_forensics.demo.tp import run_demo

    root = tmp_path_factory.mktemp("tp_exact")
    run_demo(root / "clean", (), steps=4, checkpoint_every=2)
    run_demo(root / "fault", (FAULT[0],), steps=8, checkpoint_every=4)
    run_demo(root / "input", (INPUT[0],), steps=4, checkpoint_every=2)
    for name, (spec, *_) in OWN_STATE.items():
        run_demo(root / name, (spec,), steps=4, checkpoint_every=2)
    return {name: root / name / "trace" for name in ("clean", "fault", "input", *OWN_STATE)}


def _run(trace: Path, command: str, processes: int, *extra: str) -> tuple[int, dict, str]:
    # every run replays, none reuses another's ledger records
    (trace / "ledger.jsonl").unlink(missing_ok=True)
    args = [command, str(trace), "--json", *extra]
    if processes == 1:
        result = CliRunner().invoke(cli, args)
        return result.exit_code, json.loads(result.stdout), result.output
    rc, out, err, _ = torchrun(processes, ["-m", "sdc_forensics", *args], timeout_s=300)
    assert out.strip(), err[-3000:]
    return rc, json.loads(out), err


def test_clean_tp_run_is_certified_by_the_exact_replay(jobs):
    rc, doc, err = _run(jobs["clean"], "certify", 2)
    assert rc == 0 and doc["verdict"] == "clean", err[-3000:]
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert statuses == {0: "clean", 2: "clean"}, doc["checkpoints"]
    coverage = {c["step"]: c for c in doc["coverage"]}
    # the steps before checkpoint 2 replayed bit for bit, none tolerant
    assert coverage[2]["exact_now"] == [[0, 1]] and not coverage[2]["tolerant"], coverage
    assert "x 2 processes (tensor parallel)" in err, err[-3000:]


def test_low_bit_local_gradient_flip_is_named_only_by_the_exact_replay(jobs):
    _, step, rank, where = FAULT
    rc, doc, err = _run(jobs["fault"], "bisect", 2)
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, err[-3000:]
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]
    replayed = [e for e in doc["evidence"] if e["kind"] == "replay_mismatch"]
    assert replayed and all(e["step"] == step and e["ranks"] == [rank] for e in replayed), doc["evidence"]
    # the one-process replay adds TP's partial sums in another order: within tolerance, the flip is invisible
    rc1, one, _ = _run(jobs["fault"], "bisect", 1)
    assert rc1 == 4 and one["first_divergent_step"] is None, one


def test_a_token_id_flipped_on_one_tp_rank_names_that_rank_and_its_input(jobs):
    _, step, rank, where = INPUT
    rc, doc, err = _run(jobs["input"], "bisect", 2)
    assert rc == 1 and doc["first_divergent_step"] == step, err[-3000:]
    assert [(s["rank"], s["mesh"], s["location"]) for s in doc["suspects"]] == [(rank, where, "input_data")], doc
    # the TP peer's gradient differs through the shared forward: put on the rank whose input differs
    at = [e for e in doc["evidence"] if e["source"] == "replay"]
    assert at and all(e["ranks"] == [rank] and e["location"] == "input_data" for e in at), at
    assert any(e["kind"] == "input_mismatch" for e in at), at
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "tainted"], doc["checkpoints"]


@pytest.mark.parametrize("name", sorted(OWN_STATE))
def test_a_flip_of_the_reduction_the_weights_or_the_update_is_named_at_its_step_and_rank(jobs, name):
    _, step, rank, where = OWN_STATE[name]
    rc, doc, err = _run(jobs[name], "bisect", 2)
    assert rc == 1 and doc["first_divergent_step"] == step, err[-3000:]
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(rank, where)], doc["suspects"]
    assert all(c["status"] != "clean" or c["step"] <= step for c in doc["checkpoints"]), doc["checkpoints"]
