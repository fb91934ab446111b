"""Issue 35, the sharded replay of a mixed-precision job: FSDP over 4 gloo ranks recorded with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (torchtitan's default; the demo
MLP, two microbatches per rank, so the float32 accumulation of bfloat16 gradients is exercised),
replayed with the model fully_shard-ed over k = 2 processes under the recorded policy: the clean run
certified bit for bit, a local-gradient fault named at its step and rank as the one-process replay
names it. Without the recorded policy the same replay differs from the record on every rank (checked
by hand when this was built), so the exact certification is what the policy buys."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.replay import sharded
from sdc_forensics.replay.sharded_replayer import supported
from sdc_forensics.trace.mesh import ShardMesh

from tests.distributed.launch import torchrun

FAULT = ("local-gradient:step=4:rank=2:bit=20", 4, 2)
# an exponent bit: far above bfloat16's roundoff, so a replay within tolerance finds it too
STRONG = ("local-gradient:step=4:rank=1:bit=30", 4, 1)
BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
ASKED = {sharded.SHARDED_ENV: "1"}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    from sdc_forensics.demo.sharded import run_demo

    root = tmp_path_factory.mktemp("sharded_mixed")
    run_demo(root / "clean", "fsdp", (), steps=6, checkpoint_every=3, **BF16)
    run_demo(root / "fault", "fsdp", (FAULT[0],), steps=6, checkpoint_every=3, **BF16)
    run_demo(root / "strong", "fsdp", (STRONG[0],), steps=6, checkpoint_every=3, **BF16)
    return {name: root / name / "trace" for name in ("clean", "fault", "strong")}


def _run(command: str, trace: Path, k: int) -> tuple[int, dict]:
    (trace / "ledger.jsonl").unlink(missing_ok=True)  # every run replays, none reuses another's records
    if k == 1:
        result = CliRunner().invoke(cli, [command, str(trace), "--json"])
        return result.exit_code, json.loads(result.stdout)
    rc, out, err, _ = torchrun(k, ["-m", "sdc_forensics", command, str(trace), "--json"], timeout_s=300, env=ASKED)
    assert out.strip(), err[-3000:]
    return rc, json.loads(out)


def _evidence(doc: dict) -> list:
    return sorted((e["kind"], e["step"], tuple(e["ranks"]), e.get("location")) for e in doc["evidence"])


@pytest.mark.heavy  # a 4-rank bf16 job recorded twice, then torchrun launches of 2 processes: about a minute
def test_a_clean_bf16_job_is_certified_sharded_bit_for_bit(jobs):
    manifest = json.loads((jobs["clean"] / "manifest.json").read_text())
    assert (manifest["parallel"]["param_dtype"], manifest["parallel"]["reduce_dtype"]) == ("bfloat16", "float32")
    rc, doc = _run("certify", jobs["clean"], 2)
    assert rc == 0, doc
    assert doc["verdict"] == "clean" and doc["resume_step"] == 3
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"]
    # checkpoint 3 certified by steps 0..2 replayed bit for bit, on the sharded replay
    assert [c["exact_now"] for c in doc["coverage"] if c["step"] == 3] == [[[0, 2]]]
    assert "(exact)" in doc["scope"] and "x 2 processes (sharded)" in doc["scope"], doc["scope"]


@pytest.mark.heavy
def test_a_bf16_local_gradient_fault_is_named_as_by_one_process(jobs):
    rc1, one = _run("bisect", jobs["fault"], 1)
    rc, doc = _run("bisect", jobs["fault"], 2)
    assert rc1 == rc == 1 and doc["verdict"] == one["verdict"] == "corruption", doc
    assert "x 2 processes (sharded)" in doc["replayed"]["device"]
    assert doc["replayed"]["comparison"] == "exact" and doc["first_divergent_step"] == FAULT[1]
    assert _evidence(doc) == _evidence(one)
    assert ("replay_mismatch", FAULT[1], (FAULT[2],), "local_compute") in _evidence(doc)


@pytest.mark.heavy
def test_at_another_thread_count_a_bf16_job_is_compared_within_bfloat16s_roundoff(jobs):
    """Recomputed at 2 threads, a job that computed in bfloat16 differs from its record on every
    rank by 70-450 float32 tolerances (a trial user's GPT, stop 55). Compared in float32 terms each
    window stopped at its first step as weak common-mode evidence, and the step-4 fault was never
    reached (exit 4); within bfloat16's roundoff the fault is named and the clean run certifies
    nothing and names nobody."""
    for name in ("strong", "clean"):
        (jobs[name] / "ledger.jsonl").unlink(missing_ok=True)
    strong = CliRunner().invoke(cli, ["bisect", str(jobs["strong"]), "--threads", "2", "--json"])
    doc = json.loads(strong.stdout)
    assert strong.exit_code == 1 and doc["verdict"] == "corruption", doc
    assert doc["replayed"]["comparison"] == "tolerant" and doc["first_divergent_step"] == STRONG[1]
    assert [s["rank"] for s in doc["suspects"]] == [STRONG[2]]
    clean = CliRunner().invoke(cli, ["bisect", str(jobs["clean"]), "--threads", "2", "--json"])
    doc = json.loads(clean.stdout)
    assert clean.exit_code == 4 and doc["verdict"] == "inconclusive", doc
    assert doc["suspects"] == [] and doc["evidence"] == []
    # every window ran to its end: none stopped at a common-mode mismatch in its first step
    assert all(w["last_replayed"] == w["to"] for w in doc["replayed"]["windows"]), doc["replayed"]["windows"]


def _mesh(**dtypes) -> ShardMesh:
    doc = {"kind": "fsdp", "shape": [2], "dim_names": ["shard"], "shard_dim": 0, "coords": [[0], [1]], **dtypes}
    return ShardMesh.from_json(doc, 2)


ORDERED = types.SimpleNamespace(
    manifest=types.SimpleNamespace(attempts=[types.SimpleNamespace(determinism={"reduction": "ordered"})])
)


@pytest.mark.parametrize(
    ("dtypes", "refused"),
    [
        ({}, ""),
        ({"param_dtype": "bfloat16", "reduce_dtype": "float32", "casts": [["", "bfloat16", ""]]}, ""),
        ({"param_dtype": "float16", "reduce_dtype": "float32"}, ""),
        # a low-precision reduction (FSDP2 divides a float16 one around the sum): not reproduced on the shards
        ({"reduce_dtype": "bfloat16"}, "reduced in bfloat16"),
        ({"param_dtype": "float16", "reduce_dtype": "float16"}, "reduced in float16"),
    ],
)
def test_which_mixed_precision_jobs_are_replayed_sharded(dtypes, refused):
    why = supported(_mesh(**dtypes), ORDERED)
    assert (refused in why) if refused else why == "", why
