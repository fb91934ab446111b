"""Tolerance of sketch comparisons, derived from dtype, reduction and world size (numpy only).

The check: ``|S(reduced) - mean_r S(local_r)|`` per projection, against

    tol = KAPPA * (u_grad * rho(W) + u_acc * sqrt(2 * BLOCK_ELEMS)) * scale

where ``u_grad`` is the unit roundoff of the gradient dtype (the all-reduce sums and rounds in
it), ``rho(W) = sqrt(W) + 1`` models ``W - 1`` rounded additions plus the rounding of the
division by ``W`` (random-walk growth), ``u_acc`` is the unit roundoff of the sketch
accumulation (float32) over a block of ``BLOCK_ELEMS`` products and the combination of blocks,
and ``scale = max(||reduced||_2, mean_r ||local_r||_2 / W ... )`` (see :func:`scale`). With
+-1 projection entries each sketch coordinate of a random error vector ``e`` has standard
deviation ``||e||_2``, so the bracket is one standard deviation and ``KAPPA`` the number of
them tolerated. ``KAPPA`` is calibrated by ``benchmarks/calibrate_sketch.py`` (see
``docs/fingerprints.md``).
"""

from __future__ import annotations

import numpy as np

from sdc_forensics.fingerprint import constants as C

#: Unit roundoff (half an ulp at 1.0) of the dtypes gradients travel in.
UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
}
#: Standard deviations tolerated; calibrated by benchmarks/calibrate_sketch.py.
KAPPA = 8.0


def rho(world_size: int) -> float:
    """Growth of the reduction's rounding error with the number of ranks."""
    return float(np.sqrt(max(world_size, 1)) + 1.0)


def relative_tolerance(grad_dtype: str, world_size: int) -> float:
    """Tolerance of a sketch coordinate, as a multiple of :func:`scale`."""
    try:
        u_grad = UNIT_ROUNDOFF[grad_dtype]
    except KeyError:
        raise ValueError(f"no roundoff model for gradient dtype {grad_dtype!r}; one of {sorted(UNIT_ROUNDOFF)}") from None
    u_acc = UNIT_ROUNDOFF["float32"]
    return KAPPA * (u_grad * rho(world_size) + u_acc * np.sqrt(2.0 * C.BLOCK_ELEMS))


def scale(local_norms: np.ndarray, reduced_norm: np.ndarray) -> np.ndarray:
    """Magnitude the errors scale with: ``max(||reduced||, mean_r ||local_r|| / W * sqrt(W))``.

    Args:
        local_norms: ``(..., W)`` L2 norms of the ranks' local (un-averaged) gradients.
        reduced_norm: ``(...)`` L2 norm of the averaged gradient.
    """
    local_norms = np.asarray(local_norms, dtype=np.float64)
    world_size = local_norms.shape[-1]
    # Each rank contributes g_r / W; rounding errors add like a random walk over ranks.
    rms_part = np.sqrt(np.sum(local_norms**2, axis=-1)) / world_size
    return np.maximum(np.asarray(reduced_norm, dtype=np.float64), rms_part)


def allreduce_residual(local_sketches: np.ndarray, reduced_sketch: np.ndarray, reduction: str = "mean") -> np.ndarray:
    """``max_m |S_m(reduced) - combine_r S_m(local_r)|``.

    Args:
        local_sketches: ``(..., W, k)``.
        reduced_sketch: ``(..., k)``.
        reduction: ``mean`` (DDP's default) or ``sum``.
    """
    local = np.asarray(local_sketches, dtype=np.float64)
    expected = local.mean(axis=-2) if reduction == "mean" else local.sum(axis=-2)
    return np.abs(np.asarray(reduced_sketch, dtype=np.float64) - expected).max(axis=-1)


def allreduce_tolerance(grad_dtype: str, local_norms: np.ndarray, reduced_norm: np.ndarray) -> np.ndarray:
    """Tolerance for :func:`allreduce_residual`, same leading shape."""
    local_norms = np.asarray(local_norms, dtype=np.float64)
    return relative_tolerance(grad_dtype, local_norms.shape[-1]) * scale(local_norms, reduced_norm)
