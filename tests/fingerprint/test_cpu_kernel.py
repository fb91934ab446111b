"""The compiled one-pass CPU kernel: bit for bit what the numpy references say, on any input.

The digest is held to ``reference.digest_bytes`` (the definition); the sketch, sum of squares,
max |x| and NaN/Inf count to ``reference.sketch_stats_in_kernel_order``, which states the
kernel's order of roundings in numpy, so equality is exact (bits), not within a tolerance. Sizes,
dtypes, block offsets, storage offsets and strides are drawn at random from a fixed seed, and the
odd cases (empty, one element, one short of a row / tile / block) are listed explicitly.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core, cpu_kernel, reference

pytestmark = pytest.mark.skipif(
    not cpu_kernel.available()[0], reason=f"compiled CPU kernel unavailable: {cpu_kernel.available()[1]}"
)

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
EDGE_SIZES = [1, 2, 3, 511, 1023, 1024, 1025, 2047, 2049, 8191, 8192, 8193, 16384 + 1, 3 * 8192 + 1000]


def _bits(t: torch.Tensor) -> np.ndarray:
    """The values the kernel is handed: float32/float64 as they are, 16-bit types as uint16 bits."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.element_size() == 2 else t.numpy()


def _expected(t: torch.Tensor, k: int, seed: int, block_offset: int):
    flat = t.detach().contiguous().reshape(-1)
    wide = flat.float() if flat.element_size() == 2 else flat  # exact widening, as the kernel does
    sketch, sumsq, max_abs, nonfinite = reference.sketch_stats_in_kernel_order(wide.numpy(), k, seed, block_offset)
    return reference.digest_bytes(_bits(flat), seed), sketch, sumsq, max_abs, nonfinite


def _same_bits(a, b) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (its sign and payload mean nothing)."""
    a, b = np.atleast_1d(np.asarray(a, dtype=np.float64)), np.atleast_1d(np.asarray(b, dtype=np.float64))
    both_nan = np.isnan(a) & np.isnan(b)
    return a.shape == b.shape and bool(np.all(both_nan | (a.view(np.int64) == b.view(np.int64))))


def _assert_bitwise(
    fp: core.Fingerprint,
    t: torch.Tensor,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
    block_offset: int = 0,
):
    digest, sketch, sumsq, max_abs, nonfinite = _expected(t, k, seed, block_offset)
    assert fp.digest == digest
    assert _same_bits(fp.sketch, sketch), (fp.sketch, sketch)
    assert _same_bits(fp.norm, np.sqrt(sumsq))
    assert _same_bits(fp.max_abs, max_abs)
    assert fp.nonfinite == nonfinite
    assert fp.numel == t.numel()


def _random_tensor(rng: np.random.Generator, numel: int, dtype: torch.dtype) -> torch.Tensor:
    scale = float(10.0 ** rng.uniform(-3, 3))
    return (torch.from_numpy(rng.standard_normal(numel)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("numel", EDGE_SIZES)
def test_edge_sizes_bit_identical(dtype, numel):
    t = _random_tensor(np.random.default_rng(numel), numel, dtype)
    assert core.kernel_path("cpu", dtype) == "numba-cpu"
    _assert_bitwise(core.fingerprint(t), t)


@pytest.mark.parametrize("case", range(24))
def test_random_sizes_dtypes_offsets_and_views_bit_identical(case):
    rng = np.random.default_rng(1000 + case)
    dtype = FLOAT_DTYPES[case % len(FLOAT_DTYPES)]
    numel = int(rng.integers(1, 70_000))
    k = int(rng.choice([1, 3, 8, 16]))
    seed = int(rng.integers(0, 2**63))
    block_offset = int(rng.integers(0, 5000))
    base = _random_tensor(rng, numel + 64, dtype)
    kind = case % 3
    if kind == 0:  # a view at an odd storage offset (misaligned words for 16-bit types)
        start = int(rng.integers(1, 64))
        t = base[start : start + numel]
    elif kind == 1:  # a non-contiguous view: every other element of a longer tensor
        t = torch.cat([base, base])[: 2 * numel : 2]
    else:  # a transposed 2-D view
        cols = int(rng.integers(1, 40))
        t = base[: (numel // cols) * cols].reshape(-1, cols).t()
    fp = core.fingerprint(t, k=k, seed=seed, block_offset=block_offset)
    _assert_bitwise(fp, t, k, seed, block_offset)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_nan_and_inf_counted_and_max_abs_says_which(dtype):
    t = _random_tensor(np.random.default_rng(7), 20_000, dtype)
    t[5] = float("inf")
    t[19_999] = -float("inf")
    fp = core.fingerprint(t)
    _assert_bitwise(fp, t)
    assert fp.nonfinite == 2 and fp.max_abs == float("inf")
    t[12_345] = float("nan")
    fp = core.fingerprint(t)
    _assert_bitwise(fp, t)
    assert fp.nonfinite == 3 and np.isnan(fp.max_abs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_subnormals_and_extremes_widen_exactly(dtype):
    bits = np.arange(0, 1 << 16, dtype=np.uint16)  # every 16-bit pattern, NaNs and subnormals too
    t = torch.from_numpy(bits.view(np.int16).copy()).view(dtype)
    _assert_bitwise(core.fingerprint(t), t)


def test_overflowing_squares_are_not_mistaken_for_nonfinite_values():
    t = torch.full((3000,), 1e30, dtype=torch.float32)  # x * x overflows float32; x is finite
    fp = core.fingerprint(t)
    _assert_bitwise(fp, t)
    assert fp.nonfinite == 0 and fp.max_abs == pytest.approx(1e30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.bool, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", [0, 1, 1023, 4096, 100_003])
def test_digests_of_any_dtype_equal_the_definition(dtype, numel):
    t = (torch.arange(numel) * 2654435761 % 1000).to(dtype)
    raw = t.numpy().view(np.uint8) if dtype != torch.bfloat16 else t.view(torch.int16).numpy().view(np.uint8)
    assert core.digests([t])[0] == reference.digest_bytes(raw)


def test_compiled_and_fallback_agree_on_the_digest_and_within_rounding_elsewhere(monkeypatch):
    rng = np.random.default_rng(3)
    t = _random_tensor(rng, 300_001, torch.float32)
    fast = core.fingerprint(t, block_offset=17)
    monkeypatch.setenv(cpu_kernel.KERNELS_ENV, "off")
    slow = core.fingerprint(t, block_offset=17)
    assert fast.digest == slow.digest and fast.nonfinite == slow.nonfinite and fast.max_abs == slow.max_abs
    # both are float32 sums of at most 1,024 terms per group, added in float64: each within
    # gamma_1024(u32) * sum|x| of the exact value, so within twice that of each other
    bound = 2 * (1024 * 2.0**-24) / (1 - 1024 * 2.0**-24) * float(t.double().abs().sum())
    assert np.max(np.abs(fast.sketch - slow.sketch)) <= bound
    assert abs(fast.norm - slow.norm) <= 2 * (1024 * 2.0**-24) * fast.norm


def test_turning_kernels_off_takes_and_reports_the_fallback(monkeypatch, caplog):
    monkeypatch.setenv(cpu_kernel.KERNELS_ENV, "off")
    path = core.kernel_path("cpu", torch.float32)
    assert path.startswith("torch (") and cpu_kernel.KERNELS_ENV in path
    called = []
    monkeypatch.setattr(cpu_kernel, "partials", lambda *a, **k: called.append(1))
    monkeypatch.setattr(core, "_logged", set())
    with caplog.at_level(logging.INFO, logger="sdc_forensics.fingerprint"):
        t = torch.randn(5000)
        fp = core.fingerprint(t)
    assert not called  # the compiled kernel was not used
    assert fp.digest == reference.digest_bytes(t.numpy())
    assert any("fingerprints on cpu: torch (" in r.getMessage() for r in caplog.records)


def test_missing_numba_takes_the_fallback(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_loops", lambda: (None, "numba is not importable (ImportError: test)"))
    assert core.kernel_path("cpu") == "torch (numba is not importable (ImportError: test))"
    t = torch.randn(3000)
    assert core.fingerprint(t).digest == reference.digest_bytes(t.numpy())


def test_unsupported_dtype_is_reported():
    assert core.kernel_path("cpu", torch.int32) == "torch (the compiled kernel does not take int32)"


def test_async_and_resolve_equal_fingerprint():
    parts = [torch.randn(n) for n in (10, 5000, 70_000)]
    pending = [core.fingerprint_async(p, block_offset=i) for i, p in enumerate(parts)]
    resolved = core.resolve(pending)
    for i, (p, fp) in enumerate(zip(parts, resolved)):
        _assert_bitwise(fp, p, block_offset=i)


def test_resolve_takes_device_vectors_of_different_sketch_widths():
    # an accelerator's pending vectors are 2 + k + 3 long: the recorder resolves its k=8 tensors
    # beside one-number sketches in one sync (this broke torch.stack on the first H200 run)
    parts = [(torch.randn(3000), 8), (torch.randn(700), 1), (torch.randn(5000), 4)]
    pending = []
    for tensor, k in parts:
        item = core.PendingFingerprint(
            numel=tensor.numel(), num_bytes=tensor.numel() * 4, seed=C.DEFAULT_SEED, with_digest=True
        )
        item.values = core._torch_partials(tensor, k, C.DEFAULT_SEED, 0, True)
        pending.append(item)
    for (tensor, k), fp in zip(parts, core.resolve(pending)):
        expected = core._torch_fingerprint(tensor, k, C.DEFAULT_SEED, 0, True)  # the same pass, resolved on the host
        assert fp.digest == expected.digest == reference.digest_bytes(tensor.numpy())
        assert fp.sketch.shape == (k,)
        np.testing.assert_array_equal(fp.sketch, expected.sketch)


def test_a_failing_compiled_call_falls_back_for_the_rest_of_the_process(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError("cache file truncated")

    monkeypatch.setattr(cpu_kernel, "partials", broken)
    monkeypatch.setattr(cpu_kernel, "_failure", [])
    t = torch.randn(5000)
    with caplog.at_level(logging.WARNING, logger="sdc_forensics.fingerprint"):
        fp = core.fingerprint(t)
    assert fp.digest == reference.digest_bytes(t.numpy())
    assert core.kernel_path("cpu").startswith("torch (the compiled kernel failed (OSError: cache file truncated)")
    assert any("cache file truncated" in r.getMessage() for r in caplog.records)


def test_cuda_path_refuses_dtypes_the_triton_kernel_does_not_take(monkeypatch):
    from sdc_forensics.fingerprint import triton_kernel

    monkeypatch.setattr(triton_kernel, "available", lambda device: (True, ""))
    assert core.kernel_path("cuda", torch.float32) == "triton-cuda"
    assert core.kernel_path("cuda", torch.int64) == "torch (the Triton kernel does not take int64)"


@pytest.mark.parametrize("count", [0, 1, 6, 600])
def test_combine_digests_is_the_digest_of_the_words_on_both_paths(monkeypatch, count):
    digests = [int(d) for d in np.random.default_rng(count).integers(0, 2**63, count, dtype=np.int64)] + [2**64 - 1] * (
        count > 0
    )
    expected = reference.digest_bytes(np.asarray(digests, dtype="<u8"))
    assert core.combine_digests(digests) == expected
    monkeypatch.setenv(cpu_kernel.KERNELS_ENV, "off")
    assert core.combine_digests(digests) == expected
