"""Strict-majority votes over per-rank digests."""

from __future__ import annotations

import numpy as np

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
    values = rng.integers(0, 3, size=(2000, 7)).astype(np.uint64) * np.uint64(2**63 + 12345)  # few distinct, huge values
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
