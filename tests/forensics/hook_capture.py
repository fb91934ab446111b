"""A gloo rank that saves what a DDP comm hook of torch's was handed and what it returned, bucket by
bucket (``r{rank}-b{bucket}.pt``: ``local``, ``reduced``), for tests that hold the replay's
reduction to the real hook bit for bit (``test_compress_hooks.py``, ``test_dividing_hooks.py``).
Run with ``sdc_forensics.demo.forked.start(capture, (world_size, port, out_dir, hook_name, ordered), world_size)``."""

from __future__ import annotations

import torch


def sum_then_divide_hook(state, bucket):
    """A hook as DDP comm-hook tutorials write it: all-reduce the bucket with ``SUM``, then divide
    the sum by ``W`` in its future (not each rank's part before the sum, as torch's hooks do)."""
    import torch.distributed as dist

    world = dist.get_world_size(state)
    fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def sum_then_scale_hook(state, bucket):
    """The same, the sum multiplied by ``1/W`` (``x * (1/3)`` and ``x / 3`` differ in the last bit)."""
    import torch.distributed as dist

    world = dist.get_world_size(state)
    fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].mul_(1.0 / world))


def capture(rank: int, world_size: int, port: int, out_dir: str, hook_name: str, ordered: bool = False) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from sdc_forensics.recorder import ordered as ordered_reduction

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(33, 9000), nn.Tanh(), nn.Linear(9000, 5))
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
        mine = {"sum_then_divide_hook": sum_then_divide_hook, "sum_then_scale_hook": sum_then_scale_hook}
        inner = mine[hook_name] if hook_name in mine else getattr(default_hooks, hook_name)
        # what the recorder registers for the job's hook (recorder/ddp_layout.communicating_hook)
        inner = ordered_reduction.compose(inner) if ordered else inner
        saved = {}

        def hook(state, bucket):
            index, local = bucket.index(), bucket.buffer().clone()

            def keep(fut):
                value = fut.value()
                value = value[0] if isinstance(value, (list, tuple)) else value
                saved[index] = (local, value.clone())
                return value

            return inner(state, bucket).then(keep)

        ddp.register_comm_hook(None, hook)
        gen = torch.Generator().manual_seed(100 + rank)
        ddp(torch.randn(16, 33, generator=gen)).square().mean().backward()  # DDP rebuilds its buckets after step 1
        model.zero_grad()
        saved.clear()
        ddp(torch.randn(16, 33, generator=gen)).square().mean().backward()
        for index, (local, reduced) in saved.items():
            torch.save({"local": local, "reduced": reduced}, f"{out_dir}/r{rank}-b{index}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
