"""A DCP-checkpointed job replayed under torchrun on more processes than its layout needs.

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


@pytest.mark.heavy  # a 4-rank PP demo, then 3 torchrun processes: about a minute
def test_a_pp_demo_with_three_intervals_certifies_on_three_processes(tmp_path):
    demo = [sys.executable, "-m", "sdc_forensics", "demo", "--parallel", "pp", "--out", str(tmp_path / "run")]
    made = subprocess.run(
        [*demo, "--inject", "none", "--steps", "12", "--checkpoint-every", "4"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr[-3000:]
    trace = str(tmp_path / "run" / "trace")
    args = ["-m", "sdc_forensics", "certify", trace, "--no-ledger", "--replay-timeout", "60", "--json"]
    rc, out, err, _ = torchrun(3, args, timeout_s=400)
    assert rc == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["verdict"] == "clean" and {c["status"] for c in doc["checkpoints"]} == {"clean"}, doc
    assert "shared out whole" not in err
