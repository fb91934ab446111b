"""Issue 10, item 4 (``demo --inject``), through the installed command with stderr to a file: a
fault spec that the job cannot hold (a bit beyond the dtype, an element beyond the tensor, a step
beyond ``--steps``, a rank beyond the world size, a byte beyond the checkpoint file) is exit 2
with one line naming the spec and the valid range, before anything runs: ``--out`` not created."""

from __future__ import annotations

import pytest

from sdc_forensics.demo.recipe import recipe
from tests.cli.installed import run_installed

_GRAD = sum(p.numel() for p in recipe.build("cpu")[0].parameters())  # computed independently of demo/targets.py
_INPUT = 2 * recipe.microbatch_size * recipe.in_features  # two microbatches of (16, 64) float32 inputs per rank-step


_CASES = [
    (
        "grad:step=23:rank=2:bit=40",
        "grad:step=23:rank=2:bit=40: bit 40 does not exist in a float32 element of rank 2's local "
        "gradient (use bit=0..31)",
    ),
    (
        "allreduce-all:step=5:bit=32",
        "bit 32 does not exist in a float32 element of the reduced gradient (use bit=0..31)",
    ),
    (
        "weights:step=5:rank=1:bit=63",
        "bit 63 does not exist in a float32 element of rank 1's parameters (use bit=0..31)",
    ),
    (
        "grad:step=23:rank=2:bit=3:element=99999999",
        f"element 99999999 is beyond rank 2's local gradient ({_GRAD} elements: use element=0..{_GRAD - 1})",
    ),
    (f"update:step=5:rank=0:bit=3:element={_GRAD}", f"use element=0..{_GRAD - 1}"),
    (
        f"input:step=5:rank=3:bit=3:element={_INPUT}",
        f"beyond rank 3's inputs at step 5 ({_INPUT} elements: use element=0..{_INPUT - 1})",
    ),
    ("grad:step=40:rank=2:bit=30", "step 40 is outside the run (steps 0..39)"),
    ("grad:step=23:rank=4:bit=30", "rank 4 does not exist in a 4-rank run (use rank=0..3)"),
    ("checkpoint-file:step=10:bit=3:element=99999999", "is beyond the end of checkpoint 10's file"),
    ("checkpoint-file:step=15:bit=3", "no checkpoint 15 is written"),
]
_INSTALLED = (
    0,
    3,
    6,
    7,
    8,
)  # bit, element, step, rank, file byte: each friction point once through the installed command


@pytest.mark.parametrize("spec, expected", _CASES)
def test_every_range_is_checked_in_process(tmp_path, spec, expected):
    """The same checks through click (fast): every location's range."""
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    out = tmp_path / "sdc-demo"
    result = CliRunner().invoke(cli, ["demo", "--out", str(out), "--inject", spec])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: fault ") and expected in lines[0]
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("spec, expected", [_CASES[i] for i in _INSTALLED])
def test_a_spec_the_job_cannot_hold_is_refused_before_anything_runs(tmp_path, spec, expected):
    out = tmp_path / "sdc-demo"
    ran = run_installed(["demo", "--out", str(out), "--inject", spec], tmp_path)
    assert ran.returncode == 2, ran.stderr
    assert (
        len(ran.stderr_lines) == 1
        and ran.stderr_lines[0].startswith("error: fault ")
        and expected in ran.stderr_lines[0]
    )
    assert spec.split(":")[0] in ran.stderr_lines[0] and "Traceback" not in ran.stderr
    assert not out.exists() and ran.stdout == ""


@pytest.mark.slow
def test_a_spec_at_the_edge_of_the_range_is_accepted(tmp_path):
    """The last element and the sign bit exist: the run starts and the flip fires there."""
    out = tmp_path / "edge"
    ran = run_installed(
        [
            "demo",
            "--out",
            str(out),
            "--steps",
            "2",
            "--checkpoint-every",
            "2",
            "--audit-every",
            "0",
            "--json",
            "--inject",
            f"grad:step=1:rank=3:bit=31:element={_GRAD - 1}",
        ],
        tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert f"element {_GRAD - 1} went" in ran.stderr


def test_an_existing_demo_in_out_is_refused_up_front_and_left_alone(tmp_path):
    out = tmp_path / "prev"
    (out / "trace").mkdir(parents=True)
    (out / "trace" / "manifest.json").write_text("{}")
    ran = run_installed(["demo", "--out", str(out)], tmp_path)
    assert ran.returncode == 2 and ran.stderr_lines == [
        f"error: {out} already holds a demo trace; pass a new --out directory"
    ]
    assert sorted(p.name for p in out.rglob("*")) == ["manifest.json", "trace"]
    assert (out / "trace" / "manifest.json").read_text() == "{}"
