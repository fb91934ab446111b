"""The linear sketch and the stats: torch == numpy reference within rounding, pieces with
consecutive block offsets combine into the fingerprint of their concatenation, and the stats
(norm, max |x|, NaN/Inf count) are right, including for non-finite tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core, reference

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _close(actual: np.ndarray, expected: np.ndarray, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Within float32 accumulation rounding (float64 for float64 tensors) of the reference."""
    u_acc = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    bound = 8 * u_acc * math.sqrt(C.BLOCK_ELEMS) * float(values.double().norm()) + 1e-300
    assert np.abs(actual - expected).max() <= bound, (actual, expected, bound)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 3, 1023, 1024, 1025, 4096 + 7, 300_001])
def test_sketch_matches_reference(dtype, numel):
    torch.manual_seed(numel)
    tensor = (torch.randn(numel, dtype=torch.float64) * torch.rand(numel, dtype=torch.float64).pow(4)).to(dtype)
    fp = core.fingerprint(tensor, with_digest=False)
    assert fp.sketch.shape == (C.DEFAULT_SKETCH_K,) and fp.sketch.dtype == np.float64
    _close(fp.sketch, reference.sketch(tensor.double().numpy()), tensor, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_sketch_of_non_contiguous_tensor_is_that_of_its_row_major_values(dtype):
    torch.manual_seed(1)
    base = torch.randn(129, 67).to(dtype)
    for view in (base.t(), base[3:, 5:60], base.reshape(-1)[1:]):
        expected = reference.sketch(view.double().contiguous().numpy())
        _close(core.fingerprint(view, with_digest=False).sketch, expected, view, dtype)


def test_sketch_k_and_seed():
    tensor = torch.randn(5000)
    fp16 = core.fingerprint(tensor, k=16, seed=9, with_digest=False)
    _close(fp16.sketch, reference.sketch(tensor.double().numpy(), k=16, seed=9), tensor, torch.float32)
    assert not np.allclose(fp16.sketch[:8], core.fingerprint(tensor, k=8, with_digest=False).sketch)


def test_sketch_is_linear():
    torch.manual_seed(2)
    x, y = torch.randn(10_000, dtype=torch.float64), torch.randn(10_000, dtype=torch.float64)
    sx, sy, sxy = (core.fingerprint(t, with_digest=False).sketch for t in (x, y, 3 * x - y))
    np.testing.assert_allclose(sxy, 3 * sx - sy, rtol=0, atol=1e-9)


def _concat_padded(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Concatenation with every piece zero-padded to whole sketch blocks (what offsets mean)."""
    padded = []
    for piece in pieces:
        pad = core.num_sketch_blocks(piece.numel()) * C.BLOCK_ELEMS - piece.numel()
        padded.append(torch.cat([piece, piece.new_zeros(pad)]))
    return torch.cat(padded)


def _fingerprint_pieces(pieces: list[torch.Tensor], **kwargs) -> list[core.Fingerprint]:
    parts, offset = [], 0
    for piece in pieces:
        parts.append(core.fingerprint(piece, block_offset=offset, **kwargs))
        offset += core.num_sketch_blocks(piece.numel())
    return parts


@pytest.mark.parametrize("sizes", [[1024, 3072, 2048, 500], [1000, 5, 4096 + 7, 1]])
def test_combine_of_block_offset_pieces_equals_fingerprint_of_concatenation(sizes):
    torch.manual_seed(3)
    pieces = [torch.randn(n) * (i + 1) for i, n in enumerate(sizes)]
    parts = _fingerprint_pieces(pieces)
    combined = core.combine(parts)
    whole = _concat_padded(pieces)
    expected = core.fingerprint(whole)
    _close(combined.sketch, expected.sketch, whole, torch.float32)
    assert combined.norm == pytest.approx(expected.norm, rel=1e-6)
    assert combined.max_abs == expected.max_abs and combined.nonfinite == 0
    assert combined.numel == sum(sizes)
    assert combined.digest == core.combine_digests([p.digest for p in parts])
    assert combined.digest != core.combine_digests([p.digest for p in reversed(parts)])
    # Without offsets the pieces would reuse the same projections: not the concatenation.
    unshifted = core.combine([core.fingerprint(p) for p in pieces])
    assert np.abs(unshifted.sketch - expected.sketch).max() > 1.0


def test_combine_adds_nonfinite_counts():
    pieces = [torch.ones(3000), torch.ones(100), torch.ones(2048)]
    pieces[0][5] = float("inf")
    pieces[2][[0, 2047]] = float("-inf")
    combined = core.combine(_fingerprint_pieces(pieces))
    assert combined.nonfinite == 3 and combined.max_abs == math.inf and combined.norm == math.inf
    pieces[1][50] = float("nan")
    combined = core.combine(_fingerprint_pieces(pieces))
    assert combined.nonfinite == 4 and math.isnan(combined.max_abs)


def test_combine_needs_parts():
    with pytest.raises(ValueError, match="at least one"):
        core.combine([])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_stats_of_finite_tensor(dtype):
    torch.manual_seed(4)
    tensor = (torch.randn(3, 70_000) * 3).to(dtype)
    fp = core.fingerprint(tensor)
    exact = tensor.double()
    assert fp.numel == tensor.numel() and fp.nonfinite == 0
    assert fp.norm == pytest.approx(float(exact.norm()), rel=1e-5)
    assert fp.max_abs == float(exact.abs().max())
    assert fp.digest == core.digest(tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_stats_count_nan_and_inf(dtype):
    tensor = torch.ones(5000, dtype=dtype)
    tensor[[3, 1024, 4999]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    fp = core.fingerprint(tensor)
    assert fp.nonfinite == 3 and math.isnan(fp.max_abs)
    tensor[3] = 1.0
    fp = core.fingerprint(tensor)
    assert fp.nonfinite == 2 and fp.max_abs == math.inf and fp.norm == math.inf


def test_stats_of_empty_and_zero_tensors():
    fp = core.fingerprint(torch.zeros(0))
    assert (fp.numel, fp.norm, fp.max_abs, fp.nonfinite) == (0, 0.0, 0.0, 0)
    assert not fp.sketch.any()
    assert core.fingerprint(torch.zeros(2000)).norm == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_chunks_use_grouped_matmul(monkeypatch, dtype):
    """CUDA-sized chunks (> 1024 blocks: batched matmul plus a remainder) give the same fingerprint."""
    torch.manual_seed(7)
    tensor = torch.randn(3 * (1 << 20) + 5).to(dtype)
    small = core.fingerprint(tensor)
    monkeypatch.setattr(core, "_CPU_CHUNK_ELEMS", 1 << 21)
    large = core.fingerprint(tensor)
    assert large.digest == small.digest == reference.digest_bytes(tensor.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy())
    _close(large.sketch, small.sketch, tensor, dtype)
    assert large.max_abs == small.max_abs
    assert large.norm == pytest.approx(float(tensor.double().norm()), rel=1e-5)  # float32 dots of 2 Mi elements


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("chunk_elems", [1 << 12, 1 << 20])
def test_fingerprint_digest_equals_digest_at_any_offset(monkeypatch, offset, chunk_elems):
    """The fused one-pass digest inside fingerprint() and digest() agree, aligned or not, in one
    chunk or many (the smallest legal chunk: one 4 KiB digest block of bytes)."""
    monkeypatch.setattr(core, "_CPU_CHUNK_ELEMS", chunk_elems)
    torch.manual_seed(8)
    base = torch.randn(5 * 4096 + 3000).to(torch.bfloat16)
    view = base[offset:]
    expected = reference.digest_bytes(view.contiguous().view(torch.int16).numpy())
    assert core.fingerprint(view).digest == core.digest(view) == expected
    _close(core.fingerprint(view).sketch, reference.sketch(view.double().numpy()), view, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_fingerprint_cuda_matches_cpu(dtype):
    torch.manual_seed(9)
    for numel in (1025, 300_001, (1 << 24) * 2 + 5):  # more than one CUDA slab, partial block
        tensor = torch.randn(numel).to(dtype)
        tensor[7] = float("inf")
        cpu, gpu = core.fingerprint(tensor, block_offset=3), core.fingerprint(tensor.cuda(), block_offset=3)
        assert gpu.digest == cpu.digest and gpu.nonfinite == cpu.nonfinite == 1 and gpu.max_abs == cpu.max_abs
        tensor[7] = 0.0
        cpu, gpu = core.fingerprint(tensor), core.fingerprint(tensor.cuda())
        _close(gpu.sketch, reference.sketch(tensor.double().numpy()), tensor, dtype)
        _close(gpu.sketch, cpu.sketch, tensor, dtype)
        assert gpu.norm == pytest.approx(cpu.norm, rel=1e-5) and gpu.max_abs == cpu.max_abs
