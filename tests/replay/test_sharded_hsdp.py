"""Issue 35, the sharded replay of what the job's cut decides: HSDP 2 x 2 recorded on 4 gloo ranks
(the demo MLP, SGD with momentum, the ordered reduction) and the clipped tied-head AdamW job
(``benchmarks/campaign.py --job clipped-lm``: ``clip_grad_norm_`` engaging on every step) replayed
with the model ``fully_shard``-ed over k = 2 and 4 processes (``SDC_FORENSICS_REPLAY_SHARDED=1``):
the clean runs certified bit for bit, and in HSDP a local-gradient fault and a weight-shard fault
found at their step and rank with the one-process replay's decision and evidence.

HSDP's reduction (each replica's ordered mean, then the replicas') and clipping's total norm (a sum
over the job's 4 shards in the recorded mesh order, not the replay's k) are what depend on the
job's cut: a replay that reduced or clipped as its own k processes would not certify these jobs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.demo.sharded import ShardedRecipe, clip
from sdc_forensics.replay import sharded

from tests.distributed.launch import torchrun
from tests.factories import gloo_job

# torchrun launches of 2 and 4 processes over three traces, a few minutes on 2 cores
pytestmark = pytest.mark.heavy

WORLD = 4
HSDP = {"hsdp": [2, 2]}
CLIPPED = {"model": "tied-lm", "optimizer": "adamw", "max_norm": 0.05}
# name -> (spec, step, rank, evidence location)
FAULTS = {
    "hsdp-local": ("local-gradient:step=4:rank=2:bit=20", 4, 2, "local_compute"),
    "hsdp-weights": ("weights:step=4:rank=3:bit=31", 4, 3, None),
}
# the sharded locations left, each replayed with k = 2 against the one-process replay's decision: the
# reduce-scatter's output on one rank, the replicas' all-reduce of a shard, the parameters one rank
# all-gathered for its forward, the optimizer's update of one shard, one rank's input
MORE_FAULTS = {
    "hsdp-reduce-scatter": ("reduce-scatter-output:step=3:rank=1:bit=30", 3, 1, None),
    "hsdp-all-reduce": ("all-reduce-output:step=3:rank=2:bit=30", 3, 2, None),
    "hsdp-all-gather": ("all-gather-output:step=3:rank=3:bit=30", 3, 3, None),
    "hsdp-update": ("update:step=3:rank=0:bit=30", 3, 0, None),
    "hsdp-input": ("input:step=3:rank=1:bit=30", 3, 1, None),
}


def _jobs(rank: int, root: str, runs: list) -> dict:
    """Every run of ``runs`` (name, keyword arguments of ``demo.sharded.train``) in one process group."""
    from sdc_forensics.demo.sharded import train

    out = {}
    for name, kwargs in runs:
        kwargs = dict(kwargs)
        if kwargs.get("hsdp"):
            kwargs["hsdp"] = tuple(kwargs["hsdp"])
        kwargs["inject"] = tuple(kwargs.get("inject", ()))
        out[name] = train(rank, WORLD, str(Path(root, name, "trace")), str(Path(root, name, "ckpt")), steps=6, **kwargs)
    return out


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded_hsdp")
    todo = [("hsdp-clean", HSDP), ("clipped-lm", CLIPPED)]
    todo += [(name, {**HSDP, "inject": [spec]}) for name, (spec, *_) in {**FAULTS, **MORE_FAULTS}.items()]
    found = gloo_job(_jobs, WORLD, root / "results", str(root), todo)
    # clipping engaged on every step of the clipped job (its norm is several times max_norm)
    assert all(norm > CLIPPED["max_norm"] for norm in found[0]["clipped-lm"]["grad_norms"])
    return {name: root / name / "trace" for name, _ in todo}


def _bisect(trace: Path, k: int, command: str = "bisect", *extra: str) -> tuple[int, dict]:
    # every run replays, none reuses another's ledger records
    (trace / "ledger.jsonl").unlink(missing_ok=True)
    args = [command, str(trace), "--json", *extra]
    if k == 1:
        result = CliRunner().invoke(cli, args)
        return result.exit_code, json.loads(result.stdout)
    rc, out, err, _ = torchrun(k, ["-m", "sdc_forensics", *args], timeout_s=300, env={sharded.SHARDED_ENV: "1"})
    assert out.strip(), err[-3000:]
    return rc, json.loads(out)


@dataclasses.dataclass(kw_only=True)
class ClipOff(ShardedRecipe):
    """The clipped job's recipe with a subtle mistake: it clips at a threshold 1 % above the job's."""

    def before_step(self, model, optimizer) -> None:
        clip(model, self.max_norm * 1.01)


#: what torchrun's processes import (``--recipe``)
clip_off = ClipOff()


def _evidence(doc: dict) -> list:
    return sorted((e["kind"], e["step"], tuple(e["ranks"]), e.get("location")) for e in doc["evidence"])


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", ["hsdp-clean", "clipped-lm"])
def test_clean_job_certified_sharded(traces, name, k):
    rc, doc = _bisect(traces[name], k)
    assert rc == 0 and doc["verdict"] == "clean", doc
    assert all(c["status"] == "clean" for c in doc["checkpoints"]), doc["checkpoints"]
    text = json.dumps(doc)
    assert f"x {k} processes (sharded)" in text and '"tolerant"' not in text


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_hsdp_fault_found_as_by_one_process(traces, name):
    _, step, rank, location = FAULTS[name]
    rc1, one = _bisect(traces[name], 1)
    assert rc1 == 1 and one["verdict"] == "corruption", one
    for k in (2, 4):
        rc, doc = _bisect(traces[name], k)
        assert "(sharded)" in json.dumps(doc)
        assert rc == rc1 and doc["verdict"] == one["verdict"], doc
        assert _evidence(doc) == _evidence(one)
        assert doc.get("suspects") == one.get("suspects")
        named = [e for e in doc["evidence"] if e["step"] == step and rank in e["ranks"]]
        assert named and (location is None or any(e.get("location") == location for e in named)), doc["evidence"]


@pytest.mark.parametrize("name", sorted(MORE_FAULTS))
def test_every_sharded_location_found_as_by_one_process(traces, name):
    _, step, rank, _ = MORE_FAULTS[name]
    rc1, one = _bisect(traces[name], 1)
    assert rc1 == 1 and one["verdict"] == "corruption" and one["first_divergent_step"] <= step, one
    assert any(e["step"] == step and rank in e["ranks"] for e in one["evidence"]), one["evidence"]
    rc, doc = _bisect(traces[name], 2)
    assert "(sharded)" in json.dumps(doc)
    assert rc == rc1 and doc["verdict"] == one["verdict"], doc
    assert doc["first_divergent_step"] == one["first_divergent_step"]
    assert _evidence(doc) == _evidence(one)
    assert doc.get("suspects") == one.get("suspects")
    assert [c["status"] for c in doc["checkpoints"]] == [c["status"] for c in one["checkpoints"]]


def test_a_recipe_that_clips_one_percent_off_certifies_nothing_sharded(traces):
    # the clipped job (clipping engaged on every step) replayed with a threshold 1 % off: the
    # sharded replay reproduces the local gradients, so the update is what must give it away
    rc, doc = _bisect(traces["clipped-lm"], 2, "certify", "--recipe", "tests.replay.test_sharded_hsdp:clip_off")
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert rc != 0 and doc["verdict"] != "clean", doc
    assert all(status != "clean" for step, status in statuses.items() if step > 0), statuses
