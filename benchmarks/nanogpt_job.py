"""A nanoGPT-shaped training job for the recorder's cost (``bench_overhead.py --model gpt``).

The model is nanoGPT's (Karpathy, ``model.py``) in shape: token and position embeddings, ``L``
pre-norm blocks of causal multi-head self-attention and a 4x GELU MLP, a final LayerNorm and a
head tied to the token embedding. The step is nanoGPT's too: ``MICROBATCHES`` microbatches
accumulated (DDP's ``no_sync`` / FSDP2's ``set_requires_gradient_sync(False)`` on all but the
last), ``clip_grad_norm_(1.0)``, AdamW with nanoGPT's two parameter groups (weight decay on
matrices only), ``zero_grad(set_to_none=True)``. Data is synthetic: microbatch ``i`` is drawn
from a generator seeded with ``i``.

Shapes (``SHAPES``, name: layers x width): parameters with a 256-token vocabulary and a 64-token
context, ``12 L d^2 + 13 L d + (256 + 64) d + 2 d`` (attention 4 d^2, MLP 8 d^2, their biases
and LayerNorms).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

VOCAB, CONTEXT, HEAD_DIM = 256, 64, 32
MICROBATCHES = 2
#: name: (layers, width); "2x64" the smallest, "3x256" about 2.4 M parameters
SHAPES = {"2x64": (2, 64), "4x128": (4, 128), "3x256": (3, 256)}


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head attention, then a 4x GELU MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = max(1, width // HEAD_DIM)
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    # (B, T, d) -> (B, T, d)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=2)
        # (B, heads, T, head_dim)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's shape, ``layers`` blocks ``width`` wide, the head tied to the token embedding."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, width), nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    # (B, T) -> (B, T, VOCAB)
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def parameters_of(layers: int, width: int) -> int:
    """Parameters of :class:`TinyGPT` (the tied head counted once)."""
    return 12 * layers * width * width + 13 * layers * width + (VOCAB + CONTEXT) * width + 2 * width


class GptRecipe:
    """The job as a replay recipe (build, fetch a microbatch by ID, loss, clipping)."""

    def __init__(self, layers: int = 2, width: int = 64, rows: int = 8) -> None:
        self.layers, self.width, self.rows = layers, width, rows

    def build(self, device="cpu"):
        torch.manual_seed(0)
        model = TinyGPT(self.layers, self.width).to(device)
        return model, make_optimizer(model), None

    def fetch_microbatch(self, microbatch_id, device="cpu"):
        gen = torch.Generator().manual_seed(int(microbatch_id))
        ids = torch.randint(VOCAB, (self.rows, CONTEXT + 1), generator=gen)
        return ids[:, :-1].to(device), ids[:, 1:].to(device)

    def loss(self, model, microbatch):
        inputs, targets = microbatch
        logits = model(inputs)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) / MICROBATCHES

    def before_step(self, model, optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    def load_checkpoint(self, path, model, optimizer, scheduler):
        raise NotImplementedError("the benchmark never resumes")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's AdamW: weight decay on matrices (the tied embedding included), none on the rest."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95))


def shard(model: TinyGPT, mesh) -> TinyGPT:
    """FSDP2 as torchtitan wraps a transformer: each block its own group, then the root (which
    keeps the tied embedding and head, one parameter)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model, optimizer, recipe: GptRecipe, batches, sharded: bool, handle=None) -> None:
    """One optimizer step of the job: accumulate, clip, AdamW, zero the gradients."""
    last = len(batches) - 1
    for i, batch in enumerate(batches):
        if handle is not None:
            batch = handle.input(batch)
        if sharded:
            model.set_requires_gradient_sync(i == last)
            context = contextlib.nullcontext()
        else:
            context = model.no_sync() if i < last else contextlib.nullcontext()
        with context:
            loss = recipe.loss(model, batch)
            loss.backward()
        if handle is not None:
            handle.loss(loss)
    recipe.before_step(model, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def flops_per_token(layers: int, width: int) -> float:
    """Training FLOPs per token (nanoGPT's estimate: 6 N + 12 L d T)."""
    return 6 * parameters_of(layers, width) + 12 * layers * width * CONTEXT
