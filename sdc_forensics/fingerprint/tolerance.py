"""Tolerance of sketch comparisons, derived from dtype, reduction and world size (numpy only).

The all-reduce check compares, per projection ``m``, the sketch of the reduced gradient with
the mean (``sum`` reduction: the sum) of the ranks' local sketches. Both sides are exact linear
functions of their inputs, so the residual is the sketch of the rounding errors alone, and
with ``+-1`` projection entries a sketch coordinate of an error vector ``e`` that looks random
to the projections has standard deviation ``||e||_2``. The model of that standard deviation:

    sigma = scale * sqrt((u_grad * rho(W))**2 + (u_acc * sqrt(BLOCK_ELEMS / 2))**2)
    scale = sqrt(min(||R||, sum_r ||g_r|| / D)**2 + sum_r ||g_r||**2 / D**2)   (D = W for mean, 1 for sum)
    rho(W) = sqrt(W / 3 + [W not a power of two])
    tol = KAPPA * sigma

* Reduction rounding (``u_grad``, unit roundoff of the gradient dtype the collective adds in):
  a ring adds ``W - 1`` partial sums ``p_k`` per element, each rounded, then divides by ``W``
  (or pre-multiplies every rank by ``1/W``, as DDP's bucket copy does), so
  ``||e||**2 ~ u**2 (sum_k ||p_k||**2 / D**2 + ||R||**2)`` (post-division) or
  ``u**2 (sum_k ||p_k||**2 / D**2 + sum_r ||g_r||**2 / D**2)`` (pre-division).
  With ``E||p_k||**2 = k A + k (k - 1) B`` (``A`` the mean squared local norm, ``B`` the mean
  inner product of two ranks' gradients) the first term is at most ``W / 3 * scale**2`` for
  identical ranks, ``W / 4`` for independent ones and ``W / 6`` for cancelling ones: the growth
  is ``sqrt(W)`` in every regime, relative to ``scale``. The division terms vanish when ``W``
  is a power of two (exact), else they add at most one ``scale**2``.
* Sketch accumulation (``u_acc``: float32, float64 for float64 gradients): each side sums
  ``BLOCK_ELEMS`` products per block; summed one after another (the worst order a BLAS or GPU
  kernel uses) the error of a block is about ``u_acc * sqrt(BLOCK_ELEMS / 2)`` times its norm,
  on both sides: ``||R||`` and the mean of ``W`` local sketches (``sum_r ||g_r||**2 / D**2``).

``KAPPA`` (standard deviations tolerated) is calibrated by ``benchmarks/calibrate_sketch.py``
over seeds, sizes, ``W``, dtypes, rank correlations, division modes and summation orders; the
run and its figures are in ``docs/fingerprints.md``.
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
    # not a storage dtype: float32 tensors multiplied with 10 explicit mantissa bits, as cuDNN
    # convolutions (torch.backends.cudnn.allow_tf32, on by default) and TF32 matmuls compute on
    # Ampere and later GPUs; the roundoff of a recomputation elsewhere (replay/env.py)
    "tfloat32": 2.0**-11,
}
#: Standard deviations tolerated. Calibrated by benchmarks/calibrate_sketch.py (docs/fingerprints.md):
#: over 4,000 simulated all-reduces (seeds 2 and 3) the largest residual was 2.09 sigma, so 5 keeps
#: a 2.4x margin; medians are flat in W, size, rank correlation and division mode.
KAPPA = 5.0
REDUCTIONS = ("mean", "sum")


def rho(world_size: int) -> float:
    """Growth of the reduction's rounding error with the number of ranks (relative to ``scale``).

    ``sqrt(W / 3)`` for the ``W - 1`` rounded additions of a ring, plus one rounding of the
    division (or of DDP's multiplication by ``1/W``) unless ``W`` is a power of two, where it is
    exact.
    """
    world_size = max(world_size, 1)
    inexact_division = world_size & (world_size - 1) != 0
    return float(np.sqrt(world_size / 3.0 + (1.0 if inexact_division else 0.0)))


def _unit_roundoff(grad_dtype: str) -> tuple[float, float]:
    try:
        u_grad = UNIT_ROUNDOFF[grad_dtype]
    except KeyError:
        raise ValueError(
            f"no roundoff model for gradient dtype {grad_dtype!r}; one of {sorted(UNIT_ROUNDOFF)}"
        ) from None
    u_acc = UNIT_ROUNDOFF["float64" if grad_dtype == "float64" else "float32"]
    return u_grad, u_acc


def relative_sigma(grad_dtype: str, world_size: int) -> float:
    """Modelled standard deviation of a residual coordinate, as a multiple of :func:`scale`."""
    u_grad, u_acc = _unit_roundoff(grad_dtype)
    return float(np.hypot(u_grad * rho(world_size), u_acc * np.sqrt(C.BLOCK_ELEMS / 2.0)))


def relative_tolerance(grad_dtype: str, world_size: int) -> float:
    """Tolerance of a sketch coordinate, as a multiple of :func:`scale` (``KAPPA`` sigmas)."""
    return KAPPA * relative_sigma(grad_dtype, world_size)


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def scale(local_norms: np.ndarray, reduced_norm: np.ndarray, reduction: str = "mean") -> np.ndarray:
    """Magnitude the errors scale with: ``sqrt(||R||**2 + sum_r ||g_r||**2 / D**2)``.

    ``||R||`` is capped at ``sum_r ||g_r|| / D`` (the most a correct reduction can reach), so a
    corrupted reduced gradient (huge, or with NaN/Inf) cannot raise its own tolerance.

    Args:
        local_norms: ``(..., W)`` L2 norms of the ranks' local (un-averaged) gradients.
        reduced_norm: ``(...)`` L2 norm of the reduced gradient.
        reduction: ``mean`` (``D = W``) or ``sum`` (``D = 1``).
    """
    _check_reduction(reduction)
    local_norms = np.asarray(local_norms, dtype=np.float64)
    divisor = local_norms.shape[-1] if reduction == "mean" else 1
    local_part = np.sum(local_norms**2, axis=-1) / divisor**2
    # A corrupted reduced gradient must not widen its own tolerance: its norm is capped by the
    # triangle inequality (plus rounding), and a NaN/Inf norm falls back to that cap.
    cap = np.sum(local_norms, axis=-1) / divisor * (1.0 + 1e-2)
    reduced = np.fmin(np.abs(np.asarray(reduced_norm, dtype=np.float64)), cap)
    return np.sqrt(reduced**2 + local_part)


def allreduce_residual(local_sketches: np.ndarray, reduced_sketch: np.ndarray, reduction: str = "mean") -> np.ndarray:
    """``max_m |S_m(reduced) - combine_r S_m(local_r)|``; ``inf`` where a sketch is NaN.

    The check fails where ``residual > allreduce_tolerance(...)``.

    Args:
        local_sketches: ``(..., W, k)``.
        reduced_sketch: ``(..., k)``.
        reduction: ``mean`` (DDP's default) or ``sum``.
    """
    _check_reduction(reduction)
    local = np.asarray(local_sketches, dtype=np.float64)
    expected = local.mean(axis=-2) if reduction == "mean" else local.sum(axis=-2)
    residual = np.abs(np.asarray(reduced_sketch, dtype=np.float64) - expected).max(axis=-1)
    # NaN compares false: make it loud
    return np.where(np.isnan(residual), np.inf, residual)


def allreduce_tolerance(
    grad_dtype: str, local_norms: np.ndarray, reduced_norm: np.ndarray, reduction: str = "mean"
) -> np.ndarray:
    """Tolerance for :func:`allreduce_residual`, same leading shape.

    Args:
        grad_dtype: dtype the gradients were reduced in (``float32``, ``bfloat16``, ...).
        local_norms: ``(..., W)`` L2 norms of the local gradients (as recorded).
        reduced_norm: ``(...)`` L2 norm of the reduced gradient.
        reduction: ``mean`` or ``sum``, as for :func:`allreduce_residual`.
    """
    local_norms = np.asarray(local_norms, dtype=np.float64)
    return relative_tolerance(grad_dtype, local_norms.shape[-1]) * scale(local_norms, reduced_norm, reduction)
