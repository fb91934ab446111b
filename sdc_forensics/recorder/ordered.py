"""The ordered reduction: an all-reduce whose summation order any replay reproduces bit for bit.

A collective library chooses its own summation order (NCCL's ring or tree, its channel count,
NVLS; gloo's ring segments), so a replay that does not know it cannot reproduce the reduced
gradient's bits, and a GPU job can never be certified (docs/bisect.md). With
``RecorderOptions(reduction="ordered")`` the recorder's comm hook reduces every bucket so that
each element of the result is the ranks' contributions scaled by ``1/W`` and added strictly
left to right in rank order, in float32 for float16/bfloat16 buckets (the definition, as math,
is ``sdc_forensics/reduction.py``; the replay computes the same function, so it recomputes the
result exactly on any device without knowing the collective library).

The communication: the bucket (zero-padded to a multiple of ``W``) is cut into ``W`` chunks;
``all_to_all_single`` hands chunk ``j`` of every rank to rank ``j``, which sums its ``W`` copies in
the order above; ``all_gather`` returns every reduced chunk to every rank. The bytes moved are
those of a ring all-reduce (each rank sends and receives ``(W-1)/W`` of the bucket twice);
the cost is measured in ``benchmarks/bench_reduction.py`` (docs/benchmarks.md).

A job's own comm hook composes with it: while that hook runs, ``torch.distributed.all_reduce``
(``SUM`` or ``AVG``) is carried out by the ordered reduction, so a compression hook keeps its
compression and gains a known order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.reduction import ordered_mean, ordered_sum


def _ordered_all_reduce(tensor: torch.Tensor, group, average: bool) -> torch.Tensor:
    """All-reduce ``tensor`` in place with the ordered sum (mean when ``average``, else sum)."""
    world_size = dist.get_world_size(group)
    flat = tensor.view(-1)
    numel = flat.numel()
    chunk = -(-numel // world_size)
    send = flat.new_zeros(chunk * world_size)
    send[:numel] = flat
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # parts[r]: rank r's copy of this rank's chunk
    parts = list(recv.view(world_size, chunk))
    mine = ordered_mean(parts) if average else ordered_sum(parts)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    flat.copy_(torch.cat(gathered)[:numel])
    return tensor


def ordered_mean_hook(process_group, bucket):
    """A DDP comm hook: the bucket's mean over ranks by the ordered sum (see the module)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    _ordered_all_reduce(buffer, group, average=True)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


class _Done:
    """What ``dist.all_reduce`` returns, for work that is already complete."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result([tensor])

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the signature of Work.wait
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


_patch_lock = threading.Lock()


@contextlib.contextmanager
def _ordered_all_reduce_calls() -> Iterator[None]:
    """While active, ``torch.distributed.all_reduce`` with ``SUM``/``AVG`` is the ordered reduction."""
    original = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise UsageError(
                f"RecorderOptions(reduction='ordered') reduces SUM and AVG only; the comm hook asked for {op}: "
                "use reduction='native' with this hook"
            )
        _ordered_all_reduce(tensor, group if group is not None else dist.group.WORLD, average=op == dist.ReduceOp.AVG)
        return _Done(tensor) if async_op else None

    with _patch_lock:
        dist.all_reduce = all_reduce
        try:
            yield
        finally:
            dist.all_reduce = original


def compose(user_hook: Callable) -> Callable:
    """The job's own comm hook, with its ``dist.all_reduce`` calls carried out by the ordered reduction."""

    def hook(state: Any, bucket):
        with _ordered_all_reduce_calls():
            return user_hook(state, bucket)

    return hook
