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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fingerprint_runs_in_one_call_equal_the_pieces_combined(dtype):
    """``fingerprint_runs`` of a rank's runs (its shard of each parameter of a flat vector) in one
    compiled call: the fingerprint of its pieces combined, bit for bit (digest, lanes, sketch, norm,
    max), however the runs cut the chunks; a NaN takes the pieces' path, which counts it."""
    if not shards.cpu_kernel.available()[0]:
        pytest.skip("compiled CPU kernel unavailable")
    rng = np.random.default_rng(11)
    for trial in range(25):
        runs, offset = [], int(rng.integers(0, 5000))
        for n in rng.integers(1, 20000, int(rng.integers(1, 25))).tolist():
            values = (torch.randn(n) * 10.0 ** int(rng.integers(-3, 3))).to(dtype)
            lo = int(rng.integers(0, n))
            hi = int(rng.integers(lo, n + 1))
            runs.append((values[lo:hi], offset + lo))
            offset += n
        if trial == 24:
            runs[0][0][0] = float("nan")
        fast = shards.fingerprint_runs(runs, k=8, seed=3)
        pieces = shards.fingerprint_pieces(((v, o, 0, 0) for v, o in runs), k=8, seed=3)
        slow = shards.combine_pieces(pieces or [shards._empty(8, 3)])
        assert (trial == 24) == (shards._compiled_runs(runs, 8, 3) is None)
        assert (fast.digest, fast.lanes, fast.numel, fast.nonfinite) == (
            slow.digest,
            slow.lanes,
            slow.numel,
            slow.nonfinite,
        )
        assert fast.sketch.tobytes() == slow.sketch.tobytes(), trial
        assert np.float64(fast.norm).tobytes() == np.float64(slow.norm).tobytes(), trial
        assert np.float64(fast.max_abs).tobytes() == np.float64(slow.max_abs).tobytes(), trial


def test_runs_added_over_several_calls_are_their_pieces_combined():
    """A rank's local gradient arrives one reduce-scatter at a time: ``RunsFingerprint`` adds each
    call's runs into one compiled total; its pieces combine to the same fingerprint, bit for bit,
    as every run's pieces would; a call holding a NaN becomes pieces of its own and is counted."""
    if not shards.cpu_kernel.available()[0]:
        pytest.skip("compiled CPU kernel unavailable")
    rng = np.random.default_rng(5)
    calls, offset = [], 0
    for _ in range(4):
        runs = []
        for n in rng.integers(1, 9000, 6).tolist():
            runs.append((torch.randn(n) * 3, offset))
            offset += n
        calls.append(runs)
    for with_nan in (False, True):
        if with_nan:
            calls[2][1][0][7] = float("nan")
        total = shards.RunsFingerprint(k=8, seed=2)
        for runs in calls:
            total.add(runs)
        got = shards.one_bucket(total.pieces())
        every = shards.fingerprint_pieces(((v, o, 0, 0) for runs in calls for v, o in runs), k=8, seed=2)
        want = shards.one_bucket(every)
        assert (got.digest, got.numel, got.nonfinite) == (want.digest, want.numel, want.nonfinite)
        # the compiled total, then (a NaN) the pieces of the call that holds it, one per run
        assert len(total.pieces()) == (1 + len(calls[2]) if with_nan else 1)
        if not with_nan:
            assert got.sketch.tobytes() == want.sketch.tobytes()
            assert np.float64(got.norm).tobytes() == np.float64(want.norm).tobytes()
        else:
            assert got.nonfinite == 1 and np.isnan(got.max_abs)
