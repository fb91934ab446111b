"""The linear sketch and the stats: torch == numpy reference within rounding, pieces with
consecutive block offsets combine into the fingerprint of their concatenation, and the stats
(norm, max |x|, NaN/Inf count) are right, including for non-finite tensors.

Every tolerance here is a worst-case rounding bound derived from what ``core.fingerprint``
accumulates in which dtype, valid for *any* summation order a BLAS, cuBLAS or torch reduction may
use (machines differ in exactly that: AMD and Intel CPUs take different MKL paths). Worst-case
bounds are loose for long sums, so exactness is tested separately on data whose every partial sum
is an integer below 2**24, where any order is exact.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core, reference

#: every test here runs on the compiled CPU kernel and on the torch fallback (tests/fingerprint/conftest.py)
pytestmark = pytest.mark.usefixtures("cpu_path")

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
U32, U64 = 2.0**-24, 2.0**-53  # unit roundoff of float32 and float64


def _gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: ``|prod_{i<=n} (1 + d_i) - 1| <= gamma_n`` for
    ``|d_i| <= u`` (Accuracy and Stability of Numerical Algorithms, lemma 3.1); infinite once ``n u >= 1``."""
    return n * u / (1.0 - n * u) if n * u < 1.0 else math.inf


def _u_acc(dtype: torch.dtype) -> float:
    """The unit roundoff ``fingerprint`` accumulates in: float64 for float64 tensors, else float32
    (16-bit values widen to float32 exactly)."""
    return U64 if dtype == torch.float64 else U32


def _sketch_error_bound(values: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest ``|computed - exact|`` of a sketch coordinate, for any summation order.

    ``S_m = sum_i alpha_m[i] Y[m, i]`` with ``Y[m, i] = sum_j beta_m[j] x[j, i]`` over the
    ``(blocks, 1024)`` zero-padded view ``x``. In ``fingerprint`` the products ``+-x`` are exact and
    each ``Y`` entry is a sum in ``u_acc`` of at most ``R = min(blocks, BLOCK_ELEMS)`` terms (rows
    of one matmul group, ``core._project``): ``R - 1`` roundings in whatever order, so
    ``|err Y[m, i]| <= gamma_{R-1}(u_acc) sum_j |x[j, i]|`` (Higham, (3.4)). Group sums, chunk
    sums and the 1024-term ``alpha`` sum are float64 additions, fewer than ``blocks + 1024``
    roundings on any path; another 1024 cover combining up to 1024 pieces (``core.combine``).
    Summed over ``i`` with ``|alpha| = 1``:

        |err S_m| <= ((1 + gamma_{R-1}(u_acc)) (1 + gamma_{blocks+2048}(u64)) - 1) ||x||_1.

    The numpy reference (float64 throughout) is within ``gamma_{blocks+1024}(u64) ||x||_1``, less.
    """
    numel = values.numel()
    blocks = core.num_sketch_blocks(numel)
    rows_per_sum = min(blocks, C.BLOCK_ELEMS)
    l1 = float(values.double().abs().sum()) * (1.0 + _gamma(numel, U64))  # ||x||_1, bounded above
    return ((1.0 + _gamma(rows_per_sum - 1, _u_acc(dtype))) * (1.0 + _gamma(blocks + 2048, U64)) - 1.0) * l1


def _close(actual: np.ndarray, expected: np.ndarray, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Two computations of the sketch of ``values``, each within :func:`_sketch_error_bound`."""
    bound = 2.0 * _sketch_error_bound(values, dtype)
    assert np.abs(actual - expected).max() <= bound, (actual, expected, bound)


def _norm_rel_bound(numel: int, dtype: torch.dtype, chunk_elems: int) -> float:
    """Largest relative error of ``Fingerprint.norm``, for any summation order.

    ``fingerprint`` sums ``x**2`` per chunk of at most ``m = min(numel, chunk_elems)`` elements in
    ``u_acc`` (a BLAS dot or a torch reduction: ``m`` products and ``m - 1`` additions, each
    rounded once at most), then the ``c`` chunk sums in float64, then takes a float64 square root.
    Every term is ``>= 0``, so the sum's relative error is ``gamma`` of the roundings on any path:

        |S^ - S| <= d S,   d = (1 + gamma_m(u_acc)) (1 + gamma_c(u64)) - 1,

    and ``sqrt(1 + e) - 1 = e / (1 + sqrt(1 + e))`` gives ``|sqrt(S^) / sqrt(S) - 1| <= d / (1 +
    sqrt(1 - d))``, times ``(1 + u64)`` for the square root's rounding. (``m = 2**21`` float32
    terms allow 7.4%: worst cases are that loose; the exactness test below is the sharp one.)
    """
    m = min(max(numel, 1), chunk_elems)
    chunks = -(-max(numel, 1) // chunk_elems)
    d = (1.0 + _gamma(m, _u_acc(dtype))) * (1.0 + _gamma(chunks, U64)) - 1.0
    if d >= 1.0:
        return math.inf
    return (1.0 + d / (1.0 + math.sqrt(1.0 - d))) * (1.0 + U64) - 1.0


def _exact_norm_rel_bound(numel: int) -> float:
    """Relative error bound of the test's own reference ``tensor.double().norm()`` (float64 throughout)."""
    return _norm_rel_bound(numel, torch.float64, numel)


def _norms_close(a: float, b: float, rel_a: float, rel_b: float) -> None:
    """``a`` and ``b`` approximate one norm ``N`` within relative ``rel_a`` and ``rel_b``:
    ``|a - b| <= (rel_a + rel_b) N`` and ``N <= max(a, b) / (1 - max(rel_a, rel_b))``."""
    worst = max(rel_a, rel_b)
    assert worst < 1.0, "no finite bound for this size: compare exactly representable data instead"
    assert abs(a - b) <= (rel_a + rel_b) * max(a, b) / (1.0 - worst), (a, b, rel_a, rel_b)


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
    z = 3 * x - y
    sx, sy, sz = (core.fingerprint(t, with_digest=False).sketch for t in (x, y, z))
    # S is linear, so S(z) - 3 S(x) + S(y) = S(e) with e the rounding of z = fl(fl(3x) - y),
    # |e_i| <= gamma_2 (3|x_i| + |y_i|); each computed sketch is within its bound, and
    # fl(3 sx - sy) rounds twice more.
    g2 = _gamma(2, U64)
    bound = (
        _sketch_error_bound(z, torch.float64)
        + 3 * _sketch_error_bound(x, torch.float64)
        + _sketch_error_bound(y, torch.float64)
        + g2 * float(3 * x.abs().sum() + y.abs().sum()) * (1 + _gamma(x.numel() + 2, U64))
        + g2 * (3 * np.abs(sx) + np.abs(sy))
    )
    assert np.all(np.abs(sz - (3 * sx - sy)) <= bound), (sz, 3 * sx - sy, bound)
    assert np.abs(sz).min() > 1e6 * bound.max()  # the check is not vacuous


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
    # combine: sqrt(sum of squared piece norms) in float64, each piece within its own bound;
    # 2P + 2 float64 roundings more (squares, sum, square root)
    chunk = core._CPU_CHUNK_ELEMS
    rel_pieces = max(_norm_rel_bound(p.numel(), torch.float32, chunk) for p in pieces)
    rel_combined = (1 + rel_pieces) * (1 + _gamma(2 * len(pieces) + 2, U64)) - 1
    _norms_close(combined.norm, expected.norm, rel_combined, _norm_rel_bound(whole.numel(), torch.float32, chunk))
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
    _norms_close(
        fp.norm,
        float(exact.norm()),
        _norm_rel_bound(tensor.numel(), dtype, core._CPU_CHUNK_ELEMS),
        _exact_norm_rel_bound(tensor.numel()),
    )
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
    assert (
        large.digest
        == small.digest
        == reference.digest_bytes(tensor.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).numpy())
    )
    _close(large.sketch, small.sketch, tensor, dtype)
    assert large.max_abs == small.max_abs
    # float32 dots of up to 2 Mi squares: only 7.4% is provable for every order (the exactness
    # test below is the sharp check of this path); 1e-5 failed on an AMD EPYC (1.8e-5)
    _norms_close(
        large.norm,
        float(tensor.double().norm()),
        _norm_rel_bound(tensor.numel(), dtype, 1 << 21),
        _exact_norm_rel_bound(tensor.numel()),
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("chunk_elems", [None, 1 << 21], ids=["default-chunks", "grouped-matmul"])
def test_exactly_representable_data_gives_the_exact_sketch_and_norm(monkeypatch, dtype, chunk_elems):
    """Integers in [-2, 2]: every partial sum ``fingerprint`` forms is an integer below 2**24 in
    magnitude (a sketch entry sums at most 1024 terms of |x| <= 2; a chunk's sum of squares at
    most 2**21 terms of x**2 <= 4: 2**23), hence exact in float32 in any order, and every float64
    sum is exact too. So the sketch equals the reference and the norm is ``sqrt(sum x**2)``
    correctly rounded, to the last bit, on any machine: an element dropped, counted twice or
    given the wrong projection shows."""
    if chunk_elems is not None:
        monkeypatch.setattr(core, "_CPU_CHUNK_ELEMS", chunk_elems)
    assert 4 * min(core._CPU_CHUNK_ELEMS, 3 << 20) < 2**24 and 2 * C.BLOCK_ELEMS < 2**24
    gen = torch.Generator().manual_seed(11)
    ints = torch.randint(-2, 3, (3 * (1 << 20) + 5,), generator=gen)
    tensor = ints.to(dtype)
    fp = core.fingerprint(tensor)
    assert np.array_equal(fp.sketch, reference.sketch(ints.numpy()))
    assert fp.norm == math.sqrt(int(ints.square().sum()))
    assert fp.max_abs == 2.0 and fp.nonfinite == 0


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
        assert gpu.max_abs == cpu.max_abs
        rel_gpu = _norm_rel_bound(numel, dtype, core._CUDA_CHUNK_ELEMS)
        if rel_gpu < 1:  # a float32 sum of 2**24 squares has no worst-case bound: checked exactly below
            _norms_close(gpu.norm, cpu.norm, rel_gpu, _norm_rel_bound(numel, dtype, core._CPU_CHUNK_ELEMS))
    # {-1, 0, 1}: a CUDA slab's sum of squares is at most 2**24, so exact in any order (see above)
    ints = torch.randint(-1, 2, ((1 << 24) * 2 + 5,), generator=torch.Generator().manual_seed(10))
    for tensor in (ints.to(dtype), ints.to(dtype).cuda()):
        fp = core.fingerprint(tensor)
        assert fp.norm == math.sqrt(int(ints.square().sum())) and np.array_equal(
            fp.sketch, reference.sketch(ints.numpy())
        )
