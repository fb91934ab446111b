"""What the DeepSpeed layout refuses at attach, checked on a stand-in engine (no DeepSpeed needed).

Trial users' DeepSpeed jobs found two settings that were recorded and then answered wrongly:
``RecorderOptions(reduction='ordered')`` (never applied to ZeRO's own reductions, yet written into
the manifest, so the replay summed in that order: "corruption in the collective" on a clean 4-rank
ZeRO 2 run) and two optimizer parameter groups (the first checkpoint crashed under ZeRO 1 and 2,
and under ZeRO 3 the checkpoint held one group, the no-decay group's settings lost).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from sdc_forensics.recorder.deepspeed_layout import DeepSpeedLayout, engine_refusal
from sdc_forensics.recorder.options import RecorderOptions


class _Engine:
    """The engine methods ``engine_refusal`` reads, as a clean fp32 ZeRO 2 job answers them."""

    dp_world_size = 1

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = types.SimpleNamespace(optimizer=optimizer)

    def fp16_enabled(self):
        return False

    bfloat16_enabled = fp16_enabled
    zero_cpu_offload = fp16_enabled

    def managed_gradient_accumulation(self):
        return True

    def gradient_accumulation_steps(self):
        return 1

    def zero_optimization_stage(self):
        return 2

    def gradient_clipping(self):
        return 0.0


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_one_group_engine_passes_and_two_groups_are_refused_in_one_line(one_rank):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    assert engine_refusal(_Engine(torch.optim.AdamW(model.parameters()))) is None
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    grouped = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    why = engine_refusal(_Engine(grouped))
    assert why is not None and "2 optimizer parameter groups" in why and "\n" not in why


def test_the_ordered_reduction_is_refused_not_written_into_the_manifest(one_rank):
    model = torch.nn.Linear(2, 2)
    layout = DeepSpeedLayout(_Engine(torch.optim.AdamW(model.parameters())))
    job = types.SimpleNamespace(options=RecorderOptions(reduction="ordered"))
    assert "reduction='ordered') is not applied" in layout.validate(job)
    assert layout.validate(types.SimpleNamespace(options=RecorderOptions())) is None
