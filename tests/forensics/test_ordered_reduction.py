"""A job whose collective order the replay does not know, certified by the ordered reduction (issue 21).

The demo MLP trained with 4 gloo ranks through ``sdc_forensics.demo.hooks:reversed_mean`` (a mean
all-reduce of the reversed buffer: gloo's ring then sums each element in an order none of the
replay's models reproduces; it stands in for NCCL). Recorded with the collective's own order
(``native``), a clean run cannot be replayed bit for bit: nothing after checkpoint 0 is certified.
Recorded with ``RecorderOptions(reduction="ordered")`` (composed with the same hook), the replay
reproduces the reduced gradient exactly: the clean run is certified, and faults are found at their
exact step and rank, including one inside the collective below the sketch tolerance.
"""

from __future__ import annotations

import pytest

from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.replay.options import BisectOptions
from sdc_forensics.inject import parse_spec

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3
HOOK = "sdc_forensics.demo.hooks:reversed_mean"


def _bisect(out):
    return bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))


def _run(demo_run, injections=(), reduction="native"):
    return demo_run(injections, steps=STEPS, checkpoint_every=EVERY, comm_hook=HOOK, reduction=reduction)


def test_without_the_ordered_reduction_an_unknown_order_is_never_certified(demo_run):
    result = _bisect(_run(demo_run))
    assert result.verdict.value == "inconclusive" and result.suspects == ()
    statuses = {c.step: c.status.value for c in result.checkpoints}
    assert statuses == {0: "clean", 3: "unverified", 6: "unverified"}
    assert any("no summation order reproduces" in n for n in result.replayed.notes)


def test_with_the_ordered_reduction_the_same_job_is_certified(demo_run):
    result = _bisect(_run(demo_run, reduction="ordered"))
    assert result.verdict.value == "clean" and result.replayed.comparison == "exact"
    assert result.replayed.reduction_order == "ordered"
    assert {c.step: c.status.value for c in result.checkpoints} == {0: "clean", 3: "clean", 6: "clean"}


@pytest.mark.parametrize(
    "fault",
    [
        "grad:step=4:rank=2:bit=20",
        "allreduce-all:step=2:bit=3",
        "update:step=1:rank=1:bit=22",
        "weights:step=4:rank=3:bit=27",
    ],
)
def test_with_the_ordered_reduction_faults_are_found_at_their_exact_step_and_rank(demo_run, fault):
    spec = parse_spec(fault)
    result = _bisect(_run(demo_run, fault, reduction="ordered"))
    assert (result.verdict.value, result.first_divergent_step) == ("corruption", spec.step), result.settle
    named = [s.rank for s in result.suspects]
    assert named == ([None] if spec.location == "allreduce-all" else [spec.rank])
    assert result.replayed.comparison == "exact"
    statuses = {c.step: c.status.value for c in result.checkpoints}
    assert all(s == "clean" for n, s in statuses.items() if n <= spec.step)
    assert all(s in ("tainted", "corrupt") for n, s in statuses.items() if n > spec.step)
