"""A tolerant replay never blames a healthy rank (issue 19), on real runs.

The conv net (GroupNorm, ReLU, momentum, clipping, a step schedule) trained with 4 gloo ranks at
1 intra-op thread, one bit flip at each fault location, then ``bisect --threads 2``: a replay at a
thread count the training did not use, compared within tolerance, as every replay of a GPU job
on other hardware is. The answer is the injected step and rank (the collective for a fault inside
it), or ``inconclusive`` naming them as the weak candidate; never a healthy rank, never "drain"
advice for several nodes. A clean run replayed the same way is never ``corruption``.
"""

from __future__ import annotations

import pytest

from sdc_forensics.demo.convnet import REFERENCE
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.replay.options import BisectOptions
from sdc_forensics.inject import parse_spec
from tests.forensics.test_bisect_demo import assert_commands_agree

pytestmark = pytest.mark.slow

STEPS, EVERY = 8, 4
#: One fault per location, bits 20..31 (sign, exponent, high mantissa), each at a step inside an
#: interval so that the replay has a step after it to go wrong on.
FAULTS = (
    "grad:step=5:rank=2:bit=27",
    "grad:step=2:rank=1:bit=22",
    "weights:step=5:rank=3:bit=30",
    "update:step=2:rank=0:bit=24",
    "allreduce:step=5:rank=1:bit=29",
    "allreduce-all:step=6:bit=23",
    "input:step=1:rank=3:bit=31",
)


def _bisect(out):
    return bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", num_threads=2))


def _run(demo_run, injections):
    return demo_run(
        injections,
        steps=STEPS,
        checkpoint_every=EVERY,
        recipe=REFERENCE,
        threads=(1, 1, 1, 1),
        audit_every=0,
        policy="continue",
    )


@pytest.mark.parametrize("fault", FAULTS)
def test_a_tolerant_replay_names_the_injected_step_and_rank_or_is_inconclusive_about_them(demo_run, fault):
    spec = parse_spec(fault)
    faulty = () if spec.location == "allreduce-all" else (spec.rank,)
    result = _bisect(_run(demo_run, fault))
    # tolerant wherever this CPU's kernels give other bits at 2 threads than at 1 (as on the
    # reference machine: tests/demo/test_convnet.py); exact elsewhere, and the rules below hold both ways
    assert result.replayed.comparison in ("tolerant", "exact")
    named = tuple(sorted(s.rank for s in result.suspects if s.rank is not None))
    assert set(named) <= set(faulty), f"{fault}: healthy rank(s) named: {named} ({result.verdict.value})"
    assert not [s for s in result.suspects if "drain node" in s.recommendation and len(result.suspects) > 1]
    if result.verdict.value == "corruption":
        assert result.first_divergent_step == spec.step, fault
        assert named == faulty and (faulty or result.suspects[0].location.value == "collective"), fault
    else:
        assert result.verdict.value == "inconclusive", fault
        [candidate, *_] = [e for e in result.evidence if e.is_weak]
        assert (candidate.step, candidate.ranks) == (spec.step, faulty), fault
    statuses = {c.step: c.status.value for c in result.checkpoints}
    assert not [n for n, s in statuses.items() if n > spec.step and s == "clean"], (
        fault
    )  # never a false-clean certificate


def test_a_clean_run_replayed_at_another_thread_count_is_never_corruption(demo_run):
    result = _bisect(_run(demo_run, ()))
    assert result.verdict.value == ("inconclusive" if result.replayed.comparison == "tolerant" else "clean")
    assert result.suspects == ()
    assert not {c.status.value for c in result.checkpoints} & {"corrupt", "tainted"}


@pytest.mark.parametrize("fault", [FAULTS[1], FAULTS[5]])
def test_commands_agree_on_tolerant_replays(demo_run, fault):
    """bisect, certify, report and verify-checkpoint --trace give one answer on a tolerant replay too."""
    assert_commands_agree(_run(demo_run, fault), modes=(("--threads", "2"),))
