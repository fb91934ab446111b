"""Whole checkpoint intervals shared out (issue 12): the pure parts, in one process. How intervals
are dealt, when dealing them beats sharing the ranks of each step, which intervals the backward
walk plans ahead (within ``--max-replay-steps``), and that the walk takes a result replayed ahead
instead of replaying it again, a checkpoint without the replicas' weights included. The runs
under ``torchrun`` are ``test_torchrun_cli.py``'s."""

from __future__ import annotations

import dataclasses

import pytest

from sdc_forensics.forensics.bisect import _intervals_below
from sdc_forensics.forensics.intervals import IntervalRunner as _WindowRunner
from sdc_forensics.forensics.intervals import _NotTheReplicas
from sdc_forensics.replay.distributed import StepCosts, deal, intervals_pay
from sdc_forensics.replay.options import BisectOptions
from sdc_forensics.replay.replayer import ReplayResult, StartStateMismatch
from sdc_forensics.trace.checkpoints import CheckpointNote


def test_deal_gives_the_costliest_first_to_the_least_loaded_process():
    assert deal([2, 2, 2, 2, 2, 2], 3) == [[0, 3], [1, 4], [2, 5]]
    assert deal([10, 1, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5, 6]]  # the long one alone
    assert deal([5, 4, 3, 3, 3], 2) == [[0, 3], [1, 2, 4]]  # loads 8 and 10
    assert deal([3], 4) == [[0], [], [], []]
    dealt = deal([7, 1, 9, 4, 4, 2, 8], 3)
    assert sorted(i for part in dealt for i in part) == list(range(7))  # every interval once


@pytest.mark.parametrize(("world_size", "three_pay"), [(4, True), (6, False), (1024, True)])
def test_equal_intervals_pay_only_against_uneven_rank_shares(world_size, three_pay):
    costs = StepCosts(rank=1.0, exchange=0.0, rest=0.0)
    # 2 intervals over 3 processes: one process replays all W ranks of an interval, while sharing
    # the ranks of each step computes ceil(W/3) per step: ranks win
    assert not intervals_pay([10, 10], world_size, 3, costs)
    # as many intervals as processes, rank compute alone: 10 steps x W ranks against 30 steps x
    # ceil(W/3) ranks; intervals win only where W does not divide evenly (4: 40 < 60, 1024: 10240 < 10260)
    assert intervals_pay([10] * 3, world_size, 3, costs) is three_pay


def test_the_exchange_and_the_unshared_work_make_intervals_pay():
    lengths = [10] * 6
    # with nothing but rank compute, 6 intervals over 3 processes: 20 steps x 6 ranks = 120 against 60 x 2 = 120: a tie, ranks kept
    assert not intervals_pay(lengths, 6, 3, StepCosts(rank=1.0, exchange=0.0, rest=0.0))
    # the per-step average, optimizer step and comparisons are done by every process when ranks are shared
    assert intervals_pay(lengths, 6, 3, StepCosts(rank=1.0, exchange=0.0, rest=0.5))
    # so is the exchange of every rank's gradient
    assert intervals_pay(lengths, 6, 3, StepCosts(rank=1.0, exchange=0.5, rest=0.0))
    assert not intervals_pay(lengths, 6, 1, StepCosts(rank=1.0, exchange=0.5, rest=0.5))  # one process: nothing to deal
    assert not intervals_pay([10], 6, 3, StepCosts(rank=1.0, exchange=0.5, rest=0.5))  # one interval


def _note(step: int) -> CheckpointNote:
    return CheckpointNote(step=step, path=f"step-{step}.pt")


def test_the_plan_is_the_backward_walk_within_the_step_budget():
    starts = [_note(s) for s in (0, 2, 4, 6, 8)]
    plan = _intervals_below(starts, starts[3], None)
    assert [(n.step, hi) for n, hi in plan] == [(4, 5), (2, 3), (0, 1)]
    assert [(n.step, hi) for n, hi in _intervals_below(starts, starts[3], 3)] == [(4, 5), (2, 3)]  # 2 + 2 >= 3
    assert _intervals_below(starts, starts[3], 0) == []
    assert _intervals_below(starts, starts[0], None) == []
    # the walk stops below the trace's first step: a checkpoint before it is not planned
    assert [(n.step, hi) for n, hi in _intervals_below(starts, starts[3], None, first_step=3)] == [(4, 5), (2, 3)]


class _Trace:
    world_size = 4


def _result(start: int, last: int, device: str = "cpu (elsewhere)") -> ReplayResult:
    return ReplayResult(
        start_step=start,
        stop_step=last,
        last_step=last,
        device=device,
        comparison="exact",
        tolerant_from=None,
        reduction_order="gloo-ring",
        evidence=(),
        first_divergent_step=None,
        settings={"num_threads": 1},
    )


def test_the_walk_takes_a_result_replayed_ahead_and_never_replays_it(monkeypatch):
    runner = _WindowRunner(_Trace(), None, BisectOptions(), None, {})
    runner.order, runner.device = "gloo-ring", "cpu (here)"
    runner.done[(2, 3, None, True, "gloo-ring")] = _result(2, 3)
    runner.done[(0, 1, None, True, "gloo-ring")] = _NotTheReplicas(message="no", expected="aa", found="bb")

    def replay_here(*args, **kwargs):
        raise AssertionError("replayed again")

    monkeypatch.setattr(_WindowRunner, "_replay_window", replay_here)
    result = runner.replay(_note(2), 3, "widen")
    assert dataclasses.replace(result, device="x") == dataclasses.replace(_result(2, 3), device="x")
    assert result.device == "cpu (here)"  # named by this process's own device, as a window it replayed
    assert runner.replayed == {2, 3} and [w.start for w in runner.windows] == [2]
    assert runner.replay(_note(0), 1, "widen") is None  # not the replicas' weights: the walk goes on to the one before
    assert "checkpoint 0 does not hold the replicas' weights (bb != aa)" in runner.notes[0]
    # another reduction order than the one replayed ahead is not the same replay
    runner.order = "sequential"
    with pytest.raises(AssertionError, match="replayed again"):
        runner.replay(_note(2), 3, "widen")


def test_a_runner_replaying_alone_records_what_it_replayed(monkeypatch):
    runner = _WindowRunner(_Trace(), None, BisectOptions(), None, {})
    runner.record = {}
    calls = iter([_result(4, 5, "cpu"), StartStateMismatch("m", step=2, expected="aa", found="bb")])

    def replay_here(self, note, hi, threads, stop_at_divergence):
        outcome = next(calls)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(_WindowRunner, "_replay_window", replay_here)
    runner.replay(_note(4), 5, "")
    assert runner.replay(_note(2), 3, "") is None
    assert runner.record[(4, 5, None, True, "")].last_step == 5
    assert runner.record[(2, 3, None, True, "gloo-ring")] == _NotTheReplicas(message="m", expected="aa", found="bb")
