"""Factories for the fingerprint tests: random raw bits, gradient-like tensors, all-reduces.

The all-reduce simulation and the gradient generator live in ``benchmarks/gradsim.py`` so that
the tolerance is tested against the same model ``benchmarks/calibrate_sketch.py`` calibrates it
on; this file puts that folder on the import path.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

#: torch dtype -> numpy dtype of the same width holding its raw bits.
BITS_DTYPE = {
    torch.float32: np.uint32,
    torch.bfloat16: np.uint16,
    torch.float16: np.uint16,
    torch.float64: np.uint64,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
_TORCH_BITS = {np.uint32: torch.int32, np.uint16: torch.int16, np.uint64: torch.int64}


def random_bits(shape, dtype: torch.dtype, seed: int) -> np.ndarray:
    """Random raw bits for a tensor of ``dtype`` (floats include NaN/Inf patterns), as numpy."""
    rng = np.random.default_rng(seed)
    bits_dtype = BITS_DTYPE[dtype]
    if bits_dtype is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    info = np.iinfo(bits_dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=bits_dtype, endpoint=True)


def as_tensor(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The torch tensor of ``dtype`` whose raw bits are ``bits`` (no copy, keeps strides)."""
    bits_dtype = bits.dtype.type
    if bits_dtype in _TORCH_BITS:
        # torch has no uint16/uint32 from numpy in every version: reinterpret as signed first
        signed = bits.view(np.dtype(bits_dtype.__name__[1:]))
        return torch.from_numpy(signed).view(dtype)
    return torch.from_numpy(bits)


@pytest.fixture
def make_bits():
    """``make_bits(shape, dtype, seed) -> (numpy bits, torch tensor)`` sharing memory."""

    def make(shape, dtype: torch.dtype, seed: int = 0):
        bits = random_bits(shape, dtype, seed)
        return bits, as_tensor(bits, dtype)

    return make


@pytest.fixture
def bits_to_tensor():
    """``bits_to_tensor(bits, dtype)``: :func:`as_tensor` as a fixture."""
    return as_tensor


@pytest.fixture
def gradsim():
    """The gradient / all-reduce simulation module (``benchmarks/gradsim.py``)."""
    import gradsim as module

    return module


@pytest.fixture(params=["compiled", "fallback"])
def cpu_path(request, monkeypatch):
    """Runs a test once with the compiled CPU kernel and once with the torch fallback.

    Used through ``pytestmark`` by the files that hold ``core.fingerprint`` to the reference,
    so that both paths meet the same bounds.
    """
    from sdc_forensics.fingerprint import cpu_kernel

    if request.param == "fallback":
        monkeypatch.setenv(cpu_kernel.KERNELS_ENV, "off")
    else:
        monkeypatch.delenv(cpu_kernel.KERNELS_ENV, raising=False)
        ok, reason = cpu_kernel.available()
        if not ok:
            pytest.skip(f"compiled CPU kernel unavailable: {reason}")
    return request.param
