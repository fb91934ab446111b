"""The BatchNorm job replayed under ``torchrun`` (issue 21): DDP's buffer broadcast across replay processes.

``replay --from 0 --to 5`` shares each step's ranks across 3 processes (ranks 0 and 3 on process 0):
rank 0's buffers, which every rank starts the next step from, are computed by process 0 and sent to
the others (``distributed.share_from_rank``). The document must be the single-process one, and say
that the replayed buffers are the saved ones at checkpoints 3 and 6. (Only process 0 writes the
document and checks the buffers, and training-mode BatchNorm's gradients do not read them, so this
recipe cannot show whether the other processes received them: it shows that the broadcast keeps the
processes' collectives in step and changes nothing of the result.) A fault is then found at its
exact step and rank by ``bisect`` under torchrun, with the single-process document. One launch at a
time (each ~20-40 s on a loaded 2-core machine).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from tests.distributed.launch import strip_timing, torchrun

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3
RECIPE = "sdc_forensics.demo.batchnorm:recipe"
TIMEOUT_S = 300
SAME = "the replayed module buffers (e.g. BatchNorm running statistics) equal the saved ones bit for bit"


def _both(args: list[str]):
    """``(torchrun document, single-process document, torchrun exit code, single exit code, stderr)``."""
    code, out, err, _ = torchrun(3, ["-m", "sdc_forensics", *args], timeout_s=TIMEOUT_S)
    assert out, err[-3000:]
    single = CliRunner().invoke(cli, args)
    return json.loads(out), json.loads(single.stdout), code, single.exit_code, err


def test_torchrun_replay_shares_rank_0s_buffers_and_prints_the_single_process_document(demo_run):
    trace = demo_run((), steps=STEPS, checkpoint_every=EVERY, recipe=RECIPE) / "trace"
    multi, single, code, single_code, err = _both(["replay", str(trace), "--from", "0", "--to", "5", "--json"])
    assert strip_timing(multi) == strip_timing(single)
    assert multi["verdict"] == "clean" and multi["comparison"] == "exact"
    assert (code, single_code) == (0, 0), err[-3000:]
    assert sorted(n for n in multi["notes"] if SAME in n) == [f"checkpoint {n}: {SAME} (9 tensors)" for n in (3, 6)]
    assert "note: replaying across 3 processes (gloo)" in err


def test_torchrun_bisect_finds_a_batchnorm_fault_at_its_exact_step_and_rank(demo_run):
    trace = demo_run("grad:step=4:rank=2:bit=30", steps=STEPS, checkpoint_every=EVERY, recipe=RECIPE) / "trace"
    multi, single, code, single_code, err = _both(["bisect", str(trace), "--json"])
    assert strip_timing(multi) == strip_timing(single)
    assert (multi["verdict"], multi["first_divergent_step"]) == ("corruption", 4)
    assert [s["rank"] for s in multi["suspects"]] == [2]
    assert (code, single_code) == (1, 1), err[-3000:]
