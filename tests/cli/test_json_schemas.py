"""Every command's ``--json`` document, from real runs of the installed command, against its
published schema (``docs/schemas/NAME.schema.json``, docs/json.md); and the schemas are strict
enough to catch a renamed, missing or mistyped key."""

from __future__ import annotations

import copy
import json

import pytest

from sdc_forensics.cli.output import SCHEMA_VERSION
from tests.cli.installed import run_installed
from tests.factories import Fault, SimFault
from tests.schema_check import assert_valid


@pytest.fixture
def faulty_run(sim):
    """The sim run of tests/cli/test_bisect.py: a grad fault at step 4 on rank 3, checkpoints 0 and 4."""
    return sim(SimFault(where="grad", step=4, rank=3, bit=11), steps=5, checkpoint_every=4)


def _json(args, tmp_path, code: int) -> dict:
    ran = run_installed([str(a) for a in args], tmp_path)
    assert ran.returncode == code, ran.stderr
    return json.loads(ran.stdout)


def test_bisect_and_replay_documents(faulty_run, make_trace, tmp_path):
    trace, checkpoints = faulty_run / "trace", faulty_run / "checkpoints"
    doc = assert_valid(_json(["bisect", trace, "--checkpoints", checkpoints, "--json"], tmp_path, 1), "bisect")
    assert doc["suspects"][0]["evidence"] and doc["replayed"]["windows"]  # the nested parts were checked, not empty
    assert_valid(
        _json(
            ["bisect", make_trace(fault=Fault(kind="outlier", step=3, rank=1)), "--trace-only", "--json"], tmp_path, 4
        ),
        "bisect",
    )
    replay = assert_valid(
        _json(["replay", trace, "--from", 4, "--to", 4, "--checkpoints", checkpoints, "--json"], tmp_path, 1), "replay"
    )
    assert replay["evidence"] and replay["verdict"] == "corruption"


def test_certify_and_verify_checkpoint_documents(faulty_run, make_run, tmp_path):
    trace, checkpoints = faulty_run / "trace", faulty_run / "checkpoints"
    cert = assert_valid(_json(["certify", trace, "--checkpoints", checkpoints, "--json"], tmp_path, 0), "certify")
    assert cert["resume_step"] == 4 and cert["exit_code"] == 0
    run = make_run(steps=6, diverge=(3, 1))
    out = tmp_path / "cert.json"
    tainted = assert_valid(
        _json(["certify", run.trace_dir, "--certificate-out", out, "--json"], tmp_path, 0), "certify"
    )
    assert "tainted" in {c["status"] for c in tainted["checkpoints"]}
    alone = assert_valid(
        _json(["verify-checkpoint", checkpoints / "step-00000004.pt", "--json"], tmp_path, 0), "verify-checkpoint"
    )
    assert alone["verdict"] == "verified" and alone["report"]["tensors"]
    with_trace = assert_valid(
        _json(["verify-checkpoint", run.checkpoints[6], "--trace", run.trace_dir, "--json"], tmp_path, 1),
        "verify-checkpoint",
    )
    assert with_trace["certification"]["status"] == "tainted" and with_trace["analysis"]["verdict"] == "corruption"
    certified = assert_valid(
        _json(["verify-checkpoint", run.checkpoints[0], "--certificate", out, "--json"], tmp_path, 0),
        "verify-checkpoint",
    )
    assert certified["certificate"]["status"] == "clean"


def test_inspect_and_demo_documents(demo_run, make_trace, tmp_path):
    """The 3-rank weights fault run of tests/cli/test_certify_demo.py (cached): alarms and notes."""
    result = demo_run(
        ("weights:step=3:rank=1:bit=20", "checkpoint-file:step=2:rank=0:bit=3"),
        steps=6,
        checkpoint_every=2,
        world_size=3,
        result=True,
    )
    doc = assert_valid(_json(["inspect", result.config.trace_dir, "--json"], tmp_path, 0), "inspect")
    assert doc["alarms"] and doc["checkpoints"] and doc["environment"]["determinism"]
    assert_valid(_json(["inspect", make_trace(steps=3), "--json"], tmp_path, 0), "inspect")
    # demo --json is emit_json(result.to_json()): the same document, schema_version added
    demo = assert_valid({"schema_version": SCHEMA_VERSION, **result.to_json()}, "demo")
    assert demo["fired"] and demo["alarms"]


def test_the_schemas_catch_a_renamed_missing_or_mistyped_key(faulty_run, tmp_path):
    trace, checkpoints = faulty_run / "trace", faulty_run / "checkpoints"
    doc = _json(["bisect", trace, "--checkpoints", checkpoints, "--json"], tmp_path, 1)
    renamed = copy.deepcopy(doc)
    renamed["first_divergent"] = renamed.pop("first_divergent_step")
    nested = copy.deepcopy(doc)
    nested["suspects"][0]["evidence"][0]["step_no"] = nested["suspects"][0]["evidence"][0].pop("step")
    verdict = copy.deepcopy(doc)
    verdict["verdict"] = "CORRUPTION"
    status = copy.deepcopy(doc)
    status["checkpoints"][0]["status"] = "ok"
    typed = copy.deepcopy(doc)
    typed["first_divergent_step"] = "4"
    for broken in (renamed, nested, verdict, status, typed):
        with pytest.raises(AssertionError, match="does not match"):
            assert_valid(broken, "bisect")
