"""Fingerprints that add across shards (``fingerprint/shards.py``): however a parameter or a model is
cut (FSDP2's uneven ``Shard(0)``, DDP buckets, fewer devices), the pieces combine to one digest."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import core, shards
from tests.factories import gloo_job

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8)


def _values(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(0, 250, (n,), generator=gen, dtype=dtype)


def _sketch_bound(t: torch.Tensor) -> float:
    """Per coordinate: float32 block sums of at most 1024 terms on each side (``docs/fingerprints.md``)."""
    return 8 * 2.0**-24 * math.sqrt(1024) * float(t.double().norm())


def _cuts(n: int, pieces: int, rng: np.random.Generator) -> list[int]:
    return sorted({0, n, *rng.integers(0, n + 1, size=pieces - 1).tolist()})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1023, 1024, 2049, 5000, 70001])
def test_the_pieces_of_a_tensor_however_cut_combine_to_its_fingerprint(dtype, n):
    gen = torch.Generator().manual_seed(n)
    rng = np.random.default_rng(n)
    t = _values(dtype, n, gen)
    whole = core.fingerprint(t) if dtype.is_floating_point else None
    digest = core.digest(t)
    for pieces in (1, 2, 3, 4, 7):
        cuts = _cuts(n, pieces, rng)
        parts = [shards.fingerprint_piece(t[a:b], offset=a) for a, b in zip(cuts, cuts[1:])]
        rng.shuffle(parts)  # the order pieces arrive in does not matter
        got = shards.combine_pieces(parts)
        assert got.digest == digest, f"cuts {cuts}"
        assert got.numel == n
        if whole is not None:
            assert np.max(np.abs(got.sketch - whole.sketch)) <= _sketch_bound(t), f"cuts {cuts}"
            assert got.norm == pytest.approx(whole.norm, rel=1e-5)
            assert got.max_abs == whole.max_abs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_pieces_at_layout_offsets_combine_to_the_kernels_own_lanes_and_sketch(dtype):
    """Against core.fingerprint with both block offsets directly, not only pieces against pieces."""
    t = _values(dtype, 9000, torch.Generator().manual_seed(4))
    d, s = 37, 11  # a parameter that starts at digest block 37 and sketch block 11 of the layout
    direct = core.fingerprint(t, digest_block_offset=d, block_offset=s)
    cuts = [0, 1, 2500, 4097, 9000]
    got = shards.combine_pieces(
        shards.fingerprint_piece(t[a:b], offset=a, digest_base=d, sketch_base=s) for a, b in zip(cuts, cuts[1:])
    )
    assert got.lanes == direct.lanes
    assert np.max(np.abs(got.sketch - direct.sketch)) <= _sketch_bound(t)


def test_every_cut_point_of_a_bfloat16_tensor_gives_the_same_digest():
    """16-bit elements at odd offsets split a 32-bit word of the digest between two pieces."""
    t = _values(torch.bfloat16, 4099, torch.Generator().manual_seed(1))
    digest = core.digest(t)
    for cut in [1, 2, 3, 1023, 2047, 2048, 2049, 4095, 4097, 4098]:
        parts = [shards.fingerprint_piece(t[:cut], offset=0), shards.fingerprint_piece(t[cut:], offset=cut)]
        assert shards.combine_pieces(parts).digest == digest, cut


def test_a_flipped_bit_in_any_piece_changes_the_combined_digest():
    t = _values(torch.float32, 5000, torch.Generator().manual_seed(2))
    cuts = [0, 1500, 3333, 5000]
    clean = shards.combine_pieces(shards.fingerprint_piece(t[a:b], offset=a) for a, b in zip(cuts, cuts[1:])).digest
    for index in (0, 1499, 1500, 3332, 4999):
        for bit in (0, 22, 31):
            bad = t.clone()
            bad.view(torch.int32)[index] ^= 1 << bit if bit < 31 else -(1 << 31)
            got = shards.combine_pieces(shards.fingerprint_piece(bad[a:b], offset=a) for a, b in zip(cuts, cuts[1:]))
            assert got.digest != clean, (index, bit)
            assert got.digest == core.digest(bad)


def test_nan_and_inf_in_a_piece_are_counted_and_win_the_max():
    t = torch.ones(3000)
    t[10], t[2500] = math.inf, math.nan
    got = shards.combine_pieces(
        [shards.fingerprint_piece(t[:1200], offset=0), shards.fingerprint_piece(t[1200:], offset=1200)]
    )
    assert got.nonfinite == 2 and math.isnan(got.max_abs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(37, 129), torch.nn.ReLU(), torch.nn.LayerNorm(129), torch.nn.Linear(129, 5)
    )


def _chunk_pieces(model: torch.nn.Module, layout: shards.ParamLayout, world: int, *, replica_prefix: str = "") -> list:
    """Every rank's pieces of an FSDP2-style ``Shard(0)``: ``torch.chunk`` of dim 0, uneven at the end."""
    parts = []
    for name, p in model.named_parameters():
        d, s = layout.bases(replica_prefix + name)
        row = p.numel() // p.shape[0]
        start = 0
        for piece in torch.chunk(p.detach(), world, dim=0):
            parts.append(shards.fingerprint_piece(piece, offset=start * row, digest_base=d, sketch_base=s))
            start += piece.shape[0]
    return parts


def _bucket_pieces(model: torch.nn.Module, layout: shards.ParamLayout, bucket_elems: int) -> list:
    """DDP-style: parameters in reverse order copied into flat buckets, each fingerprinted as views."""
    params = list(model.named_parameters())[::-1]
    parts, bucket, used = [], [], 0
    for name, p in params + [(None, None)]:
        if p is None or (used + p.numel() > bucket_elems and bucket):
            flat = torch.cat([q.detach().reshape(-1) for _, q in bucket])
            at = 0
            for n2, q in bucket:
                d, s = layout.bases(n2)
                parts.append(
                    shards.fingerprint_piece(flat[at : at + q.numel()], offset=0, digest_base=d, sketch_base=s)
                )
                at += q.numel()
            bucket, used = [], 0
        if p is not None:
            bucket.append((name, p))
            used += p.numel()
    return parts


def test_a_model_cut_by_ranks_or_by_buckets_has_one_fingerprint():
    model = _model()
    layout = shards.ParamLayout.of(model.named_parameters())
    whole = shards.combine_pieces(shards.model_pieces(model.named_parameters(), layout).values())
    norm = math.sqrt(sum(float(p.detach().double().norm()) ** 2 for p in model.parameters()))
    for parts in [_chunk_pieces(model, layout, w) for w in (2, 3, 4, 7)] + [
        _bucket_pieces(model, layout, b) for b in (100, 5000)
    ]:
        got = shards.combine_pieces(parts)
        assert got.digest == whole.digest
        assert np.max(np.abs(got.sketch - whole.sketch)) <= 8 * 2.0**-24 * 32 * norm * 2
    # the layout keys the terms by parameter: two parameters' values exchanged change the digest
    swapped = _model()
    with torch.no_grad():
        a, b = swapped[2].weight, swapped[2].bias
        tmp = a.detach().clone()
        a.copy_(b)
        b.copy_(tmp)
    moved = shards.combine_pieces(shards.model_pieces(swapped.named_parameters(), layout).values())
    assert moved.digest != whole.digest


def test_wrapper_names_share_the_layout_of_the_bare_model():
    model = _model()
    bare = shards.ParamLayout.of(model.named_parameters())
    ddp_names = [(f"module.{n}", p) for n, p in model.named_parameters()]
    compiled = [(f"_orig_mod.{n}", p) for n, p in model.named_parameters()]
    fsdp1 = [(n.replace(".", "._fsdp_wrapped_module.", 1), p) for n, p in model.named_parameters()]
    for named in (ddp_names, compiled, fsdp1):
        assert shards.ParamLayout.of(named) == bare
    assert shards.canonical_name("encoder.module.weight") == "encoder.module.weight"  # a user's own "module" stays


def test_a_piece_and_a_layout_survive_json():
    model = _model()
    layout = shards.ParamLayout.of(model.named_parameters())
    assert shards.ParamLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    parts = _chunk_pieces(model, layout, 3)
    again = [shards.Piece.from_json(json.loads(json.dumps(p.to_json()))) for p in parts]
    a, b = shards.combine_pieces(parts), shards.combine_pieces(again)
    assert a.digest == b.digest and np.array_equal(a.sketch, b.sketch)


def test_pieces_of_different_seeds_refuse_to_combine():
    t = torch.ones(10)
    with pytest.raises(ValueError, match="seeds"):
        shards.combine_pieces([shards.fingerprint_piece(t[:5]), shards.fingerprint_piece(t[5:], offset=5, seed=7)])


# ---------------------------------------------------------------- a real fully_shard job, 4 processes


def _fsdp_pieces(world: int, hsdp: bool) -> list:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = _model()
    layout = shards.ParamLayout.of(model.named_parameters())
    kwargs = {}
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[3]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    pieces = shards.model_pieces(model.named_parameters(), layout)
    gathered = [None] * world
    dist.all_gather_object(gathered, {n: p.to_json() for n, p in pieces.items()})
    return gathered


def _fsdp_job(rank: int, world: int) -> dict:
    return {"fsdp4": _fsdp_pieces(world, hsdp=False), "hsdp2x2": _fsdp_pieces(world, hsdp=True)}


def test_fully_shard_pieces_on_every_rank_combine_to_the_single_process_fingerprint(tmp_path):
    """FSDP over 4 ranks, and HSDP 2 x 2 (each replica's shards; the same shard in both replicas)."""
    found = gloo_job(_fsdp_job, 4, tmp_path, 4)[0]
    model = _model()
    layout = shards.ParamLayout.of(model.named_parameters())
    whole = shards.combine_pieces(shards.model_pieces(model.named_parameters(), layout).values())
    for job, gathered in found.items():
        per_rank = [{n: shards.Piece.from_json(p) for n, p in rank.items()} for rank in gathered]
        replicas = [[0, 1], [2, 3]] if job == "hsdp2x2" else [[0, 1, 2, 3]]
        for group in replicas:  # HSDP: each replica's shards make the whole model
            got = shards.combine_pieces(p for r in group for p in per_rank[r].values())
            assert got.digest == whole.digest, job
        if job == "hsdp2x2":  # the same shard in the two replicas is the same piece
            for name in per_rank[0]:
                assert per_rank[0][name].to_json() == per_rank[2][name].to_json()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cut_ends_numbers_agree_on_the_numpy_and_the_device_path(dtype):
    """CPU pieces take numpy for their cut ends, other devices torch ops: the same numbers."""
    for with_nan in (False, True) if dtype.is_floating_point else (False,):
        values = _values(dtype, 700, torch.Generator().manual_seed(3))
        if with_nan:
            values[5] = math.nan
        # float64 sums of at most 4096 terms in two orders: each within 4096 * 2**-53 * sum|x| (and sum x**2)
        finite = values.double()[torch.isfinite(values.double())] if dtype.is_floating_point else torch.zeros(1)
        scale = float(finite.abs().sum() + finite.square().sum())
        align = shards.align_elems(values.element_size())
        for pos in (0, 1, align - 700):
            cpu, blocks = shards._end_numbers_numpy(values, pos, align, 5 * align, 17, 8, 0)
            dev, blocks2 = shards._end_numbers_torch(values, pos, align, 5 * align, 17, 8, 0)
            assert blocks == blocks2
            mod = [(x[: 2 * blocks].astype(np.int64) & 0xFFFF_FFFF) for x in (cpu, dev)]  # sums mod 2**32: exact
            assert np.array_equal(*mod)
            np.testing.assert_allclose(
                cpu[2 * blocks :], dev[2 * blocks :], rtol=0, atol=4096 * 2.0**-53 * scale + 0.0, equal_nan=True
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_cut_ends_agree_with_numpy_and_give_fingerprint_piece_its_numbers(dtype):
    """With the compiled kernel, a pass's cut ends are one call (``_compiled_ends``): the digest's
    block sums are numpy's exactly (wrapping sums), the sketch and stats within the float64
    rounding of two summation orders over at most ``align`` terms; and ``fingerprint_piece`` (one
    piece) gives the same numbers, bit for bit, as ``fingerprint_pieces`` (a batch of them)."""
    if not shards.cpu_kernel.available()[0]:
        pytest.skip("compiled CPU kernel unavailable")
    gen = torch.Generator().manual_seed(5)
    align = shards.align_elems(torch.empty(0, dtype=dtype).element_size())
    ends = []
    for n, pos, first in ((700, 0, 5 * align), (1, align - 1, 0), (align - 3, 3, 2 * align), (align, 0, align)):
        values = _values(dtype, n, gen)
        if dtype.is_floating_point and n == 700:
            values[9] = math.nan
        ends.append((values, pos, first, 3, 17))
    compiled = shards._batched_ends(ends, align, 8, 0)
    for (values, pos, first, digest_base, sketch_base), got in zip(ends, compiled):
        host, blocks = shards._end_numbers_numpy(values, pos, align, first, sketch_base, 8, 0)
        first_block = digest_base + first * values.element_size() // (4 * 1024)
        assert got.edges == {
            first_block + i: (int(host[i]) & 0xFFFF_FFFF, int(host[blocks + i]) & 0xFFFF_FFFF) for i in range(blocks)
        }
        if not dtype.is_floating_point:
            assert not got.sketch.any() and got.sumsq == 0.0
            continue
        finite = values.double()[torch.isfinite(values.double())]
        scale = float(finite.abs().sum() + finite.square().sum())
        tail = host[2 * blocks :]
        numbers = np.concatenate([got.sketch, [got.sumsq, got.max_abs, got.nonfinite]])
        # two float64 summation orders over at most `align` terms: each within (align - 1) * 2**-53 * sum|terms|
        np.testing.assert_allclose(numbers, tail, rtol=0, atol=2 * align * 2.0**-53 * scale, equal_nan=True)
    # one piece alone, and the same piece in a batch: the same bits
    flat = _values(dtype, 3 * align + 77, gen)
    items = [(flat[: align + 5], 11, 0, 0), (flat[align + 5 :], align + 16, 0, 0), (flat[:40], 2 * align - 20, 4, 9)]
    batch = shards.fingerprint_pieces(items, k=8, seed=0)
    for (values, offset, digest_base, sketch_base), piece in zip(items, batch):
        one = shards.fingerprint_piece(
            values, offset=offset, digest_base=digest_base, sketch_base=sketch_base, k=8, seed=0
        )
        assert one.to_json() == piece.to_json()
