"""Issue 35, the cost of a sharded job's audits made explicit: an audit of an FSDP2 job recomputes a
rank's microbatches on a whole copy of the model (``FSDPLayout.audit_module``), so the Recorder
refuses ``audit_every`` up front, in one line on every rank, when that copy cannot fit the per-rank
budget (``SDC_FORENSICS_AUDIT_MEMORY``); under a budget it fits, the audited job records as before.

2 gloo ranks, the demo MLP (``demo/sharded.py``): 3077 float32 parameters, 12308 bytes whole, so an
audit needs 3 x 12308 bytes with no activation allowance (``SDC_FORENSICS_REPLAY_ACTIVATIONS=0``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sdc_forensics.recorder.audit import AUDIT_BUDGET_ENV, audit_refusal, sharded_audit_bytes
from sdc_forensics.recorder.options import RecorderOptions
from sdc_forensics.replay import memory

from tests.factories import gloo_job

WHOLE = 4 * (24 * 96 + 96 + 96 + 96 + 96 * 5 + 5)


def _audited(rank: int, root: str, budget: str) -> dict:
    """The demo's FSDP job with audits every 2 steps under ``budget``: what the Recorder raised, if anything."""
    from sdc_forensics.demo.sharded import train
    from sdc_forensics.errors import UsageError

    os.environ[AUDIT_BUDGET_ENV] = budget
    os.environ[memory.ACTIVATIONS_ENV] = "0"
    try:
        train(rank, 2, str(Path(root, "trace")), str(Path(root, "ckpt")), steps=2, checkpoint_every=3, audit_every=2)
    except UsageError as refused:
        return {"error": str(refused), "trace": Path(root, "trace", "manifest.json").exists()}
    return {"error": "", "trace": Path(root, "trace", "manifest.json").exists()}


# two 2-process gloo jobs: about 45 s on 2 shared cores
@pytest.mark.heavy
def test_audit_of_a_sharded_job_refused_above_the_budget(tmp_path):
    refused = gloo_job(_audited, 2, tmp_path / "small", str(tmp_path / "small"), str(3 * WHOLE - 1))
    assert all(r["error"] == refused[0]["error"] for r in refused)
    message = refused[0]["error"]
    assert message and "\n" not in message and AUDIT_BUDGET_ENV in message and "audit_every" in message
    # refused before the trace opened
    assert not refused[0]["trace"]
    fits = gloo_job(_audited, 2, tmp_path / "fits", str(tmp_path / "fits"), str(3 * WHOLE))
    assert fits == [{"error": "", "trace": True}] * 2


def test_audit_bytes_of_a_ddp_job_are_none(monkeypatch):
    """A DDP job's audits recompute on its own module: nothing more to hold, nothing refused."""
    monkeypatch.setenv(AUDIT_BUDGET_ENV, "1")
    params = list(torch.nn.Linear(4, 3).parameters())
    assert sharded_audit_bytes(params) == 0
    assert audit_refusal(RecorderOptions(audit_every=2), params, torch.device("cpu")) is None
