"""Sharded and TP jobs replayed under torchrun on more processes than their layout needs.

With enough checkpoint intervals, processes used to take whole intervals each and replay them
alone; the recipe's ``dcp.load`` is a collective over the default process group, so each process
waited for the others until gloo timed out, and every process exited 3 blaming the recipe (a trial
user's TP and PP jobs, and the PP demo, on 3-4 processes). The intervals of a DCP job are replayed
together instead: the same verdict as one process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.launch import torchrun


def _demo_then_torchrun(tmp_path, parallel: str, *, steps: int, command: str, processes: int):
    """A clean 4-rank demo of ``parallel`` (checkpoints every 4 steps), then ``command --json`` on
    ``processes`` torchrun processes: ``(exit code, stdout, stderr)``."""
    demo = [sys.executable, "-m", "sdc_forensics", "demo", "--parallel", parallel, "--out", str(tmp_path / "run")]
    made = subprocess.run(
        [*demo, "--inject", "none", "--steps", str(steps), "--checkpoint-every", "4"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr[-3000:]
    trace = str(tmp_path / "run" / "trace")
    args = ["-m", "sdc_forensics", command, trace, "--no-ledger", "--replay-timeout", "60", "--json"]
    rc, out, err, _ = torchrun(processes, args, timeout_s=400)
    return rc, out, err


@pytest.mark.heavy  # a 4-rank PP demo, then 3 torchrun processes: about a minute
def test_a_pp_demo_with_three_intervals_certifies_on_three_processes(tmp_path):
    rc, out, err = _demo_then_torchrun(tmp_path, "pp", steps=12, command="certify", processes=3)
    assert rc == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["verdict"] == "clean" and {c["status"] for c in doc["checkpoints"]} == {"clean"}, doc
    assert "shared out whole" not in err


@pytest.mark.heavy  # a 4-rank TP demo, then 4 torchrun processes: about a minute
def test_a_clean_tp_demo_replayed_on_four_processes_names_nobody(tmp_path):
    """More processes than TP's size: the one-process TP replay with each process computing its own
    ranks. A rank computed by another process was fingerprinted whole, not as the TP slice it recorded,
    so every rank but process 0's was 'corruption' at every step of a clean run (exit 1). Within
    tolerance, as on one process: inconclusive, no evidence."""
    _, out, err = _demo_then_torchrun(tmp_path, "tp", steps=5, command="bisect", processes=4)
    assert out.strip(), err[-3000:]
    doc = json.loads(out)
    assert doc["verdict"] == "inconclusive" and doc["evidence"] == [] and doc["suspects"] == [], doc
