"""The exact digest: torch == numpy reference bit for bit, and every single-bit flip, swap and
permutation changes it. The reference digests the bytes numpy lays out in C order, so the
non-contiguous cases check the torch side's handling of strides and storage offsets too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import core, reference

#: every test here runs on the compiled CPU kernel and on the torch fallback (tests/fingerprint/conftest.py)
pytestmark = pytest.mark.usefixtures("cpu_path")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool]
SIZES = [0, 1, 3, 1023, 1024, 1025, 4096 + 7, 300_001]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
def test_digest_matches_reference_contiguous(make_bits, dtype, numel):
    bits, tensor = make_bits((numel,), dtype, seed=numel)
    assert core.digest(tensor) == reference.digest_bytes(bits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_digest_matches_reference_non_contiguous(make_bits, dtype):
    bits, tensor = make_bits((67, 129), dtype, seed=5)
    cases = {
        "transposed": (bits.T, tensor.t()),
        "column slice": (bits[:, 3:70], tensor[:, 3:70]),
        "row stride": (bits[1::2], tensor[1::2]),
        "odd offset": (bits.reshape(-1)[1:], tensor.reshape(-1)[1:]),  # 2-byte offset for 16-bit
        "odd offset, partial word": (bits.reshape(-1)[3:1030], tensor.reshape(-1)[3:1030]),
    }
    for name, (bits_view, tensor_view) in cases.items():
        assert tensor_view.storage_offset() or not tensor_view.is_contiguous() or name == "transposed"
        assert core.digest(tensor_view) == reference.digest_bytes(np.ascontiguousarray(bits_view)), name


def test_digest_of_zero_dim_and_shape_blind(make_bits):
    bits, tensor = make_bits((6, 4), torch.float32, seed=1)
    assert core.digest(tensor) == core.digest(tensor.reshape(24)) == core.digest(tensor.reshape(3, 8))
    scalar = torch.tensor(1.5)
    assert core.digest(scalar) == reference.digest_bytes(np.array([1.5], dtype=np.float32))


def test_digest_depends_on_length_and_seed():
    zeros = torch.zeros(1024)
    assert core.digest(zeros) != core.digest(torch.zeros(1025))
    assert core.digest(zeros[:0]) != core.digest(torch.zeros(1))
    assert core.digest(zeros, seed=1) != core.digest(zeros, seed=2)


def _flip(bits: np.ndarray, index: int, bit: int) -> np.ndarray:
    out = bits.copy()
    out[index] ^= out.dtype.type(1) << out.dtype.type(bit)
    return out


@pytest.mark.parametrize("dtype, num_bits", [(torch.float32, 32), (torch.bfloat16, 16)], ids=["float32", "bfloat16"])
def test_every_single_bit_flip_changes_digest(make_bits, bits_to_tensor, dtype, num_bits):
    # 3 full blocks and a partial one (in 32-bit words), so the tail path is swept too.
    numel = (3 * 1024 + 517) * 4 // (num_bits // 8)
    bits, tensor = make_bits((numel,), dtype, seed=11)
    base = core.digest(tensor)
    rng = np.random.default_rng(12)
    for bit in range(num_bits):
        indices = np.concatenate([[0, numel - 1], rng.choice(numel, size=24, replace=False)])
        for index in indices:
            flipped = core.digest(bits_to_tensor(_flip(bits, int(index), bit), dtype))
            assert flipped != base, (bit, index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swapping_two_unequal_elements_changes_digest(dtype):
    torch.manual_seed(3)
    tensor = torch.randn(5000).to(dtype)
    base = core.digest(tensor)
    pairs = [(0, 1), (0, 1024), (5, 4999), (1023, 1024), (100, 3000), (2047, 2048)]
    for i, j in pairs:
        assert tensor[i] != tensor[j]
        swapped = tensor.clone()
        swapped[i], swapped[j] = tensor[j], tensor[i]
        assert core.digest(swapped) != base, (i, j)


def test_permutation_changes_digest():
    torch.manual_seed(4)
    tensor = torch.randn(8192)
    base = core.digest(tensor)
    for _ in range(5):
        assert core.digest(tensor[torch.randperm(tensor.numel())]) != base
    blocks = tensor.view(8, 1024)
    assert core.digest(blocks.flip(0)) != base  # whole blocks reordered
    assert core.digest(tensor.roll(1)) != base


def test_swap_of_x_and_minus_x_in_one_block_changes_digest():
    # The words differ in the sign bit only: the low lane cannot see it ((a_i - a_j) * 2**31 = 0
    # mod 2**32); the high lane sees (b_i - b_j) * 2**15, never 0 mod 2**32.
    tensor = torch.ones(2048)
    tensor[7] = -1.0
    for j in (8, 900, 1023):
        swapped = tensor.clone()
        swapped[7], swapped[j] = 1.0, -1.0
        assert core.digest(swapped) != core.digest(tensor), j


def test_two_flips_of_the_same_bit_in_one_block_change_digest():
    # Two flips of bit p in words i and j move the low lane by 2**p (+-a_i +- a_j): for the sign
    # bit that is 0 mod 2**32, for any p the high lane or the low lane still moves.
    torch.manual_seed(8)
    tensor = torch.randn(1024)
    base = core.digest(tensor)
    words = tensor.view(torch.int32)
    gen = torch.Generator().manual_seed(9)
    for bit in range(32):
        for _ in range(20):
            i, j = torch.randperm(1024, generator=gen)[:2].tolist()
            flipped = words.clone()
            mask = torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
            flipped[i] ^= mask
            flipped[j] ^= mask
            assert core.digest(flipped.view(torch.float32)) != base, (bit, i, j)


def test_swaps_of_words_differing_only_in_high_bits_change_digest():
    gen = torch.Generator().manual_seed(10)
    words = torch.randint(-(2**31), 2**31 - 1, (1024,), dtype=torch.int32, generator=gen)
    for _ in range(500):
        i, j = torch.randperm(1024, generator=gen)[:2].tolist()
        delta = int(torch.randint(1, 1 << 10, (1,), generator=gen)) << 22  # low 22 bits equal
        a = words.clone()
        other = (int(a[i]) & 0xFFFF_FFFF) ^ delta  # the same word with some of its top 10 bits flipped
        a[j] = other - (1 << 32) if other >= (1 << 31) else other
        b = a.clone()
        b[i], b[j] = a[j], a[i]
        assert core.digest(a) != core.digest(b), (i, j, delta)


def test_equal_tensors_give_equal_digests_whatever_their_layout():
    torch.manual_seed(6)
    tensor = torch.randn(33, 65)
    copy = tensor.t().contiguous().t()  # same values, column-major storage
    assert not copy.is_contiguous()
    assert core.digest(copy) == core.digest(tensor)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_digest_cuda_equals_cpu(make_bits, dtype):
    for numel in (0, 1, 1025, 300_001, (1 << 24) + 5):
        bits, tensor = make_bits((numel,), dtype, seed=numel)
        assert core.digest(tensor.cuda()) == core.digest(tensor) == reference.digest_bytes(bits)
    bits, tensor = make_bits((67, 129), dtype, seed=2)
    assert core.digest(tensor.cuda().t()) == core.digest(tensor.t())
    assert core.digest(tensor.cuda().reshape(-1)[1:]) == core.digest(tensor.reshape(-1)[1:])


def test_batched_digests_equal_one_by_one():
    torch.manual_seed(11)
    tensors = [
        torch.randn(5000),
        torch.randn(3, 7).to(torch.bfloat16),
        torch.empty(0),
        torch.randn(1025).t(),
        torch.arange(9),
    ]
    assert core.digests(tensors) == [core.digest(t) for t in tensors]
    assert core.digests(tensors) == [
        reference.digest_bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors
    ]
