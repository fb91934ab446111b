"""The all-reduce sketch check: ``sketch(mean of W gradients)`` matches ``mean(sketches)``
within ``tolerance.allreduce_tolerance`` when the all-reduce is simulated realistically (ring
order, every addition and the division rounded in the gradient dtype, heavy-tailed
gradient-like values), and a change of one element by twice the tolerance is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import core, tolerance

NUMEL = 250_000


def _check(local: list[core.Fingerprint], reduced: core.Fingerprint, dtype_name: str, reduction: str = "mean"):
    """(residual, tolerance) of the all-reduce check, as the recorder and bisect compute it."""
    residual = tolerance.allreduce_residual(np.stack([f.sketch for f in local]), reduced.sketch, reduction)
    tol = tolerance.allreduce_tolerance(dtype_name, np.array([f.norm for f in local]), reduced.norm, reduction)
    return float(residual), float(tol)


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_mean_of_sketches_matches_sketch_of_reduced_gradient(gradsim, world_size, dtype_name):
    dtype = gradsim.DTYPES[dtype_name]
    grads = gradsim.rank_gradients(NUMEL, world_size, seed=world_size, dtype=dtype, correlation=0.5)
    local = [core.fingerprint(g, with_digest=False) for g in grads]
    for division, rotation in [("post", 0), ("pre", 1), ("post", world_size - 1)]:
        reduced_tensor = gradsim.ring_allreduce(grads, division=division, rotation=rotation)
        reduced = core.fingerprint(reduced_tensor, with_digest=False)
        residual, tol = _check(local, reduced, dtype_name)
        assert residual <= tol / 2, (division, rotation, residual, tol)  # KAPPA keeps a 2x margin
        assert residual > 0 or dtype_name == "float32"  # the rounding is real, the test not vacuous

    # One element off by twice the tolerance (after rounding in the gradient dtype) is caught.
    rng = np.random.default_rng(world_size)
    for index in rng.choice(NUMEL, size=3, replace=False):
        corrupted = reduced_tensor.clone()
        corrupted[index] += 2 * tol
        change = float(corrupted[index].double() - reduced_tensor[index].double())
        assert change >= 1.9 * tol
        residual, tol_corrupted = _check(local, core.fingerprint(corrupted, with_digest=False), dtype_name)
        assert residual > tol_corrupted, (index, residual, tol_corrupted)


def test_sum_reduction_and_cancelling_ranks(gradsim):
    grads = gradsim.rank_gradients(NUMEL, 4, seed=3, dtype=torch.bfloat16, correlation=-0.9)
    local = [core.fingerprint(g, with_digest=False) for g in grads]
    for division, reduction in [("sum", "sum"), ("post", "mean")]:
        reduced = core.fingerprint(gradsim.ring_allreduce(grads, division=division), with_digest=False)
        residual, tol = _check(local, reduced, "bfloat16", reduction)
        assert 0 < residual <= tol / 2, (division, residual, tol)


def test_a_wrong_rank_contribution_is_caught(gradsim):
    """A finite wrong number inside the collective: one rank's ring chunk counted twice."""
    grads = gradsim.rank_gradients(NUMEL, 4, seed=5, dtype=torch.bfloat16)
    local = [core.fingerprint(g, with_digest=False) for g in grads]
    wrong = list(grads)
    wrong[2] = grads[2].clone()
    wrong[2][: NUMEL // 4] *= 2
    reduced = core.fingerprint(gradsim.ring_allreduce(wrong), with_digest=False)
    residual, tol = _check(local, reduced, "bfloat16")
    assert residual > tol


def test_tolerance_model_shape():
    for dtype_name in ("float32", "bfloat16", "float16", "float64"):
        tols = [tolerance.relative_tolerance(dtype_name, w) for w in (1, 2, 4, 8, 16, 1024)]
        assert all(a < b for a, b in zip(tols, tols[1:]))  # grows with W ...
        assert tols[-1] / tols[1] < np.sqrt(1024 / 2)  # ... no faster than sqrt(W)
    assert tolerance.relative_tolerance("bfloat16", 4) > 100 * tolerance.relative_tolerance("float32", 4) / 10
    assert tolerance.relative_tolerance("float64", 4) < 1e-10
    with pytest.raises(ValueError, match="no roundoff model"):
        tolerance.relative_tolerance("int8", 4)
    with pytest.raises(ValueError, match="reduction"):
        tolerance.allreduce_residual(np.zeros((2, 8)), np.zeros(8), "max")


def test_scale_and_tolerance_broadcast_over_steps():
    local_norms = np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 1.0]])  # (S, W)
    reduced_norms = np.array([2.5, 1.0, np.inf])  # (S,): steps 1 and 2 are impossible means
    capped = np.sqrt(1.01**2 + 2 / 4)  # ||R|| <= sum_r ||g_r|| / W (+1%)
    np.testing.assert_allclose(tolerance.scale(local_norms, reduced_norms), [np.sqrt(2.5**2 + 25 / 4), 0.0, capped])
    np.testing.assert_allclose(tolerance.scale(local_norms[:1], reduced_norms[:1], "sum"), [np.sqrt(2.5**2 + 25)])
    assert tolerance.scale(local_norms[2], np.nan) == pytest.approx(capped)
    tol = tolerance.allreduce_tolerance("float32", local_norms, reduced_norms)
    assert tol.shape == (3,)
    np.testing.assert_allclose(
        tol, tolerance.relative_tolerance("float32", 2) * tolerance.scale(local_norms, reduced_norms)
    )
    reduced_sketches = np.full((2, 8), 1.5)
    reduced_sketches[1, 3] = np.nan
    residual = tolerance.allreduce_residual(np.ones((2, 2, 8)), reduced_sketches)
    np.testing.assert_allclose(residual, [0.5, np.inf])  # NaN is reported as an infinite residual


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_an_overflowing_corruption_does_not_widen_its_own_tolerance(gradsim, dtype_name):
    """A high exponent bit flipped: the reduced norm becomes inf, the check must still fire."""
    grads = gradsim.rank_gradients(20_000, 4, seed=8, dtype=gradsim.DTYPES[dtype_name])
    local = [core.fingerprint(g, with_digest=False) for g in grads]
    reduced = gradsim.ring_allreduce(grads)
    bit = 30 if dtype_name == "float32" else 14
    corrupted = core.fingerprint(gradsim.flip_bit(reduced, 123, bit), with_digest=False)
    assert corrupted.nonfinite == 0 and not np.isfinite(corrupted.norm)  # huge but finite element
    residual, tol = _check(local, corrupted, dtype_name)
    assert np.isfinite(tol) and residual > tol
