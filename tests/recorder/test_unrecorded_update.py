"""An optimizer step outside ``with recorder.step(...)`` (a loop that steps after the block) changes
the weights unrecorded: no step after it can be certified. Before, the recorder said nothing, the
trace held empty steps and a fault in them ended as an ``inconclusive`` bisect blaming "another
thread count or device". Now each rank says it once, on its first such update, naming the fix."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from sdc_forensics.recorder import Recorder


def _train(trace_dir, *, inside: bool, steps: int = 3) -> None:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Recorder(trace_dir, ddp, optimizer) as rec:
        for step in range(steps):
            with rec.step(step, microbatch_ids=[step]) as s:
                x = s.input(torch.randn(4, 6, generator=torch.Generator().manual_seed(step)))
                ddp(x).square().mean().backward()
                if inside:
                    optimizer.step()
            if not inside:
                optimizer.step()
            optimizer.zero_grad()


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "outside `with recorder.step" in r.getMessage()]


def test_an_update_outside_the_step_is_said_once_and_one_inside_never(tmp_path, caplog):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="sdc_forensics.recorder"):
            _train(tmp_path / "inside", inside=True)
        assert _said(caplog) == []
        with caplog.at_level(logging.WARNING, logger="sdc_forensics.recorder"):
            _train(tmp_path / "outside", inside=False)
    finally:
        dist.destroy_process_group()
    said = _said(caplog)
    assert len(said) == 1, said  # once per run, not once per step
    assert "rank 0" in said[0] and "optimizer.step() inside the step's block" in said[0]


def test_the_state_torch_s_get_state_dict_creates_is_no_update_of_the_job_s(tmp_path, caplog):
    """``get_state_dict(model, optimizer)`` of an optimizer with no state yet (checkpoint 0, saved as
    torch's FSDP2 examples do) runs ``optimizer.step()`` on zero gradients at learning rate 0 to create
    it; a new user's job was told no checkpoint could be certified."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        with caplog.at_level(logging.WARNING, logger="sdc_forensics.recorder"):
            with Recorder(tmp_path / "trace", model, optimizer) as rec:
                before = [p.detach().clone() for p in model.parameters()]
                _, optim_state = get_state_dict(model, optimizer)
                assert optim_state["state"]  # torch created the state with its hidden step
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # and moved no weight
                with rec.step(0, microbatch_ids=[0]):
                    model(torch.ones(4, 6)).square().mean().backward()
                    optimizer.step()
                optimizer.zero_grad()
                assert _said(caplog) == []
                optimizer.step()  # a real update outside the step is still said
    finally:
        dist.destroy_process_group()
    assert len(_said(caplog)) == 1


def test_inject_none_means_no_faults_in_the_recorder_and_the_adapters(tmp_path):
    """``inject=None`` (what users write for "no faults") crashed hf.record on every rank with a
    TypeError; the Recorder and the adapters take it as ``()``."""
    import pytest

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
        with Recorder(tmp_path / "trace", ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), inject=None) as rec:
            assert not rec.injector
    finally:
        dist.destroy_process_group()
    lightning = pytest.importorskip("lightning")
    assert lightning
    from sdc_forensics.integrations.lightning import SdcCallback

    assert SdcCallback(tmp_path / "pl", dataset="x:y", inject=None).inject == ()
