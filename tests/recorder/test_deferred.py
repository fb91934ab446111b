"""``RecorderOptions(deferred_checks=True)``: the recorder's own gathers leave the step's path.

Real gloo DDP runs on 3 processes, with faults at three locations (a local gradient, one rank's
reduced gradient, one rank's update) and a checkpoint in the middle, recorded twice: at once
(the default) and deferred. Every ``torch.distributed.all_gather`` call is counted, by whether
it blocks, inside each step. Deferred, none blocks inside a step (two are launched in the
background: the words and the vote); at once, both block. The traces are the same record for
record (every field but the time and the checksum that covers it), the alarms at the same steps;
under policy ``raise`` the same alarm is raised, one step later in the loop.
"""

from __future__ import annotations

import contextlib

import pytest

from sdc_forensics.trace import format as F
from tests.factories import gloo_job, records_by_rank

WORLD = 3
STEPS = 6
FAULTS = ("grad:step=1:rank=1:bit=30", "allreduce:step=3:rank=2:bit=29", "update:step=4:rank=0:bit=30")


def _job(rank: int, root: str, deferred: bool, policy: str, faults: tuple[str, ...]) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder import Recorder, RecorderOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    options = RecorderOptions(policy=policy, deferred_checks=deferred)
    rec = Recorder(f"{root}/trace", ddp, optimizer, options=options, inject=faults)
    # (step in the loop, blocks) of every all_gather
    gathers: list[tuple[int | None, bool]] = []
    real = dist.all_gather
    where: dict[str, int | None] = {"step": None}

    def counting(*args, **kwargs):
        gathers.append((where["step"], not kwargs.get("async_op", False)))
        return real(*args, **kwargs)

    dist.all_gather = counting
    raised = None
    try:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
            at = "step"
            try:
                with rec.step(step, microbatch_ids=[step * WORLD + rank]) as handle:
                    where["step"] = step
                    loss = torch.nn.functional.cross_entropy(ddp(handle.input((x, y))[0]), y)
                    handle.loss(loss)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    where["step"] = None
                at = "checkpoint"
                if step == 2:
                    rec.checkpoint(3, f"{root}/ckpt-{rank}.pt", {"model": model.state_dict()})
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
        dist.all_gather = real
        with contextlib.suppress(SdcAlarm):
            rec.close(on_error=raised is not None)
    return {"gathers": gathers, "raised": raised}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = {}
    for deferred in (False, True):
        root = tmp_path_factory.mktemp(f"deferred-{deferred}")
        found[deferred] = (root, gloo_job(_job, WORLD, root / "out", str(root), deferred, "continue", FAULTS))
    return found


@pytest.mark.heavy
def test_deferred_trace_is_the_same_record_for_record(runs):
    at_once, deferred = (
        records_by_rank(runs[False][0] / "trace", WORLD),
        records_by_rank(runs[True][0] / "trace", WORLD),
    )
    assert at_once == deferred
    alarms = {(r["step"], r["flags"]) for r in at_once[0] if r["kind"] == int(F.Kind.ALARM)}
    # the checks fired (so that the comparison above compares something): the reduced gradient at
    # step 3, the weights at 3 and 4; the local gradient's flip at step 1 is a finite value that
    # only a replay sees, in the records compared above
    assert {step for step, _ in alarms} >= {3, 4}
    assert sum(r["kind"] == int(F.Kind.CHECKPOINT) for r in at_once[0]) == 1
    assert [r["step"] for r in deferred[0] if r["kind"] == int(F.Kind.STEP)] == list(range(STEPS))


@pytest.mark.heavy
def test_no_gather_blocks_inside_a_deferred_step(runs):
    for deferred, (_, results) in runs.items():
        for result in results:
            in_steps = [(step, blocks) for step, blocks in result["gathers"] if step is not None]
            for step in range(STEPS):
                blocking = sum(blocks for s, blocks in in_steps if s == step)
                background = sum(not blocks for s, blocks in in_steps if s == step)
                # the words before the update, the weights vote after it (weights_every=1)
                assert (blocking, background) == ((0, 2) if deferred else (2, 0)), (deferred, step)


@pytest.mark.heavy
@pytest.mark.parametrize("fault_step", [2, 3])
def test_policy_raise_raises_the_same_alarm_at_the_next_step_or_checkpoint(tmp_path, fault_step):
    """The alarm of step 3 comes from step 4's ``begin_step``; that of step 2 from the checkpoint
    written after it, which is then not written (the vote before a checkpoint is synchronous)."""
    fault = (f"allreduce:step={fault_step}:rank=1:bit=29",)
    raised = {}
    for deferred in (False, True):
        root = tmp_path / f"raise-{deferred}"
        results = gloo_job(_job, WORLD, root / "out", str(root), deferred, "raise", fault)
        raised[deferred] = [r["raised"] for r in results]
    for at_once, later in zip(raised[False], raised[True]):
        assert at_once is not None and later is not None
        assert (at_once["step"], at_once["rank"], at_once["check"]) == (later["step"], later["rank"], later["check"])
        assert (at_once["loop_step"], at_once["at"]) == (fault_step, "step")
        expected = (2, "checkpoint") if fault_step == 2 else (fault_step + 1, "step")
        assert (later["loop_step"], later["at"]) == expected
    if fault_step == 2:
        assert not list((tmp_path / "raise-True").glob("ckpt-*.pt"))
