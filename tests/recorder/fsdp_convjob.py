"""A user's own FSDP2 job (not the demo's): a conv net with BatchNorm, ReLU, SGD with momentum, its
own recipe that loads DCP checkpoints, recorded with the ordered reduce-scatter
(tests/recorder/test_fsdp_recorder.py). ``job`` is one rank of it inside a gloo process group."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def build(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )


def batch(microbatch_id: int):
    gen = torch.Generator().manual_seed(77 + microbatch_id)
    return torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)


def loss_fn(model: nn.Module, microbatch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(microbatch[0]), microbatch[1])


class Recipe:
    def build(self, device="cpu"):
        model = build().to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), None

    def load_checkpoint(self, path, model, optimizer, scheduler):
        from sdc_forensics.demo.sharded import load_dcp

        load_dcp(path, model, optimizer)

    def fetch_microbatch(self, microbatch_id, device="cpu"):
        return batch(int(microbatch_id))

    def loss(self, model, microbatch):
        return loss_fn(model, microbatch)


recipe = Recipe()


def job(rank: int, root: str) -> str:
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.demo.sharded import dcp_state
    from sdc_forensics.recorder import Recorder, RecorderOptions

    model = build()
    fully_shard(model[0])
    fully_shard(model[3])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = RecorderOptions(policy="continue", reduction="ordered")
    with Recorder(
        Path(root, "trace"), model, optimizer, recipe="tests.recorder.fsdp_convjob:recipe", options=options
    ) as rec:
        for step in range(5):
            if step % 2 == 0:
                rec.checkpoint(step, Path(root, "ckpt", f"step-{step}"), dcp_state(model, optimizer))
            ids = [step * 4 + rank]
            with rec.step(step, microbatch_ids=ids) as handle:
                loss = loss_fn(model, handle.input(batch(ids[0])))
                handle.loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    return "ok"
