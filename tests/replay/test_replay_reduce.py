"""The replay's reduction, computed slice by slice into reused buffers, against whole-buffer
arithmetic written out here (DDP's ``* (1 / W)`` per rank, then the sum in order)."""

from __future__ import annotations

import pytest
import torch

from sdc_forensics.replay import env as env


def _ranks(world_size: int, numel: int, dtype: torch.dtype, seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(numel, generator=gen) * 2.0 ** torch.randint(-8, 9, (numel,), generator=gen)).to(dtype)]
        for _ in range(world_size)
    ]


def _sequential_by_hand(ranks: list[list[torch.Tensor]]) -> torch.Tensor:
    parts = [r[0] * (1.0 / len(ranks)) for r in ranks]
    acc = parts[0].clone()
    for part in parts[1:]:
        acc = acc + part
    return acc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [1, 65_535, 65_537, 200_003])
def test_sequential_reduction_is_whole_buffer_arithmetic(dtype, numel):
    ranks = _ranks(3, numel, dtype, seed=numel)
    [got] = env.reduce_buckets(ranks, "sequential")
    want = _sequential_by_hand(ranks)
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_ring_reduction_segment_by_hand_past_one_slice():
    """W = 2, 300,001 elements: gloo's 4 segments of 75,001, chunk 0 (elements 0..150,001) summed
    from rank 1, chunk 1 from rank 0; each chunk spans several of the reduction's slices."""
    ranks = _ranks(2, 300_001, torch.float32, seed=7)
    [ring] = env.reduce_buckets(ranks, "gloo-ring")
    a, b = (r[0] * 0.5 for r in ranks)
    assert torch.equal(ring[:150_002], b[:150_002] + a[:150_002])
    assert torch.equal(ring[150_002:], a[150_002:] + b[150_002:])


def test_out_buffers_are_written_and_reused():
    ranks = _ranks(4, 70_000, torch.float32, seed=3)
    out = [torch.full((70_000,), float("nan"))]
    [got] = env.reduce_buckets(ranks, "gloo-ring", out=out)
    assert got.data_ptr() == out[0].data_ptr()
    assert torch.equal(got, env.reduce_buckets(ranks, "gloo-ring")[0])
    again = _ranks(4, 70_000, torch.float32, seed=4)
    [second] = env.reduce_buckets(again, "gloo-ring", out=out)
    assert torch.equal(second, env.reduce_buckets(again, "gloo-ring")[0])


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="unknown reduction order"):
        env.reduce_buckets(_ranks(2, 10, torch.float32, seed=1), "tree")
