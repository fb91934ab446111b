"""A nanoGPT-style recorded job that ends as a user's script does, for ``exit_drill.py``.

Two pre-norm transformer blocks with a tied head, AdamW, ``clip_grad_norm_(1.0)``, a hand-set
warmup and cosine learning rate, 2 microbatches accumulated under ``no_sync``, a checkpoint every
4 steps (and after the last), then ``dist.barrier(); dist.destroy_process_group()`` and the
interpreter's teardown: no ``os._exit``. Run under ``torchrun --nproc-per-node 2``::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/exit_drill_job.py --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from sdc_forensics.recorder import Recorder, RecorderOptions

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 256, 32, 64, 4, 2
STEPS, WARMUP, LR, MIN_LR, MICROBATCHES = 12, 3, 3e-3, 3e-4, 2


def learning_rate(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    done = min((step - WARMUP) / max(1, STEPS - WARMUP), 1.0)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * done)) * (LR - MIN_LR)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).view(-1, VOCAB), targets.reshape(-1))


def batch(microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=torch.Generator().manual_seed(1000 + microbatch))
    return data[:, :-1], data[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    ddp = DistributedDataParallel(model)
    with Recorder(f"{args.out}/trace", ddp, optimizer, options=RecorderOptions(checkpoint_every=4)) as rec:

        def save(step: int) -> None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            rec.checkpoint(step, os.path.join(args.out, "ckpt", f"step-{step:08d}.pt"), state=state)

        save(0)
        for step in range(STEPS):
            ids = [(step * world + rank) * MICROBATCHES + i for i in range(MICROBATCHES)]
            with rec.step(step, microbatch_ids=ids) as s:
                for i, microbatch in enumerate(ids):
                    inputs = s.input(batch(microbatch))
                    with ddp.no_sync() if i < MICROBATCHES - 1 else contextlib.nullcontext():
                        loss = ddp(*inputs) / MICROBATCHES
                        loss.backward()
                    s.loss(loss)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if (step + 1) % 4 == 0:
                save(step + 1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
