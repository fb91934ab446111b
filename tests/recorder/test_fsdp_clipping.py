"""Sharded jobs whose gradient clipping engages on every step (issue 33): ``demo/sharded.py``'s
tied-head transformer, AdamW with two parameter groups, ``clip_grad_norm_(model.parameters(),
0.05)`` on its DTensor parameters inside ``rec.step`` (its total norm is far above 0.05), on 4 gloo
processes, recorded, then analysed by the unchanged commands:

* clean runs (FSDP over 4 and HSDP 2 x 2; float32 and bfloat16 compute; the ordered and gloo's own
  reduction) are certified, every step's update replayed bit for bit, and ``bisect --trace-only``
  raises nothing: the reduced gradient is recorded before the clipping, and the replay clips with
  the norm FSDP2's ranks computed;
* a gradient fault and a weight fault are named at their step and rank, and a gradient spike that
  the clipping scales down leaves no evidence against the collective.

The fast suite runs one clean FSDP job and one faulty HSDP bfloat16 job; the rest is ``heavy``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli

from tests.factories import gloo_job
from tests.recorder.test_fsdp_recorder import _jobs

WORLD = 4
MAX_NORM = 0.05
CLIP = {"model": "tied-lm", "optimizer": "adamw", "max_norm": MAX_NORM}
BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
HSDP = {"hsdp": [2, 2]}

FAST_CLEAN = {"fsdp": {}}
FAST_FAULTS = {"hsdp-bf16-spike": ({**HSDP, **BF16}, "local-gradient:step=2:rank=1:bit=27", 2, 1)}
HEAVY_CLEAN = {
    "hsdp": HSDP,
    "fsdp-bf16": BF16,
    "hsdp-bf16": {**HSDP, **BF16},
    "fsdp-native": {"reduction": "native"},
    "hsdp-native": {**HSDP, "reduction": "native"},
    "fsdp-bf16-native": {**BF16, "reduction": "native"},
}
HEAVY_FAULTS = {
    "fsdp-grad": ({}, "local-gradient:step=2:rank=1:bit=20", 2, 1),
    "fsdp-weights": ({}, "weights:step=2:rank=3:bit=20", 2, 3),
    "fsdp-bf16-weights": (BF16, "weights:step=4:rank=2:bit=21", 4, 2),
    "hsdp-grad": (HSDP, "local-gradient:step=3:rank=2:bit=20", 3, 2),
    "hsdp-weights": (HSDP, "weights:step=4:rank=3:bit=31", 4, 3),
    # gloo's own reduce-scatter order (native), as most jobs keep it
    "fsdp-native-grad": ({"reduction": "native"}, "local-gradient:step=3:rank=2:bit=20", 3, 2),
    "hsdp-native-weights": ({**HSDP, "reduction": "native"}, "weights:step=2:rank=1:bit=21", 2, 1),
}


def _run(tmp_path_factory, name: str, clean: dict, faults: dict):
    root = tmp_path_factory.mktemp(name)
    todo = [(n, {**CLIP, **kwargs}) for n, kwargs in clean.items()]
    todo += [(n, {**CLIP, **kwargs, "inject": [spec]}) for n, (kwargs, spec, _, _) in faults.items()]
    return root, gloo_job(_jobs, WORLD, root / "results", str(root), todo)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return _run(tmp_path_factory, "clip_fast", FAST_CLEAN, FAST_FAULTS)


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    return _run(tmp_path_factory, "clip_heavy", HEAVY_CLEAN, HEAVY_FAULTS)


def _cli(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def _check_clean(root: Path, found: list, name: str) -> None:
    assert all(f[name]["alarms"] == [] for f in found), [f[name] for f in found]
    norms = found[0][name]["grad_norms"]
    assert len(norms) == 6 and min(norms) > 4 * MAX_NORM, norms  # clipping engaged on every step
    trace = str(root / name / "trace")
    code, doc = _cli("replay", trace, "--from", "0", "--to", "5")
    assert code == 0 and doc["comparison"] == "exact", doc
    assert doc["notes"] == [] and doc["evidence"] == [], doc  # every update reproduced, through both checkpoint windows
    code, doc = _cli("bisect", trace, "--trace-only")
    assert code == 4 and doc["verdict"] != "corruption" and doc["evidence"] == [], doc  # trace-only finding nothing: 4
    code, doc = _cli("certify", trace)
    assert code == 0, doc
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "clean"] and doc["resume_step"] == 3, doc


def _check_fault(root: Path, name: str, step: int, rank: int) -> None:
    code, doc = _cli("bisect", str(root / name / "trace"))
    assert code == 1 and doc["first_divergent_step"] == step, doc
    assert [s["rank"] for s in doc["suspects"]] == [rank], doc["suspects"]
    against_collective = [
        e for e in doc["evidence"] if e["kind"] == "allreduce_mismatch" or "do not add up" in e["found"]
    ]
    assert against_collective == [], against_collective


def test_a_clean_clipped_fsdp_job_certifies_bit_for_bit_and_trace_only_raises_nothing(fast):
    root, found = fast
    _check_clean(root, found, "fsdp")


def test_a_gradient_spike_in_a_clipped_hsdp_bfloat16_job_names_its_rank_and_not_the_collective(fast):
    root, _ = fast
    _, _, step, rank = FAST_FAULTS["hsdp-bf16-spike"]
    _check_fault(root, "hsdp-bf16-spike", step, rank)
    code, doc = _cli("bisect", str(root / "hsdp-bf16-spike" / "trace"), "--trace-only")
    assert [e for e in doc["evidence"] if e["kind"] == "allreduce_mismatch"] == [], doc["evidence"]


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(HEAVY_CLEAN))
def test_clean_clipped_sharded_jobs_certify_bit_for_bit(heavy, name):
    root, found = heavy
    _check_clean(root, found, name)


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(HEAVY_FAULTS))
def test_faults_in_clipped_sharded_jobs_are_named_at_their_step_and_rank(heavy, name):
    root, _ = heavy
    _, _, step, rank = HEAVY_FAULTS[name]
    _check_fault(root, name, step, rank)
