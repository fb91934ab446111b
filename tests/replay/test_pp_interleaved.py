"""Issue 36, interleaved pipeline schedules: the demo's PP 2 x FSDP2 DP 2 job with two stages per rank
(``demo/pp.py``, ``schedule="interleaved-1f1b", virtual_stages=2``: the 4-block transformer cut into
four one-block stages, pipeline coordinate ``pp`` holding stages ``pp`` and ``pp + 2``, each stage
``fully_shard``-ed over ``dp``, ``ScheduleInterleaved1F1B`` over 4 microbatches, AdamW, torchtitan's
clipping across the stages engaged on every step) recorded on 4 gloo processes and replayed on one
process (``replay/pp.py``).

A clean run is certified bit for bit at every checkpoint; a flip of one rank's local gradient (in
the stage that rank reduce-scatters first, its second) and a flip of one rank's weights at rest are
named at their step and rank, with the rank's mesh coordinates, and no later checkpoint certified; a
recipe whose learning rate is 1 % off certifies nothing after checkpoint 0."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.demo.pp import ClippedPpRecipe

from tests.factories import gloo_job

# three 4-process jobs and their replays, about a minute and a half on 2 cores
pytestmark = pytest.mark.heavy

WORLD, STEPS, EVERY = 4, 8, 3
#: clipping that engages on every step (the demo's total norm is several times this)
CLIP = 0.05
# name -> (spec, step, rank)
FAULTS = {
    # rank 1 (pp=0, dp=1) holds stages 0 and 2; stage 2's backwards end first, so its reduce-scatter is the step's first
    "local": ("local-gradient:step=4:rank=1:bit=3", 4, 1),
    "weights": ("weights:step=4:rank=2:bit=29", 4, 2),
}


def _jobs(rank: int, root: str, runs: list) -> dict:
    """Every run of ``runs`` (name, fault specs) in one process group."""
    from sdc_forensics.demo.pp import train

    return {
        name: train(
            rank,
            WORLD,
            str(Path(root, name, "trace")),
            str(Path(root, name, "ckpt")),
            steps=STEPS,
            checkpoint_every=EVERY,
            schedule="interleaved-1f1b",
            virtual_stages=2,
            max_norm=CLIP,
            inject=tuple(inject),
        )
        for name, inject in runs
    }


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pp-interleaved")
    todo = [("clean", [])] + [(name, [spec]) for name, (spec, *_) in FAULTS.items()]
    found = gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    return {**{name: root / name for name, _ in todo}, "results": {name: [r[name] for r in found] for name, _ in todo}}


def _run(job: Path, command: str, *extra: str) -> tuple[int, dict]:
    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)
    args = [command, str(job / "trace"), "--checkpoints", str(job / "ckpt"), "--json", *extra]
    result = CliRunner().invoke(cli, args)
    return result.exit_code, json.loads(result.stdout)


@dataclasses.dataclass(kw_only=True)
class RateOff(ClippedPpRecipe):
    """The job's recipe with a scheduler's mistake: after each update it sets AdamW's rate 1 % off."""

    def after_step(self, model, optimizer, scheduler):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 1.01


rate_off = RateOff(max_norm=CLIP)


def test_the_trace_places_each_rank_stages_in_the_whole_model(traces):
    # the whole model's parameters in stage order (stages 0, 1, 2, 3: 0 holds the embedding, 3 the
    # norm and head), each noted with the pipeline coordinate that holds it (stage s on s % 2)
    manifest = json.loads((traces["clean"] / "trace" / "manifest.json").read_text())
    mesh = manifest["parallel"]
    # a block's parameters: two LayerNorms, attention's q, k, v and projection, the MLP's two Linears (weight, bias each)
    block = 16
    assert mesh["stages"] == [0] * (1 + block) + [1] * block + [0] * block + [1] * (block + 3), mesh["stages"]
    assert mesh["grad_divisor"] == 4 and mesh["kind"] == "pp", mesh


def test_a_clean_interleaved_run_is_certified_bit_for_bit_at_every_checkpoint(traces):
    # torchtitan's clipping over the rank's two stages, summed across the pipeline: engaged on every step
    assert all(norm > CLIP for r in traces["results"]["clean"] for norm in r["grad_norms"])
    assert not any(r["alarms"] for r in traces["results"]["clean"]), traces["results"]["clean"]
    rc, doc = _run(traces["clean"], "certify")
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]
    assert [c["exact_now"] for c in doc["coverage"]][1:] == [[[0, s - 1]] for s in range(EVERY, STEPS, EVERY)]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean"] * len(range(0, STEPS, EVERY)), doc["checkpoints"]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_on_a_rank_holding_two_stages_is_named_at_its_step_and_rank(traces, name):
    _, step, rank = FAULTS[name]
    rc, doc = _run(traces[name], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption", doc
    assert doc["first_divergent_step"] == step, doc
    assert {s["rank"] for s in doc["suspects"]} == {rank}, doc["suspects"]
    where = f"pp={rank // 2}, dp={rank % 2}"
    assert any(where in json.dumps(s) for s in doc["suspects"]), doc["suspects"]
    assert any(e["step"] == step and rank in e["ranks"] for e in doc["evidence"]), doc["evidence"]
    # checkpoints up to the fault certified, none after it
    assert [c["status"] == "clean" for c in doc["checkpoints"]] == [c["step"] <= step for c in doc["checkpoints"]]


def test_a_recipe_whose_rate_is_one_percent_off_certifies_nothing_after_checkpoint_0(traces):
    rc, doc = _run(traces["clean"], "certify", "--recipe", "tests.replay.test_pp_interleaved:rate_off")
    assert rc != 0, doc
    assert [c["status"] == "clean" for c in doc["checkpoints"]] == [True] + [False] * (len(doc["checkpoints"]) - 1)
