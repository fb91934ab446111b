"""The nanoGPT-shaped job of ``nanogpt_job.py`` parallelised as torchtitan does: TP (with sequence
parallel) on ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]`` (``bench_overhead.py --model gpt
--parallel tp``).

The same shapes, data, loss, clipping, optimizer and step as ``nanogpt_job.py``, with the two
changes tensor parallelism needs (torchtitan's Llama makes them too): the attention's query, key
and value are three linear layers (TP cuts each by heads; a fused ``c_attn`` would be cut across
q, k and v), and the head is not tied to the token embedding (TP cuts the embedding by rows of
the vocabulary and the head by its output columns: one tensor cannot be both). So the model has
``L d^2`` (q/k/v biases aside, the same) plus ``256 d`` parameters more than the tied one. The
plan is ``demo/tp.py``'s, block by block; the position embedding is row-parallel too, its output
cut along the sequence like the token embedding's.
"""

from __future__ import annotations

import torch
from torch import nn

from nanogpt_job import CONTEXT, HEAD_DIM, VOCAB


class TpAttention(nn.Module):
    """Causal multi-head self-attention with q, k and v apart (TP: a rank computes its heads on the whole sequence)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.proj = nn.Linear(width, width)

    # (B, T, d) -> (B, T, d)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[0], x.shape[1]
        # (B, heads here, T, head_dim)
        q, k, v = (t.view(batch, length, -1, HEAD_DIM).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


class TpBlock(nn.Module):
    """nanoGPT's pre-norm block: :class:`TpAttention`, then a 4x GELU MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = TpAttention(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    # (B, T, d) -> (B, T, d), or a sequence shard of each under sequence parallel
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.down(nn.functional.gelu(self.up(self.ln_2(x))))


class TpGPT(nn.Module):
    """``nanogpt_job.TinyGPT`` with :class:`TpBlock` blocks and an untied head."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(TpBlock(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)

    # (B, T) -> (B, T, VOCAB)
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(layers: int, width: int) -> TpGPT:
    """The model with nanoGPT's seed (``GptRecipe.build``'s)."""
    torch.manual_seed(0)
    return TpGPT(layers, width)


def parallelize(model: TpGPT, mesh) -> TpGPT:
    """TP with sequence parallel on ``mesh["tp"]`` (demo/tp.py's plan per block), then FSDP2 over
    ``mesh["dp"]``: each block its own group, then the root (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # (T, d): the sequence is its dim 0
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.ln_1": SequenceParallel(),
            f"blocks.{i}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"blocks.{i}.attn.q": ColwiseParallel(),
            f"blocks.{i}.attn.k": ColwiseParallel(),
            f"blocks.{i}.attn.v": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.ln_2": SequenceParallel(),
            f"blocks.{i}.up": ColwiseParallel(input_layouts=Shard(1)),
            f"blocks.{i}.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
