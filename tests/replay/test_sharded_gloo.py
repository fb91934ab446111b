"""``replay/env.ring_sum``: gloo's reduce-scatter is its ring all-reduce of the whole input buffer,
sliced, and its ``AVG`` divides the sum afterwards; the replay of a sharded job on gloo rebuilds it
bit for bit (3 gloo processes, float32 and bfloat16, sizes across gloo's segment boundary)."""

from __future__ import annotations

import pytest
import torch

from sdc_forensics.replay import env
from tests.factories import gloo_job

WORLD = 3
SIZES = (1_000, 300_001)  # per rank: one segment each, then several 1 MiB segments


def _reduce_scatter(rank: int, dtype_name: str) -> list[str]:
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    out = []
    for n in SIZES:
        x = torch.randn(WORLD * n, generator=torch.Generator().manual_seed(100 * rank + n)).to(dtype)
        received = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(received, x.clone(), op=dist.ReduceOp.AVG)
        out.append(received.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy().tobytes().hex())
    return out


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gloos_reduce_scatter_is_its_ring_sum_sliced_then_divided(tmp_path, dtype_name):
    dtype = getattr(torch, dtype_name)
    received = gloo_job(_reduce_scatter, WORLD, tmp_path, dtype_name)
    for s, n in enumerate(SIZES):
        inputs = [
            torch.randn(WORLD * n, generator=torch.Generator().manual_seed(100 * r + n)).to(dtype) for r in range(WORLD)
        ]
        mean = env.ring_sum(inputs) / WORLD
        for rank in range(WORLD):
            mine = mean[rank * n : (rank + 1) * n]
            assert (
                mine.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy().tobytes().hex()
                == received[rank][s]
            )
        sequential = (inputs[0] + inputs[1] + inputs[2]) / WORLD  # the order matters: this is not it
        assert not torch.equal(sequential, mean)
