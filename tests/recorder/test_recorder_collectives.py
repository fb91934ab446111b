"""How many collectives the recorder itself issues per step (issue 37), counted on real gloo jobs.

Every ``torch.distributed`` collective called from a frame of ``sdc_forensics`` is counted, by
step: an FSDP2 job on 2 processes and an HSDP 2 x 2 job on 4 (``fully_shard``-ed
Linear/GELU/Linear, SGD, checks on every step). After the first step (which gathers each rank's
place once, pickled) a sharded step costs the recorder tensor collectives only: the recorder's
words gather (which carries the reduce-scatter check's call count), the check's table (one
``all_reduce`` over the world, from which every rank reads every rank's verdicts, HSDP's replica
all-reduce check included) and, where shards have replicas (HSDP), the weights vote. No
``all_gather_object`` (a pickle and two collectives) runs on a clean step. With
``deferred_checks`` every one of them is launched in the background: none blocks.
"""

from __future__ import annotations

import collections
import sys

import pytest

from tests.factories import gloo_job

STEPS = 4
NAMES = ("all_gather", "all_gather_object", "all_reduce", "broadcast", "barrier", "reduce_scatter", "all_to_all")


def _job(rank: int, root: str, hsdp: bool, deferred: bool) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.recorder import Recorder, RecorderOptions

    torch.manual_seed(0)
    world = dist.get_world_size()
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = Recorder(f"{root}/trace", model, optimizer, options=RecorderOptions(deferred_checks=deferred))
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    where: dict[str, int | None] = {"step": None}
    real = {name: getattr(dist, name) for name in NAMES}

    def counting(name):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if where["step"] is not None and caller.startswith("sdc_forensics"):
                counts[where["step"]][name] += 1
                counts[where["step"]]["blocking"] += not kwargs.get("async_op", False)
            return real[name](*args, **kwargs)

        return call

    for name in NAMES:
        setattr(dist, name, counting(name))
    try:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            where["step"] = step
            with rec.step(step, microbatch_ids=[step * world + rank]) as handle:
                loss = torch.nn.functional.cross_entropy(model(handle.input((x, y))[0]), y)
                handle.loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            where["step"] = None
    finally:
        for name in NAMES:
            setattr(dist, name, real[name])
        rec.close()
    return {"counts": {str(step): dict(counter) for step, counter in counts.items()}, "alarms": len(rec.alarms)}


@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp2x2"])
def test_a_clean_sharded_step_costs_the_recorder_tensor_collectives_only(tmp_path, hsdp, deferred):
    world = 4 if hsdp else 2
    found = gloo_job(_job, world, tmp_path / "out", str(tmp_path), hsdp, deferred)
    # HSDP: the vote of each shard's replicas (one all_gather more); pure FSDP2 holds each shard
    # once: nothing to vote (the monitor's call count travels in the recorder's words gather,
    # the replica all-reduce check in the one table)
    steady = {"all_gather": 2, "all_reduce": 1} if hsdp else {"all_gather": 1, "all_reduce": 1}
    # at once, the words gather and the vote block (the table's all-reduce is waited for, not blocking)
    steady["blocking"] = 0 if deferred else steady["all_gather"]
    for rank, result in enumerate(found):
        assert result["alarms"] == 0
        counts = result["counts"]
        # every rank's place is gathered once (an object), at the first check: deferred, when step 1 begins
        first = "1" if deferred else "0"
        assert counts[first].pop("all_gather_object") == 1, (rank, counts[first])
        assert counts[first].pop("blocking") == steady["blocking"] + 1, (rank, counts[first])
        counts[first]["blocking"] = steady["blocking"]
        for step in range(1, STEPS):
            seen = {name: n for name, n in counts[str(step)].items() if n}
            assert seen == {name: n for name, n in steady.items() if n}, (rank, step, seen)
