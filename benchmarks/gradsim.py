"""Synthetic DDP gradients and an all-reduce simulated in the gradient dtype (torch, CPU).

Shared by ``calibrate_sketch.py``, ``bitflip_table.py`` and ``tests/fingerprint`` so that the
tolerance is calibrated and tested against one model of what a real collective does:

* :func:`rank_gradients`: ``W`` gradient-like tensors. Magnitudes are heavy tailed the way real
  gradients are: the vector is cut into "parameter tensors" of random length whose scales are
  log-normal (orders of magnitude apart, like embeddings vs. layer norms), and inside each the
  values are Student-t (df=3). Ranks share a common component (the true gradient) plus their
  own noise (the minibatch); ``correlation`` sets the share, from independent (0) through
  typical (~0.5) to identical (1), and negative values make the ranks cancel.
* :func:`ring_allreduce`: NCCL/gloo-style ring reduce-scatter: the tensor is split into ``W``
  chunks and chunk ``c`` is accumulated rank after rank starting at rank ``c + 1``, every
  addition rounded in the gradient dtype; then the sum is divided by ``W`` in that dtype
  (``post``), or each rank multiplies by ``1/W`` before the sum (``pre``: what DDP's default
  bucket copy does), or the sum is kept (``sum``).
"""

from __future__ import annotations

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
DIVISIONS = ("post", "pre", "sum")


def _segment_scales(numel: int, rng: np.random.Generator, sigma: float) -> np.ndarray:
    """Per-element scale: random-length segments (parameter tensors) with log-normal scales."""
    scales = np.empty(numel, dtype=np.float64)
    start = 0
    while start < numel:
        length = int(min(numel - start, max(64, rng.lognormal(np.log(numel / 20 + 1), 1.0))))
        scales[start : start + length] = rng.lognormal(0.0, sigma)
        start += length
    return scales


def rank_gradients(
    numel: int,
    world_size: int,
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    correlation: float = 0.5,
    sigma: float = 1.5,
    magnitude: float = 1e-3,
) -> list[torch.Tensor]:
    """``world_size`` local gradients of ``numel`` elements each, rounded to ``dtype``.

    Args:
        numel: elements per gradient.
        world_size: number of ranks ``W``.
        seed: seed of everything random here.
        dtype: gradient dtype (the values are drawn in float64 and rounded once).
        correlation: share of the common component, in ``[-1, 1]``; negative: the ranks'
            common components alternate in sign (partial cancellation in the sum).
        sigma: log-normal spread of the per-tensor scales (heavier tails when larger).
        magnitude: overall scale (gradients are small numbers).
    """
    rng = np.random.default_rng(seed)
    scales = magnitude * _segment_scales(numel, rng, sigma)  # (numel,)
    common = rng.standard_t(3, numel)
    weight = np.sqrt(abs(correlation))
    grads = []
    for rank in range(world_size):
        sign = -1.0 if correlation < 0 and rank % 2 else 1.0
        values = sign * weight * common + np.sqrt(1.0 - weight**2) * rng.standard_t(3, numel)
        grads.append(torch.from_numpy(values * scales).to(dtype))
    return grads


def ring_allreduce(grads: list[torch.Tensor], *, division: str = "post", rotation: int = 0) -> torch.Tensor:
    """All-reduce of the ranks' gradients with every operation rounded in their dtype.

    Args:
        grads: ``W`` equally shaped 1-D tensors of one dtype.
        division: ``post`` (sum, then divide by ``W``), ``pre`` (multiply by ``1/W`` first, as
            DDP does when copying into buckets) or ``sum`` (no division).
        rotation: shifts which rank starts each chunk's ring (another valid summation order).

    Returns:
        The reduced tensor in the gradient dtype.
    """
    if division not in DIVISIONS:
        raise ValueError(f"division must be one of {DIVISIONS}, got {division!r}")
    world_size = len(grads)
    if division == "pre":
        inverse = torch.tensor(1.0 / world_size, dtype=torch.float32)
        grads = [
            (g.to(torch.float32) * inverse).to(g.dtype) if g.dtype != torch.float64 else g / world_size for g in grads
        ]
    chunks = [torch.tensor_split(g, world_size) for g in grads]  # [rank][chunk]
    out = []
    for c in range(world_size):
        first = (c + 1 + rotation) % world_size
        acc = chunks[first][c].clone()
        for j in range(1, world_size):
            acc += chunks[(first + j) % world_size][c]  # rounded in the gradient dtype
        out.append(acc)
    reduced = torch.cat(out)
    if division == "post":
        reduced = reduced / world_size  # rounded in the gradient dtype
    return reduced


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of a 1-D float tensor with bit ``bit`` of element ``index`` flipped."""
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    out = tensor.clone()
    words = out.view(int_dtype)
    mask = torch.tensor(1, dtype=torch.int64).bitwise_left_shift(bit)
    if bit == 8 * tensor.element_size() - 1:  # the sign bit: the mask is the minimum value
        mask = torch.tensor(torch.iinfo(int_dtype).min, dtype=torch.int64)
    words[index] ^= mask.to(int_dtype)
    return out
