"""``sdc-forensics demo --parallel pp`` (PP 2 x FSDP2 DP 2: a transformer in two stages,
``Schedule1F1B``, 4 gloo processes): a clean run raises no alarm, every tensor of its DCP checkpoint
measures as the stages' pieces combined, ``verify-checkpoint`` certifies it (the one-process replay
is exact) and ``bisect`` finds nothing; a token id flipped in one rank's microbatch is named at that rank."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli


@pytest.mark.heavy
def test_clean_pipeline_run_verifies_and_bisects_clean(tmp_path):
    out = tmp_path / "clean"
    args = [
        "demo",
        "--parallel",
        "pp",
        "--steps",
        "8",
        "--checkpoint-every",
        "4",
        "--out",
        str(out),
        "--inject",
        "none",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "nothing fired" in result.output and "mesh 2 pp x 2 dp" in result.output
    manifest = json.loads((out / "trace" / "manifest.json").read_text())
    assert manifest["parallel"]["kind"] == "pp" and manifest["parallel"]["grad_divisor"] == 4
    verified = CliRunner().invoke(
        cli, ["verify-checkpoint", str(out / "checkpoints" / "step-00000004"), "--trace", str(out / "trace")]
    )
    rows = [line.split() for line in verified.output.splitlines() if line.startswith(("model.", "optim."))]
    # every tensor of both stages measured on the DCP directory as the ranks' pieces combined
    assert rows and all(row[-1] == "ok" and row[3] == row[4] for row in rows), verified.output
    assert "all ok" in verified.output and "CERTIFIED CLEAN" in verified.output, verified.output
    assert verified.exit_code == 0, verified.output
    bisected = CliRunner().invoke(cli, ["bisect", str(out / "trace"), "--json"])
    doc = json.loads(bisected.stdout)
    assert bisected.exit_code == 0 and doc["verdict"] == "clean" and not doc["evidence"], doc


@pytest.mark.heavy
def test_an_input_flip_of_a_token_id_is_named_at_its_rank_and_its_pipeline_peers_are_not(tmp_path):
    out = tmp_path / "input"
    args = ["demo", "--parallel", "pp", "--steps", "4", "--checkpoint-every", "2", "--out", str(out)]
    trained = CliRunner().invoke(cli, [*args, "--inject", "input:step=2:rank=1:bit=2"])
    assert trained.exit_code == 0, trained.output
    bisected = CliRunner().invoke(cli, ["bisect", str(out / "trace"), "--json"])
    doc = json.loads(bisected.stdout)
    assert bisected.exit_code == 1 and doc["first_divergent_step"] == 2, bisected.output
    # rank 1 (stage 0, dp 1) read a wrong token; rank 3, its stage 1, computed with it and is not named
    assert [(s["rank"], s["location"]) for s in doc["suspects"]] == [(1, "input_data")], doc["suspects"]
