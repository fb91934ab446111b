"""Strict-majority votes over per-rank digests."""

from __future__ import annotations

import numpy as np
import pytest

from sdc_forensics.trace.consensus import strict_majority


def _naive(values, valid):
    out = []
    for row, ok in zip(values, valid):
        votes = list(row[ok])
        best = max(set(votes), key=votes.count) if votes else None
        out.append(best if votes and votes.count(best) * 2 > len(votes) else None)
    return out


def test_strict_majority_matches_a_naive_count():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 3, size=(2000, 7)).astype(np.uint64) * np.uint64(
        2**63 + 12345
    )  # few distinct, huge values
    valid = rng.random((2000, 7)) > 0.2
    majority, ok = strict_majority(values, valid)
    for got, good, want in zip(majority, ok, _naive(values, valid)):
        assert good == (want is not None)
        if good:
            assert int(got) == int(want)


def test_half_is_not_a_strict_majority_and_invalid_cells_do_not_vote():
    values = np.array([[5, 5, 7, 7], [5, 5, 5, 7], [9, 1, 1, 1]], dtype=np.uint64)
    valid = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=bool)
    majority, ok = strict_majority(values, valid)
    assert ok.tolist() == [False, True, False]
    assert int(majority[1]) == 5


# ---------------------------------------------------------------------------------------------
# One vote: every caller agrees with ``consensus.vote`` / ``strict_majority``, checked on rows of
# few distinct values (so majorities, ties and splits all occur) against the naive count above.


def _rows(count=400, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        width = int(rng.integers(1, 9))
        yield rng.integers(0, 3, size=width).astype(np.uint64) * np.uint64(2**63 + 777)


def test_vote_is_the_naive_strict_majority_of_one_row():
    from sdc_forensics.trace.consensus import vote

    for row in _rows():
        (want,) = _naive(row[None, :], np.ones((1, len(row)), dtype=bool))
        value, votes = vote(row)
        assert value == (None if want is None else int(want))
        assert votes == (0 if want is None else int((row == want).sum()))
    assert vote([]) == (None, 0)
    assert vote([5, 5, 7, 7]) == (None, 0)  # half is not a strict majority
    assert vote([9, 1, 1, 1], valid=[True, True, False, False]) == (None, 0)


def test_the_recorders_vote_is_the_one_vote():
    from sdc_forensics.recorder import checks
    from sdc_forensics.trace.consensus import vote

    for row in _rows():
        majority = checks.strict_majority(row)
        value, _ = vote(row)
        assert majority.value == value
        if value is not None:
            assert majority.diverged == tuple(int(r) for r in np.flatnonzero(row != np.uint64(value)))


def test_the_audit_vote_is_the_one_vote():
    from sdc_forensics.triage.trace_only import audit_votes
    from sdc_forensics.trace import format as F
    from sdc_forensics.trace.consensus import vote

    rows = [row for row in _rows(200, seed=2) if len(row) >= 2]  # the subject's digest, then its auditors'
    audits = np.zeros(sum(len(row) - 1 for row in rows), dtype=F.record_dtype(8))
    i = 0
    for step, row in enumerate(rows):
        for auditor, digest in enumerate(row[1:]):
            audits[i]["step"], audits[i]["aux_rank"], audits[i]["aux_digest"] = step, 0, row[0]
            audits[i]["rank"], audits[i]["local_digest"] = auditor + 1, digest
            i += 1
    seen = 0
    for step, subject, _, votes, winner, strict in audit_votes(audits):
        value, _ = vote(rows[step])
        assert [v for _, v in votes] == [int(v) for v in rows[step]]
        assert (winner, strict) == (value, value is not None)
        seen += 1
    assert seen == len(rows)


def test_the_replays_reduced_gradient_vote_is_the_one_vote():
    """``replay.compare``'s vote over the recorded reduced digests: when the replay reproduces the
    majority's digest, the ranks named are exactly those outside it; with no majority, the replay's
    digest is the third vote and the ranks that recorded something else are named."""
    from types import SimpleNamespace

    from sdc_forensics.replay.compare import StepComparisons
    from sdc_forensics.trace import format as F
    from sdc_forensics.trace.consensus import vote

    class _Replay(StepComparisons):
        def __init__(self, replayed):
            self.known_order, self.replayed = "", replayed

        def reduce(self, per_rank, order):
            return ["buffers"]

        def digest_of(self, reduced):
            return self.replayed

    for row in _rows(300, seed=3):
        recs = np.zeros(len(row), dtype=F.record_dtype(8))
        recs["flags"] = int(F.Flag.HAS_GRADS)
        recs["reduced_digest"] = row
        value, _ = vote(row)
        replayed = int(row[0]) if value is None else value
        _, order, evidence, note = _Replay(replayed)._reduce(
            3, recs, [SimpleNamespace(buckets=[])] * len(row), False, 0
        )
        named = tuple(int(r) for r in np.flatnonzero(row != np.uint64(replayed)))
        assert (order, note) == ("gloo-ring", "")
        assert [e.ranks for e in evidence] == ([named] if named else [])


def test_the_compiled_scan_votes_as_the_one_vote():
    """The scan kernel keeps its own Boyer-Moore pass; a replica it marks diverged at a step is one
    holding weights outside the strict majority of the replicas that hold weights there."""
    from sdc_forensics.trace import scan
    from sdc_forensics.trace.consensus import strict_majority

    K = scan._import_kernels()
    if K is None:
        pytest.skip("numba is not installed: only the numpy path exists")
    rng = np.random.default_rng(4)
    for row in _rows(300, seed=5):
        R = len(row)
        has_w = rng.random(R) > 0.2  # (R,)
        bits = np.where(has_w, K.WEIGHTS, 0).astype(np.uint8).reshape(R, 1)  # (R, S=1)
        racc = np.zeros((1, K.NUM_ACC), dtype=np.float64)
        diverged = np.zeros(R, dtype=bool)
        K.rows(
            0,
            bits,
            row.reshape(R, 1).copy(),
            racc,
            np.zeros((1, 4, 1)),
            1e-6,
            True,
            True,
            np.full(5, -1, dtype=np.int64),
            diverged,
            np.empty(1, dtype=np.uint8),
            np.empty((R, 1), dtype=bool),
            np.empty(1, dtype=np.int64),
        )
        majority, ok = strict_majority(row[None, :], has_w[None, :])
        expected = has_w & (row != majority[0]) if ok[0] else np.zeros(R, dtype=bool)
        assert diverged.tolist() == expected.tolist(), (row, has_w)
