"""``core.fingerprints_async``: many tensors in one compiled call give each tensor's own numbers.

Each batched fingerprint is held, bit for bit, to the numpy reference (``reference.digest_bytes``
and ``reference.sketch_stats_in_kernel_order``, the kernel's order of roundings stated in numpy),
and to the one-tensor path; the batch mixes dtypes, sizes around every row, tile and block edge,
sketch and digest block offsets, views (odd storage offsets, strides), NaN/Inf, empty tensors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import core, cpu_kernel, reference

pytestmark = pytest.mark.skipif(
    not cpu_kernel.available()[0], reason=f"compiled CPU kernel unavailable: {cpu_kernel.available()[1]}"
)

SIZES = [1, 3, 1023, 1024, 1025, 2049, 8191, 8192, 8193, 3 * 8192 + 1000]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16) if t.element_size() == 2 else t.numpy()


def _same_bits(a, b) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    a, b = np.atleast_1d(np.asarray(a, dtype=np.float64)), np.atleast_1d(np.asarray(b, dtype=np.float64))
    both_nan = np.isnan(a) & np.isnan(b)
    return a.shape == b.shape and bool(np.all(both_nan | (a.view(np.int64) == b.view(np.int64))))


def _batch(seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    tensors = []
    for index, numel in enumerate(SIZES * 2):
        dtype = DTYPES[(index + seed) % len(DTYPES)]
        values = torch.from_numpy(rng.standard_normal(numel + 70) * 10.0 ** rng.uniform(-3, 3)).to(dtype)
        kind = index % 3
        # a plain tensor, a view at an odd storage offset, a strided view
        if kind == 0:
            tensors.append(values[:numel].clone())
        elif kind == 1:
            tensors.append(values[1 : 1 + numel])
        else:
            tensors.append(torch.cat([values, values])[: 2 * numel : 2])
    tensors[4][7] = float("nan")
    tensors[9][0] = float("inf")
    tensors.append(torch.zeros(0))
    return tensors


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 8])
def test_batched_equals_reference_and_one_by_one(seed, k):
    tensors = _batch(seed)
    rng = np.random.default_rng(100 + seed)
    offsets = [int(o) for o in rng.integers(0, 3000, len(tensors))]
    # a digest is finished only from block 0 (a piece's lanes add, fingerprint/shards.py): half from there
    digest_offsets = [int(o) if i % 2 else 0 for i, o in enumerate(rng.integers(0, 40, len(tensors)))]
    many = core.resolve(
        core.fingerprints_async(
            tensors, k=k, seed=seed + 11, block_offsets=offsets, digest_block_offsets=digest_offsets
        )
    )
    assert len(many) == len(tensors)
    for fp, t, offset, digest_offset in zip(many, tensors, offsets, digest_offsets):
        flat = t.contiguous().reshape(-1)
        wide = flat.float() if flat.element_size() == 2 else flat
        sketch, sumsq, max_abs, nonfinite = reference.sketch_stats_in_kernel_order(wide.numpy(), k, seed + 11, offset)
        if digest_offset == 0:
            assert fp.digest == reference.digest_bytes(_bits(flat), seed + 11)
        assert _same_bits(fp.sketch, sketch)
        assert _same_bits(fp.norm, np.sqrt(sumsq))
        assert _same_bits(fp.max_abs, max_abs)
        assert fp.nonfinite == nonfinite and fp.numel == t.numel()
        one = core.fingerprint(t, k=k, seed=seed + 11, block_offset=offset, digest_block_offset=digest_offset)
        assert fp.lanes == one.lanes


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_under_a_row_sum_only_their_strips_and_keep_the_references_bits(dtype):
    """A pass over fewer than 1,024 elements finishes over the strips it touched only: the same
    bits as the reference's sums over every lane, signed zeros and cancellations included."""
    values = [
        [-0.0] * 5,
        [0.0],
        [1.5, -1.5],
        [-0.0, 0.0, -0.0],
        [3.0] * 255 + [-3.0] * 255,
        list(np.random.default_rng(1).standard_normal(700)),
        [1e-30, -1e-30, 2.0, -2.0] * 64 + [-0.0] * 7,
        [float("nan"), -0.0],
        [float("-inf"), 1.0],
    ]
    tensors = [torch.tensor(v, dtype=torch.float64).to(dtype) for v in values]
    for k in (1, 8):
        many = core.resolve(core.fingerprints_async(tensors, k=k, seed=3))
        for fp, t in zip(many, tensors):
            wide = t.float() if t.element_size() == 2 else t
            sketch, sumsq, max_abs, nonfinite = reference.sketch_stats_in_kernel_order(wide.numpy(), k, 3, 0)
            assert _same_bits(fp.sketch, sketch), (t, fp.sketch, sketch)
            assert _same_bits(fp.norm, np.sqrt(sumsq)) and _same_bits(fp.max_abs, max_abs)
            assert fp.nonfinite == nonfinite
            assert fp.digest == reference.digest_bytes(_bits(t), 3)


def test_without_digest_and_defaults():
    tensors = _batch(5)[:6]
    many = core.resolve(core.fingerprints_async(tensors, with_digest=False))
    for fp, t in zip(many, tensors):
        one = core.fingerprint(t, with_digest=False)
        assert fp.digest == 0 and fp.lanes is None
        assert _same_bits(fp.sketch, one.sketch) and _same_bits(fp.norm, one.norm)


def test_offsets_must_match_the_tensors():
    with pytest.raises(ValueError, match="one entry per tensor"):
        core.fingerprints_async([torch.ones(3)], block_offsets=[0, 1])


def test_torch_path_when_kernels_are_off(monkeypatch):
    tensors = _batch(2)[:5]
    expected = [core.fingerprint(t).digest for t in tensors]
    monkeypatch.setenv(cpu_kernel.KERNELS_ENV, "off")
    assert [fp.digest for fp in core.resolve(core.fingerprints_async(tensors))] == expected


@pytest.mark.parametrize("seed", range(3))
def test_many_digests_in_one_call_equal_each_digest(seed):
    """``core.digests`` takes aligned CPU tensors in one compiled call: each is ``core.digest``'s
    (and the numpy reference's) value, views, odd offsets and every block edge included."""
    tensors = _batch(seed)[:-1] + [torch.arange(7, dtype=torch.int64), torch.ones(5, dtype=torch.bool)]
    got = core.digests(tensors, seed + 3)
    for value, t in zip(got, tensors):
        assert value == core.digest(t, seed + 3)
        flat = t.contiguous().reshape(-1)
        assert value == reference.digest_bytes(core._raw_bytes(flat).numpy(), seed + 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_weights_summary_is_the_per_tensor_fingerprints_combined(dtype):
    """A DDP step's weights pass in one call: the digest, norm and NaN/Inf count of the
    one-tensor fingerprints combined in order (the general path takes a NaN, several dtypes)."""
    rng = np.random.default_rng(4)
    tensors = [torch.from_numpy(rng.standard_normal(n)).to(dtype) for n in (64, 1, 1024, 8193, 3 * 4096 + 5, 640)]

    def combined(ts):
        done = [core.fingerprint(t, k=1) for t in ts]
        total = float(np.sqrt(sum(fp.norm * fp.norm for fp in done)))
        return core.combine_digests([fp.digest for fp in done]), total, sum(fp.nonfinite for fp in done)

    assert core.weights_summary(tensors) == combined(tensors)
    mixed = tensors[:3] + [tensors[3].double()]
    assert core.weights_summary(mixed) == combined(mixed)
    tensors[2][5] = float("nan")
    digest, norm, nonfinite = core.weights_summary(tensors)
    assert digest == combined(tensors)[0] and math.isnan(norm) and nonfinite == 1


def test_a_failed_batched_call_falls_back_to_one_call_each(monkeypatch):
    """The compiled batch raising (a broken compile, say) loses no fingerprint: one call each."""
    if not cpu_kernel.available()[0]:
        pytest.skip("the compiled CPU kernel is not available")
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 1025, 3000)]
    one = core.resolve([core.fingerprint_async(t, k=8) for t in tensors])

    def broken(*args, **kwargs):
        raise RuntimeError("no batch here")

    monkeypatch.setattr(cpu_kernel, "partials_many", broken)
    monkeypatch.setattr(core, "_compiled_failed", lambda exc: None)
    many = core.resolve(core.fingerprints_async(tensors, k=8))
    assert [(a.digest, a.sketch.tolist(), a.norm) for a in many] == [(b.digest, b.sketch.tolist(), b.norm) for b in one]


def _chunk_rows_by_list(tensor: torch.Tensor, parts: int, k: int) -> np.ndarray:
    """The rows the FSDP check built before ``chunk_rows``: each chunk's resolved fingerprint."""
    chunks = tensor.reshape(-1).chunk(parts)
    done = core.resolve(core.fingerprints_async(chunks, k=k, with_digest=False))
    return np.array([[*fp.sketch, fp.norm, fp.nonfinite] for fp in done], dtype=np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 3, 8, 64])
def test_chunk_rows_are_the_chunks_fingerprints_bit_for_bit(dtype, parts):
    # chunk lengths around the row and tile edges, NaN and Inf in a few chunks, tiny and huge values
    rng = np.random.default_rng(parts)
    for length in (2, 1024, 1026, 8192 + 6):
        values = torch.from_numpy(rng.standard_normal(parts * length) * 10.0 ** rng.uniform(-3, 3, parts * length))
        tensor = values.to(dtype)
        tensor[length // 2] = float("nan")
        if parts > 2:
            tensor[2 * length] = float("inf")
            tensor[2 * length + 1] = float("-inf")
        rows = core.chunk_rows(tensor, parts, k=8)
        assert rows is not None and rows.shape == (parts, 10)
        assert _same_bits(rows, _chunk_rows_by_list(tensor, parts, 8)), (dtype, parts, length)
        assert rows[0, 9] == 1 and (parts <= 2 or rows[2, 9] == 2)


def test_chunk_rows_leaves_what_it_cannot_take_to_the_list():
    assert core.chunk_rows(torch.ones(10), 3) is None  # 3 does not divide 10
    assert core.chunk_rows(torch.ones(0), 2) is None
    assert core.chunk_rows(torch.ones(12, dtype=torch.bfloat16), 4) is None  # 3 16-bit words: odd addresses
    assert core.chunk_rows(torch.ones(13)[1:], 4) is not None  # an offset view, 4-byte aligned
    assert core.chunk_rows(torch.ones(24)[::2], 4) is None  # not contiguous
    assert core.chunk_rows(torch.ones(8, dtype=torch.int32), 2) is None  # no sketch of integers here


def test_a_failed_chunk_call_leaves_the_chunks_to_the_list(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cpu_kernel, "many_at", broken)
    monkeypatch.setattr(core, "_compiled_failed", lambda exc: None)
    assert core.chunk_rows(torch.ones(16), 4) is None
