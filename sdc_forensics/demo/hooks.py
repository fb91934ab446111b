"""Comm hooks for the demo and the tests: a collective whose summation order the replay does not know.

``reversed_mean`` all-reduces the bucket back to front (scaled by ``1/W`` first, as DDP's default
does, then gloo's ``SUM``), so element ``i`` is summed in the order gloo's ring gives position
``n - 1 - i``: a real collective, equal to DDP's mean within rounding, whose order none of the
replay's models (``gloo-ring``, ``sequential``) reproduces for ``W >= 3``. It stands in for NCCL,
whose ring and tree orders depend on the topology, the channel count and the algorithm chosen.
Referenced as ``sdc_forensics.demo.hooks:reversed_mean`` (``DemoConfig(comm_hook=...)``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reversed_mean(process_group, bucket):
    """DDP's mean all-reduce, with the buffer reversed while it travels."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    flipped = torch.flip(buffer, dims=(0,)).mul_(1.0 / dist.get_world_size(group))
    work = dist.all_reduce(flipped, group=group, async_op=True)

    def _back(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(torch.flip(fut.value()[0], dims=(0,)))
        return buffer

    return work.get_future().then(_back)
