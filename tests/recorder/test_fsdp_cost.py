"""The sharded recorder's batched pieces (issue 37) are fingerprint_piece's, bit for bit."""

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import shards


def _same(p: shards.Piece, q: shards.Piece) -> bool:
    return (
        p.lanes == q.lanes
        and p.edges == q.edges
        and (p.num_bytes, p.numel, p.nonfinite, p.seed) == (q.num_bytes, q.numel, q.nonfinite, q.seed)
        and p.sketch.tobytes() == q.sketch.tobytes()
        and np.float64(p.sumsq).tobytes() == np.float64(q.sumsq).tobytes()
        and np.float64(p.max_abs).tobytes() == np.float64(q.max_abs).tobytes()
    )


@pytest.mark.parametrize("trial", range(6))
def test_fingerprint_pieces_equal_fingerprint_piece(trial):
    rng = np.random.default_rng(trial)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
    items = []
    for _ in range(25):
        dtype = dtypes[int(rng.integers(0, len(dtypes)))]
        n = int(rng.choice([0, 1, 64, 1023, 1024, 1025, 3000, 5000]))
        if dtype == torch.int32:
            base = torch.randint(-1000, 1000, (n + 3,), dtype=torch.int32)
        else:
            base = (torch.randn(n + 3) * 10.0 ** int(rng.integers(-6, 6))).to(dtype)
            if n and rng.random() < 0.3:
                base[int(rng.integers(0, n))] = float(rng.choice([np.nan, np.inf]))
        start = int(rng.integers(0, 3))
        values = base[start : start + n]
        # a non-contiguous piece, as a reduce-scatter chunk's rows
        if n and n % 4 == 0 and rng.random() < 0.3:
            values = values.view(4, -1).t()
        items.append((values, int(rng.integers(0, 10**6)), int(rng.integers(0, 50)), int(rng.integers(0, 50))))
    k = int(rng.choice([1, 8]))
    got = shards.fingerprint_pieces(items, k=k, seed=7)
    want = [shards.fingerprint_piece(v, offset=o, digest_base=d, sketch_base=s, k=k, seed=7) for v, o, d, s in items]
    assert len(got) == len(want)
    assert all(_same(g, w) for g, w in zip(got, want))
