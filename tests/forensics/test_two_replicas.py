"""Two replicas cannot form a strict majority (issue 25): a 2-rank job whose rank 1 received a wrong
all-reduce result (a low mantissa bit, below the sketch tolerance: only the digests differ).

The trace alone says that no majority is possible and what settles it; the exact replay is the
third vote and names the rank.
"""

from __future__ import annotations

import pytest

from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.replay.options import BisectOptions

pytestmark = pytest.mark.slow

FAULT = "allreduce:step=5:rank=1:bit=8"


def _bisect(out, **options):
    return bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", **options))


def test_trace_alone_says_no_majority_is_possible_and_what_settles_it(demo_run):
    result = _bisect(demo_run(FAULT, steps=8, checkpoint_every=4, world_size=2), trace_only=True)
    assert result.verdict.value == "inconclusive"
    assert "two replicas no strict majority is possible" in result.settle[0]
    assert "third vote" in result.settle[0]
    [suspect] = result.suspects
    assert suspect.rank is None and "two cannot form a majority" in suspect.recommendation
    assert "interconnect of every node" not in suspect.recommendation


def test_the_replay_is_the_third_vote_and_names_the_rank(demo_run):
    result = _bisect(demo_run(FAULT, steps=8, checkpoint_every=4, world_size=2))
    assert (result.verdict.value, result.first_divergent_step) == ("corruption", 5)
    [suspect] = result.suspects
    assert (suspect.rank, suspect.location.value, suspect.steps) == (1, "collective", (5,))
    assert result.replayed.comparison == "exact"
    assert {c.step: c.status.value for c in result.checkpoints}[4] == "clean"
