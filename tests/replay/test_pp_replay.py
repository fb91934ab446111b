"""Issue 36, pipeline parallelism: the demo's PP 2 x FSDP2 DP 2 job (``sdc_forensics/demo/pp.py``:
a 4-block transformer cut into two stages as torchtitan cuts it, each stage ``fully_shard``-ed over
``dp``, 4 microbatches per step, AdamW, the schedule scaling the gradients) recorded on 4 gloo
processes and replayed on one process (``replay/pp.py``), and at the job's layout, one process per
stage under torchrun (``replay/pp_exact.py``).

A clean run is certified bit for bit under ``Schedule1F1B`` and ``ScheduleGPipe``; a fault at every
location (a low mantissa bit of one stage's local gradient, the reduce-scatter's output, weights at
rest, the update) is named at its step and rank, with the rank's mesh
coordinates, the other ranks never named, and no checkpoint after it certified; a fault in one
stage's forward (the parameters it all-gathered) reaches the other stage of its pipeline, and both
are named, the other data-parallel coordinate's never; a recipe whose learning rate is 1 % off
certifies nothing after checkpoint 0. A job that clips as torchtitan does (the total norm across
the stages) certifies, and a recipe that clips 1 % off does not."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.demo.pp import ClippedPpRecipe, PpRecipe

from tests.factories import gloo_job

# nine 4-process jobs and their replays, a few minutes on 2 cores
pytestmark = pytest.mark.heavy

WORLD, STEPS, EVERY = 4, 8, 3
# name -> (spec, step, rank, evidence location or None)
FAULTS = {
    "stage0-local": ("local-gradient:step=4:rank=1:bit=3", 4, 1, "local_compute"),
    "stage1-local": ("local-gradient:step=5:rank=2:bit=3", 5, 2, "local_compute"),
    "reduce-scatter": ("reduce-scatter-output:step=4:rank=3:bit=30", 4, 3, None),
    "weights": ("weights:step=4:rank=0:bit=29", 4, 0, None),
    # a token id of stage 0's microbatch (its input), and of stage 1's (its labels: one buffer)
    "stage0-input": ("input:step=4:rank=0:bit=2", 4, 0, "input_data"),
    "stage1-input": ("input:step=5:rank=3:bit=2", 5, 3, "input_data"),
    "update": ("update:step=4:rank=3:bit=29", 4, 3, None),
}


def _jobs(rank: int, root: str, runs: list) -> dict:
    """Every run of ``runs`` (name, keyword arguments of ``demo.pp.train``) in one process group."""
    from sdc_forensics.demo.pp import train

    out = {}
    for name, kwargs in runs:
        kwargs = {**kwargs, "inject": tuple(kwargs.get("inject", ()))}
        out[name] = train(
            rank,
            WORLD,
            str(Path(root, name, "trace")),
            str(Path(root, name, "ckpt")),
            steps=STEPS,
            checkpoint_every=EVERY,
            **kwargs,
        )
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    todo = [("clean-1f1b", {}), ("clean-gpipe", {"schedule": "gpipe"})]
    todo += [(name, {"inject": [spec]}) for name, (spec, *_) in FAULTS.items()]
    todo += [("all-gather", {"inject": ["all-gather-output:step=4:rank=2:bit=30"]})]
    # a finite one (bit 30 makes a NaN, which the trace's own checks see on both stages)
    todo += [("all-gather-finite", {"inject": ["all-gather-output:step=4:rank=2:bit=20"]})]
    todo += [("activation", {"inject": ["pp-activation:step=4:rank=1:bit=20"]})]
    todo += [("clipped", {"max_norm": CLIP})]
    found = gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    paths = {name: root / name for name, _ in todo}
    # what each rank's train returned, per run
    return {**paths, "results": {name: [r[name] for r in found] for name, _ in todo}}


def _run(job: Path, command: str, *extra: str) -> tuple[int, dict]:
    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)
    args = [command, str(job / "trace"), "--checkpoints", str(job / "ckpt"), "--json", *extra]
    result = CliRunner().invoke(cli, args)
    return result.exit_code, json.loads(result.stdout)


@dataclasses.dataclass(kw_only=True)
class RateOff(PpRecipe):
    """The demo's recipe with a scheduler's mistake: after each update it sets AdamW's rate 1 % off."""

    def after_step(self, model, optimizer, scheduler):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * 1.01


rate_off = RateOff()

#: clipping that engages on every step of the demo (its total norm is several times this)
CLIP = 0.05


@dataclasses.dataclass(kw_only=True)
class ClipOff(ClippedPpRecipe):
    """The clipped job's recipe with a subtle mistake: it clips at a threshold 1 % above the job's
    (the trace's recipe_args still set ``max_norm``)."""

    def before_step(self, model, optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm * 1.01)


clip_off = ClipOff(max_norm=CLIP)


@pytest.mark.parametrize("name", ["clean-1f1b", "clean-gpipe"])
def test_a_clean_pipeline_run_is_certified_bit_for_bit(traces, name):
    rc, doc = _run(traces[name], "certify")
    assert rc == 0, doc
    assert doc["verdict"] == "clean", doc
    # every step before every checkpoint replayed bit for bit, none within tolerance
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]
    assert [c["exact_now"] for c in doc["coverage"]][1:] == [[[0, s - 1]] for s in range(EVERY, STEPS, EVERY)]
    statuses = [c["status"] for c in doc["checkpoints"]]
    assert statuses == ["clean"] * len(range(0, STEPS, EVERY)), doc["checkpoints"]


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_a_fault_at_every_location_is_named_at_its_step_and_rank(traces, name):
    _, step, rank, location = FAULTS[name]
    rc, doc = _run(traces[name], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption", doc
    assert doc["first_divergent_step"] == step, doc
    suspects = {s["rank"] for s in doc["suspects"]}
    assert suspects == {rank}, doc["suspects"]
    where = f"pp={rank // 2}, dp={rank % 2}"
    assert any(where in json.dumps(s) for s in doc["suspects"]), doc["suspects"]
    named = [e for e in doc["evidence"] if e["step"] == step and rank in e["ranks"]]
    assert named and (location is None or any(e.get("location") == location for e in named)), doc["evidence"]
    # nothing after the fault certified
    for c in doc["checkpoints"]:
        assert c["status"] != "clean" or c["step"] <= step, doc["checkpoints"]


def test_a_recipe_whose_rate_is_one_percent_off_certifies_nothing_after_checkpoint_0(traces):
    rc, doc = _run(traces["clean-1f1b"], "certify", "--recipe", "tests.replay.test_pp_replay:rate_off")
    assert rc != 0, doc
    assert [c["status"] == "clean" for c in doc["checkpoints"]][1:] == [False] * (len(doc["checkpoints"]) - 1)


def test_a_fault_in_one_stage_forward_names_the_stages_of_its_pipeline_only(traces):
    # rank 2 (pp=1, dp=0) flips a parameter it gathered for step 4's forward: its loss and its local
    # gradient change, and so does what it hands back to stage 0 of its pipeline (rank 0); the ranks
    # of dp=1 computed from the other microbatches with clean parameters
    rc, doc = _run(traces["all-gather"], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == 4, doc
    suspects = {s["rank"] for s in doc["suspects"]}
    assert 2 in suspects and suspects <= {0, 2}, doc["suspects"]


def test_a_corrupted_activation_between_stages_is_found_by_the_replay_alone(traces):
    # rank 1 (pp=0, dp=1) hands stage 1 a wrong activation in step 4's first microbatch: no online check
    # can see it (every gradient is computed consistently from it); the replay names the pipeline of dp=1
    assert not any(r["alarms"] for r in traces["results"]["activation"]), traces["results"]["activation"]
    assert any(r["fired"] for r in traces["results"]["activation"])
    rc, doc = _run(traces["activation"], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == 4, doc
    suspects = {s["rank"] for s in doc["suspects"]}
    assert 3 in suspects and suspects <= {1, 3}, doc["suspects"]
    assert [c["status"] == "clean" for c in doc["checkpoints"]] == [c["step"] <= 4 for c in doc["checkpoints"]]


def _three_replicas(rank: int, root: str, reduction: str) -> dict:
    from sdc_forensics.demo.pp import train

    return train(rank, 6, f"{root}/trace", f"{root}/ckpt", steps=6, checkpoint_every=3, reduction=reduction)


@pytest.mark.parametrize("reduction", ["native", "ordered"])
def test_three_data_parallel_ranks_per_stage_certify_in_gloo_order_and_the_ordered_one(tmp_path, reduction):
    # PP 2 x DP 3 (6 processes): a three-term sum is not order-free, so the replay must rebuild gloo's own
    # reduce-scatter (its ring over each stage's 3 ranks) or the ordered reduction, over the whole model's groups
    gloo_job(_three_replicas, 6, tmp_path / "results", str(tmp_path), reduction)
    rc, doc = _run(tmp_path, "certify")
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"], doc["checkpoints"]


def test_a_clipped_pipeline_job_certifies_and_a_threshold_one_percent_off_does_not(traces):
    # torchtitan's clipping: each stage's FSDP2 norm, squared, summed over the stages; engaged on every step
    assert all(norm > CLIP for r in traces["results"]["clipped"] for norm in r["grad_norms"])
    rc, doc = _run(traces["clipped"], "certify")
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert [c["status"] for c in doc["checkpoints"]] == ["clean"] * len(range(0, STEPS, EVERY)), doc["checkpoints"]
    rc, doc = _run(traces["clipped"], "certify", "--recipe", "tests.replay.test_pp_replay:clip_off")
    assert rc != 0, doc
    assert [c["status"] == "clean" for c in doc["checkpoints"]][1:] == [False] * (len(doc["checkpoints"]) - 1)


# -- the replay at the job's layout: one stage per process (replay/pp_exact.py) ---------------------


def _at_layout(job: Path, command: str, *extra: str, env: dict | None = None) -> tuple[int, dict, str]:
    """``command`` under ``torchrun --nproc-per-node 2``: one process per stage, each holding its own."""
    from tests.distributed.launch import torchrun

    (job / "trace" / "ledger.jsonl").unlink(missing_ok=True)
    args = ["-m", "sdc_forensics", command, str(job / "trace"), "--checkpoints", str(job / "ckpt"), "--json", *extra]
    rc, out, err, _ = torchrun(2, args, timeout_s=300, env=env)
    assert out.strip() or "error: " in err, err[-3000:]
    return rc, (json.loads(out) if out.strip() else {}), err


@pytest.mark.parametrize("name", ["clean-1f1b", "clean-gpipe"])
def test_a_clean_pipeline_run_is_certified_by_one_process_per_stage(traces, name):
    rc, doc, _ = _at_layout(traces[name], "certify")
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert all(not c["tolerant"] and not c["lacking_replay"] for c in doc["coverage"]), doc["coverage"]
    assert [c["status"] for c in doc["checkpoints"]] == ["clean"] * len(range(0, STEPS, EVERY)), doc["checkpoints"]
    assert "x 2 processes (pipeline parallel)" in json.dumps(doc), doc


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_one_process_per_stage_names_each_fault_at_its_step_and_rank(traces, name):
    _, step, rank, location = FAULTS[name]
    rc, doc, _ = _at_layout(traces[name], "bisect")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == step, doc
    assert {s["rank"] for s in doc["suspects"]} == {rank}, doc["suspects"]
    named = [e for e in doc["evidence"] if e["step"] == step and rank in e["ranks"]]
    assert named and (location is None or any(e.get("location") == location for e in named)), doc["evidence"]
    for c in doc["checkpoints"]:
        assert c["status"] != "clean" or c["step"] <= step, doc["checkpoints"]


def test_the_job_records_each_stages_hand_offs_per_step(traces):
    from sdc_forensics.trace import format as F
    from sdc_forensics.trace.reader import Trace

    handoffs = Trace.open(traces["clean-1f1b"] / "trace").records(F.Kind.HANDOFF)
    # stage 0's ranks (0, 1) one per step, its microbatches counted (not the shape inference's forward); the
    # last stage hands nothing on
    assert sorted(set(handoffs["rank"].tolist())) == [0, 1]
    assert sorted(handoffs["step"][handoffs["rank"] == 0].tolist()) == list(range(STEPS))
    assert set(handoffs["microbatch_count"].tolist()) == {4}
    assert (handoffs["aux_digest"] != 0).all() and (handoffs["input_digest"] != 0).all()


@pytest.mark.parametrize(
    "name, named",
    [
        # a wrong activation received by rank 3: rank 1 sent the right one and was handed back gradients computed
        # from the wrong one; the hand-offs show it, and rank 3 alone is named
        ("activation", {3}),
        # a wrong parameter in stage 1's forward (rank 2): rank 0 sent the right activations
        ("all-gather-finite", {2}),
    ],
)
def test_one_process_per_stage_names_the_stage_a_forward_went_wrong_in(traces, name, named):
    rc, doc, _ = _at_layout(traces[name], "bisect")
    assert rc == 1 and doc["first_divergent_step"] == 4, doc
    assert {s["rank"] for s in doc["suspects"]} == named, doc["suspects"]


def test_one_process_per_stage_reproduces_clipping_across_the_stages_and_a_wrong_recipe_does_not_certify(traces):
    # the total norm's stages are on different processes: each computes its own, then they are combined
    rc, doc, _ = _at_layout(traces["clipped"], "certify")
    assert rc == 0 and doc["verdict"] == "clean", doc
    rc, doc, _ = _at_layout(traces["clipped"], "certify", "--recipe", "tests.replay.test_pp_replay:clip_off")
    assert rc != 0 and [c["status"] == "clean" for c in doc["checkpoints"]][1:] == [False] * (
        len(doc["checkpoints"]) - 1
    )
    rc, doc, _ = _at_layout(traces["clean-1f1b"], "certify", "--recipe", "tests.replay.test_pp_replay:rate_off")
    assert rc != 0 and [c["status"] == "clean" for c in doc["checkpoints"]][1:] == [False] * (
        len(doc["checkpoints"]) - 1
    )


@dataclasses.dataclass(kw_only=True)
class OtherCut(PpRecipe):
    """A recipe that cuts the model elsewhere than the job did (stage 0: the embedding and one block)."""

    def pipeline_stage(self, model, stage, stages):
        from sdc_forensics.demo.pp import stage_module

        part = stage_module(model, stage, stages)
        if stage == 0:
            del part.layers["1"]
        return part


other_cut = OtherCut()


def test_a_recipe_that_cuts_the_model_elsewhere_is_refused_in_one_line(traces):
    rc, _, err = _at_layout(traces["clean-1f1b"], "certify", "--recipe", "tests.replay.test_pp_replay:other_cut")
    # every process refuses alike (one alone would leave the other waiting in the checkpoint's load)
    assert rc != 0, err[-2000:]
    lines = [line for line in err.splitlines() if "cut the model as the job did" in line]
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), err[-2000:]
    assert "stage 0 holds parameters 0..16 of the whole model; the job's stage 0 recorded 0..32" in lines[0]


def test_a_layout_replay_that_does_not_fit_its_processes_is_refused_in_one_line(traces):
    # the job's layout fixes the process count: the line names the budget, not another count of processes
    rc, _, err = _at_layout(traces["clean-1f1b"], "certify", env={"SDC_FORENSICS_REPLAY_MEMORY": "100k"})
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc != 0 and lines, err[-2000:]
    # process 0 says it, or, stopped by torchrun while still starting, process 1 does
    said = [line for line in lines if "the replay at the job's layout (2 processes, one stage each) needs" in line]
    assert said and "raise SDC_FORENSICS_REPLAY_MEMORY" in said[0], lines
