"""Issue 40: a recipe whose own code fails (here ``load_state_dict`` on ``_orig_mod.`` keys) ends
every replaying command in one line naming the recipe, exit 3 (bad input), an empty stdout under
``--json``: before, a traceback and exit 1, which the exit-code table calls corruption."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.distributed.launch import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", [["bisect", "--json"], ["certify"], ["replay", "--from", "0", "--to", "1"]])
def test_a_recipe_that_fails_to_load_a_checkpoint_is_one_line_and_exit_3(demo_run, command):
    run = demo_run(steps=4, checkpoint_every=2, injections=())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdc_forensics",
            command[0],
            str(run / "trace"),
            *command[1:],
            "--recipe",
            "tests.cli.broken_recipe:recipe",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "load_checkpoint" in line]
    assert len(said) == 1 and "RuntimeError" in said[0] and "_orig_mod." in said[0], proc.stderr[-3000:]
