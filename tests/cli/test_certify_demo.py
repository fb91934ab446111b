"""``sdc-forensics certify`` and ``verify-checkpoint --trace`` on real demo runs (gloo DDP on CPU, the
recorder's own notes and checkpoints)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli

pytestmark = pytest.mark.slow


@pytest.fixture
def demo(demo_run):
    """``demo(injections, world_size=..., ...)`` -> DemoResult of a 6-step run checkpointed every 2 steps."""

    def _run(injections, **kwargs):
        return demo_run(injections, steps=6, checkpoint_every=2, result=True, **kwargs)

    return _run


def _certify(result) -> dict:
    out = CliRunner().invoke(cli, ["certify", str(result.config.trace_dir), "--json"])
    assert out.exit_code == 0, (
        out.output
    )  # a resume point exists (every case here has one), later checkpoints are not clean
    return {c["step"]: c for c in json.loads(out.stdout)["checkpoints"]} | {"doc": json.loads(out.stdout)}


def test_checkpoint_saved_from_the_diverged_replica_is_not_certified(demo):
    """Two ranks, rank 0's weights flipped at step 3: no strict majority, so rank 0 (diverged)
    writes checkpoints 4 and 6; they must be corrupt, and the resume point is 2."""
    result = demo(("weights:step=3:rank=0:bit=20",), world_size=2)
    statuses = _certify(result)
    assert statuses["doc"]["resume_step"] == 2
    for step in (4, 6):
        assert statuses[step]["status"] == "corrupt"
        assert any("diverged replica" in r for r in statuses[step]["reasons"])
    for step in (0, 2):  # certify replays like bisect: the window's start is replay-verified
        assert statuses[step]["status"] == "clean"
    verify = CliRunner().invoke(
        cli, ["verify-checkpoint", str(result.config.checkpoint_path(4)), "--trace", str(result.config.trace_dir)]
    )
    assert verify.exit_code == 1 and "NOT CERTIFIABLE" in verify.output


def test_weights_injection_taints_later_checkpoints_and_storage_flip_is_corrupt(demo):
    """Three ranks: the healthy majority saves, so later checkpoints are tainted, not corrupt;
    checkpoint 2's file is damaged on disk after its note was written: corrupt."""
    result = demo(("weights:step=3:rank=1:bit=20", "checkpoint-file:step=2:rank=0:bit=3"), world_size=3)
    statuses = _certify(result)
    first = statuses["doc"]["first_divergent_step"]
    assert first is not None and first <= 3
    assert statuses[0]["status"] == "clean"
    assert statuses[2]["status"] == "corrupt"
    assert statuses["doc"]["resume_step"] == 0
    for step in (4, 6):
        assert statuses[step]["status"] == "tainted", statuses[step]
    clean = CliRunner().invoke(
        cli, ["verify-checkpoint", str(result.config.checkpoint_path(0)), "--trace", str(result.config.trace_dir)]
    )
    assert clean.exit_code == 0, clean.output


def test_certify_replays_so_a_fault_the_trace_cannot_see_still_taints_later_checkpoints(demo):
    """A low-mantissa flip of a local gradient leaves no trace evidence; certify replays like
    bisect, finds step 3, and does not certify checkpoints 4 and 6. --trace-only cannot."""
    result = demo(("grad:step=3:rank=1:bit=12",), world_size=3, audit_every=0)
    statuses = _certify(result)
    assert statuses["doc"]["first_divergent_step"] == 3 and statuses["doc"]["mode"] == "replay"
    assert statuses["doc"]["resume_step"] == 2
    assert statuses[4]["status"] == "tainted" and statuses[6]["status"] == "tainted"
    trace_only = CliRunner().invoke(cli, ["certify", str(result.config.trace_dir), "--trace-only", "--json"])
    doc = json.loads(trace_only.stdout)
    # the trace alone sees nothing, and certifies nothing it did not examine (it used to certify 6)
    assert trace_only.exit_code == 4 and doc["first_divergent_step"] is None and doc["resume_step"] is None
    assert {c["status"] for c in doc["checkpoints"]} == {"unverified"}


def test_a_checkpoint_copied_under_another_checkpoint_s_name_is_said_to_be_a_copy(demo, tmp_path):
    """verify-checkpoint --trace takes the step from the file's name; a clean run's checkpoint 2
    copied to checkpoint 4's name is named as checkpoint 2's bytes, not as storage damage, with
    the flag that checks it as what it is (a new user's trial)."""
    import shutil

    result = demo((), world_size=2)
    copy = tmp_path / result.config.checkpoint_path(4).name
    shutil.copyfile(result.config.checkpoint_path(2), copy)
    ran = CliRunner().invoke(
        cli, ["verify-checkpoint", str(copy), "--trace", str(result.config.trace_dir), "--no-ledger"]
    )
    assert ran.exit_code == 1, ran.output
    headline = next(line for line in ran.output.splitlines() if line.startswith("NOT CERTIFIABLE"))
    assert "a copy of checkpoint 2 under checkpoint 4's file name" in headline and "pass --step 2" in headline
    again = CliRunner().invoke(
        cli, ["verify-checkpoint", str(copy), "--trace", str(result.config.trace_dir), "--step", "2", "--no-ledger"]
    )
    assert again.exit_code == 0, again.output
    # a mistyped --step (a trial user's) is a usage error naming the right one, not "corruption, check the disk"
    typo = CliRunner().invoke(
        cli, ["verify-checkpoint", str(copy), "--trace", str(result.config.trace_dir), "--step", "4", "--no-ledger"]
    )
    assert typo.exit_code == 2, typo.output
    assert "holds checkpoint 2's tensors" in typo.output and "pass --step 2" in typo.output
