"""Which online checks ran on which steps (``trace/online.py``), counted from the STEP records' flags.

The synthetic traces (``tests/factories.write_trace``) flag every step with gradient
fingerprints, compare weights every ``weights_every`` steps and audit every ``audit_every``
steps, so the expected counts follow from those settings alone.
"""

from __future__ import annotations

from sdc_forensics.trace.online import OnlineChecks, online_checks
from sdc_forensics.trace.reader import Trace


def test_counts_follow_the_recorders_settings(make_trace):
    trace = Trace.open(make_trace(ranks=4, steps=20, audit_every=5, weights_every=2))
    checks = online_checks(trace, [(0, 9), (12, 19)])
    assert checks == OnlineChecks(steps=18, complete=18, gradients=18, weights=9, audited=(0, 5, 15), world_size=4)
    assert checks.describe() == (
        "NaN/Inf and all-reduce sketch on every step; replica vote (4 replicas) on 9 of 18 steps; audits at 0, 5, 15"
    )


def test_two_replicas_detect_without_a_vote_and_empty_spans_count_nothing(make_trace):
    trace = Trace.open(make_trace(ranks=2, steps=6))
    assert (
        "replica comparison (2 replicas: detects, cannot vote) on every step"
        in online_checks(trace, [(0, 5)]).describe()
    )
    assert online_checks(trace, [(4, 3)]) == OnlineChecks(world_size=2)
    assert OnlineChecks().describe() == "no step recorded"


def test_a_step_a_rank_did_not_record_counts_as_checked_by_no_check(make_trace, tmp_path):
    import numpy as np

    from sdc_forensics.trace import format as F

    path = make_trace(ranks=3, steps=4)
    rank_file = sorted(p for p in path.iterdir() if p.name.startswith("rank"))[1]
    raw = bytearray(rank_file.read_bytes())
    dtype = F.record_dtype(Trace.open(path).sketch_k)
    records = np.frombuffer(bytes(raw[F.HEADER_SIZE :]), dtype=dtype)
    last_step = int(np.nonzero(records["kind"] == int(F.Kind.STEP))[0][-1])
    rank_file.write_bytes(bytes(raw[: F.HEADER_SIZE + last_step * dtype.itemsize]))  # rank 1 stops before step 3
    checks = online_checks(Trace.open(path), [(0, 3)])
    assert (checks.steps, checks.complete, checks.gradients, checks.weights) == (4, 3, 3, 3)
    assert "1 step(s) missing a rank's record" in checks.describe()


def test_a_sharded_job_says_its_weights_are_checked_per_shard_not_voted_by_every_rank():
    # FSDP (and a PP stage): no rank holds another's shard; HSDP 2 x 2: each shard's 2 replicas compare
    alone = OnlineChecks(steps=4, complete=4, gradients=4, weights=4, world_size=4, replicas_per_shard=1)
    assert "each rank's weight shard checked at rest (no replica holds it) on every step" in alone.describe()
    assert "replica vote" not in alone.describe()
    hsdp = OnlineChecks(steps=4, complete=4, gradients=4, weights=4, world_size=4, replicas_per_shard=2)
    assert "replica comparison (2 replicas: detects, cannot vote) of each shard" in hsdp.describe()
    three = OnlineChecks(steps=4, complete=4, gradients=4, weights=4, world_size=6, replicas_per_shard=3)
    assert "replica vote (3 replicas) of each shard" in three.describe()
