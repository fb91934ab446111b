"""``RecorderOptions(deferred_checks=True)`` on a sharded job: nothing the recorder does blocks the step.

A real gloo HSDP 2 x 2 job (4 processes; ``fully_shard``-ed Linear/LayerNorm/GELU/Linear, AdamW
with clipping that engages, a DCP checkpoint in the middle) is recorded twice, at once (the
default) and deferred, with faults at the sharded collectives: one rank's reduce-scatter output,
then one rank's replica all-reduce output (after which its shard's two replicas differ, which
the weights vote and the gathered parameters' vote see every step). Every collective the recorder calls inside a
step is counted, by whether it blocks. Deferred, none blocks (the words, the reduce-scatter
check's table and the vote are launched in the background and resolved when the next step
begins); the traces are the same record for record (every field but the time and the checksum
that covers it), the alarms at the same steps; under policy ``raise`` the same alarm is raised,
one step later in the loop.
"""

from __future__ import annotations

import contextlib
import sys

import pytest

from tests.factories import gloo_job, records_by_rank

WORLD = 4
STEPS = 6
FAULTS = ("reduce-scatter-output:step=1:rank=1:bit=29", "all-reduce-output:step=3:rank=2:bit=29")
NAMES = ("all_gather", "all_reduce", "all_gather_object", "broadcast", "barrier")


def _job(rank: int, root: str, deferred: bool, policy: str, faults: tuple[str, ...]) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.demo.sharded import dcp_state
    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder import Recorder, RecorderOptions

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 48), torch.nn.LayerNorm(48), torch.nn.GELU(), torch.nn.Linear(48, 5)
    )
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    options = RecorderOptions(policy=policy, deferred_checks=deferred)
    rec = Recorder(f"{root}/trace", model, optimizer, options=options, inject=faults)
    # (step in the loop, blocks) of every collective the recorder calls
    calls: list[tuple[int | None, bool]] = []
    where: dict[str, int | None] = {"step": None}
    real = {name: getattr(dist, name) for name in NAMES}

    def counting(name):
        def call(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("sdc_forensics"):
                calls.append((where["step"], not kwargs.get("async_op", False)))
            return real[name](*args, **kwargs)

        return call

    for name in NAMES:
        setattr(dist, name, counting(name))
    raised = None
    try:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 5, (16,), generator=gen)
            at = "step"
            try:
                with rec.step(step, microbatch_ids=[step * WORLD + rank]) as handle:
                    where["step"] = step
                    loss = torch.nn.functional.cross_entropy(model(handle.input((x, y))[0]), y)
                    handle.loss(loss)
                    loss.backward()
                    # engages: the gradients' norm is above it from the first step
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                    optimizer.step()
                    optimizer.zero_grad()
                    where["step"] = None
                at = "checkpoint"
                if step == 2:
                    rec.checkpoint(3, f"{root}/ckpt", dcp_state(model, optimizer))
            except SdcAlarm as alarm:
                raised = {
                    "loop_step": step,
                    "at": at,
                    "step": alarm.step,
                    "rank": alarm.rank,
                    "check": str(alarm.check),
                }
                break
    finally:
        for name in NAMES:
            setattr(dist, name, real[name])
        with contextlib.suppress(SdcAlarm):
            rec.close(on_error=raised is not None)
    return {"calls": calls, "raised": raised}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = {}
    for deferred in (False, True):
        root = tmp_path_factory.mktemp(f"sharded-deferred-{deferred}")
        found[deferred] = (root, gloo_job(_job, WORLD, root / "out", str(root), deferred, "continue", FAULTS))
    return found


@pytest.mark.heavy
def test_deferred_sharded_trace_is_the_same_record_for_record(runs):
    from sdc_forensics.trace import format as F

    at_once, deferred = (
        records_by_rank(runs[False][0] / "trace", WORLD),
        records_by_rank(runs[True][0] / "trace", WORLD),
    )
    assert at_once == deferred
    alarms = {(r["step"], r["aux_rank"]) for r in at_once[0] if r["kind"] == int(F.Kind.ALARM)}
    # the checks fired, so that the comparison above compares something: the reduce-scatter
    # output at step 1 (rank 1), the replica all-reduce output at 3 (rank 2); then the replicas'
    # votes (which detect without naming: -1) at 3, 4 and 5
    assert {(1, 1), (3, 2), (3, -1), (4, -1), (5, -1)} <= alarms, alarms
    assert sum(r["kind"] == int(F.Kind.CHECKPOINT) for r in at_once[0]) == 1
    assert [r["step"] for r in deferred[0] if r["kind"] == int(F.Kind.STEP)] == list(range(STEPS))


@pytest.mark.heavy
def test_nothing_the_recorder_calls_blocks_inside_a_deferred_sharded_step(runs):
    for deferred, (_, results) in runs.items():
        for result in results:
            in_steps = [(step, blocks) for step, blocks in result["calls"] if step is not None]
            blocking = [step for step, blocks in in_steps if blocks]
            # at once: the words gather and the replicas' vote block in every step, and every
            # rank's place is gathered once (step 0); deferred, that once is when step 1 begins
            assert len(blocking) == (0 if deferred else 2 * STEPS + 1), (deferred, blocking)
            # the words, the table, the vote: launched in every step
            background = [step for step, blocks in in_steps if not blocks]
            assert len(background) == (3 * STEPS if deferred else STEPS), (deferred, background)


@pytest.mark.heavy
def test_policy_raise_raises_the_same_sharded_alarm_at_the_next_step(tmp_path):
    raised = {}
    for deferred in (False, True):
        root = tmp_path / f"raise-{deferred}"
        results = gloo_job(
            _job, WORLD, root / "out", str(root), deferred, "raise", ("all-reduce-output:step=3:rank=2:bit=29",)
        )
        raised[deferred] = [r["raised"] for r in results]
    for at_once, later in zip(raised[False], raised[True]):
        assert at_once is not None and later is not None
        assert (at_once["step"], at_once["rank"], at_once["check"]) == (later["step"], later["rank"], later["check"])
        assert (at_once["step"], at_once["rank"]) == (3, 2)
        assert (at_once["loop_step"], at_once["at"]) == (3, "step")
        assert (later["loop_step"], later["at"]) == (4, "step")
