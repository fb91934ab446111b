"""The STEP record's microbatch digest: the exact digest of the IDs as little-endian int64 bytes,
held to the numpy reference (``reference.digest_bytes``), which it no longer calls."""

from __future__ import annotations

import numpy as np
import pytest

from sdc_forensics.fingerprint import reference
from sdc_forensics.recorder.records import ids_digest

_RNG = np.random.default_rng(37)
CASES = [[], [0], [3, 4], [-1], [2**63 - 1, -(2**63)], list(range(1000))] + [
    [int(i) for i in _RNG.integers(-(2**62), 2**62, int(n))] for n in _RNG.integers(1, 3000, 6)
]


@pytest.mark.parametrize("ids", CASES, ids=lambda ids: f"{len(ids)}ids")
def test_ids_digest_is_the_reference_digest_of_int64_bytes(ids):
    assert ids_digest(ids) == reference.digest_bytes(np.asarray(ids, dtype="<i8"))
    assert ids_digest(iter(ids)) == ids_digest(tuple(ids))
