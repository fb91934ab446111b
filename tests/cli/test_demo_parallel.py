"""``sdc-forensics demo --parallel fsdp|hsdp``: the README tour's sharded run, then bisect names the
rank of the default fault (a finite local-gradient flip no online check sees); DDP-only settings and
locations are refused in one line before anything runs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli


def test_the_hsdp_demo_records_a_run_whose_fault_bisect_names(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(
        cli,
        [
            "demo",
            "--parallel",
            "hsdp",
            "--steps",
            "8",
            "--checkpoint-every",
            "4",
            "--out",
            str(out),
            "--inject",
            "local-gradient:step=5:rank=3:bit=27",
        ],
    )
    assert result.exit_code == 0, result.output
    assert f"next: sdc-forensics bisect {out / 'trace'}" in result.output
    result = CliRunner().invoke(cli, ["bisect", str(out / "trace"), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["first_divergent_step"] == 5, doc
    assert [(s["rank"], s["mesh"], s["location"]) for s in doc["suspects"]] == [
        (3, "replicate=1, shard=1", "local_compute")
    ]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--inject", "grad:step=2:rank=1:bit=30"], "grad is a DDP location"),
        (["--inject", "local-gradient:step=9:rank=1:bit=30"], "step must be in 0..7"),
        (["--threads", "2"], "--threads go with the DDP demo"),
    ],
)
def test_the_sharded_demo_refuses_what_it_cannot_run_before_running(tmp_path, args, says):
    result = CliRunner().invoke(
        cli, ["demo", "--parallel", "fsdp", "--steps", "8", "--out", str(tmp_path / "d"), *args]
    )
    assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "d").exists()
