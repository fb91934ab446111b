"""The test factories themselves: the gloo ring reference that simulated runs reduce with is
checked bit for bit against a real gloo ``all_reduce`` (so ``sim`` runs are anchored to gloo, not
to the package's ``replay.env.reduce_buckets``), and ``make_trace``'s two writers refuse what
they cannot write."""

from __future__ import annotations

import datetime
import hashlib
from pathlib import Path

import numpy as np
import pytest

from tests.factories import Fault, ddp_mean, free_port, gloo_ring_chunks, gloo_ring_sum
from sdc_forensics.demo import forked

#: Buffer sizes: less than one element per segment, sizes where a 16-byte cut and gloo's cut
#: differ (5, 6, 14, 4096, ...), the demo recipe's gradient (26 122), and 10 MB: more than two
#: 1 MiB segments per rank for W = 2, 3 and 4.
SIZES = (1, 3, 4, 5, 6, 14, 17, 1001, 4096, 26_122, 2_500_001)

#: Per W, one value per rank whose ring sums differ for every start rank: a buffer filled with
#: them shows, element by element, which rank gloo's summation started from.
PROBES = {3: (1.0, -1.0, 2.0**-24 * 1.25), 4: (1.0, 2.0**-24, 2.0**-24 * 1.5, -1.0)}


def _inputs(world_size: int, rank: int, numel: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s float32 buffers: random values spread over 2**-12..2**12 (the association
    order shows in the rounded bits) and, for W >= 3, the probe."""
    rng = np.random.default_rng([world_size, rank, numel])
    out = {"random": (rng.standard_normal(numel) * 2.0 ** rng.integers(-12, 13, numel)).astype(np.float32)}
    if world_size in PROBES:
        out["probe"] = np.full(numel, PROBES[world_size][rank], dtype=np.float32)
    return out


def _gloo_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One rank: SUM all-reduce of each buffer, and DDP's mean (times 1/W in torch, then SUM).
    Rank 0 saves its results; every rank saves their sha256, to show all ranks got the same."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    hashes = {}
    try:
        for numel in SIZES:
            for name, values in _inputs(world_size, rank, numel).items():
                summed = torch.from_numpy(values)
                mean = summed.clone()
                dist.all_reduce(summed)
                mean.mul_(1.0 / world_size)  # as DDP's bucket (sdc_forensics.recorder.hooks.mean_allreduce_hook)
                dist.all_reduce(mean)
                for kind, tensor in (("sum", summed), ("mean", mean)):
                    key = f"{kind}-{name}-{numel}"
                    hashes[key] = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
                    if rank == 0:
                        np.save(Path(out_dir) / f"{key}.npy", tensor.numpy())
    finally:
        dist.destroy_process_group()
    np.save(Path(out_dir) / f"hashes-{rank}.npy", np.array(sorted(hashes.items())))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_ring_reference_equals_a_real_gloo_all_reduce_bit_for_bit(tmp_path, world_size):
    forked.start(_gloo_worker, (world_size, free_port(), str(tmp_path)), world_size)
    hashes = [np.load(tmp_path / f"hashes-{r}.npy") for r in range(world_size)]
    assert all((h == hashes[0]).all() for h in hashes), "ranks got different results"
    for numel in SIZES:
        inputs = [_inputs(world_size, r, numel) for r in range(world_size)]
        for name in inputs[0]:
            buffers = [i[name] for i in inputs]
            for kind, reference in (("sum", gloo_ring_sum(buffers)), ("mean", ddp_mean(buffers))):
                got = np.load(tmp_path / f"{kind}-{name}-{numel}.npy")
                assert got.dtype == np.float32 and got.shape == (numel,)
                differ = np.flatnonzero(got.view(np.uint32) != reference.view(np.uint32))
                assert differ.size == 0, (
                    f"{kind} of {name}, W={world_size}, {numel} elements: {differ.size} differ, first {differ[:5]}"
                )


@pytest.mark.parametrize("world_size", sorted(PROBES))
def test_probe_values_tell_every_start_rank_apart(world_size):
    """The probe is what makes the gloo test see a wrong chunk boundary at any element."""
    probe = [np.full(1, v, dtype=np.float32) for v in PROBES[world_size]]
    sums = set()
    for start in range(world_size):  # rotate so that gloo_ring_sum's chunk 0 starts at rank `start`
        rotated = probe[start + 1 :] + probe[: start + 1]
        sums.add(gloo_ring_sum(rotated).view(np.uint32).item())
    assert len(sums) == world_size


def test_gloo_ring_reference_by_hand():
    a, b, c = (np.full(5, v, dtype=np.float32) for v in (1.0, 2.0**-24, -1.0))
    # 5 elements, W = 3: 6 segments of 1 element, chunks of 2: [0, 2), [2, 4), [4, 5)
    assert gloo_ring_chunks(5, 3) == [(0, 2), (2, 4), (4, 5)]
    out = gloo_ring_sum([a, b, c])
    # chunk 0 from rank 2 backwards: (c + b) + a = 2**-24 ; chunk 1 from rank 0: (a + c) + b = 2**-24 ;
    # chunk 2 from rank 1: (b + a) + c = 0 (1 + 2**-24 rounds to 1)
    np.testing.assert_array_equal(out, np.array([2.0**-24] * 4 + [0.0], dtype=np.float32))
    # a DDP bucket of 25 MiB on 4 ranks: 28 segments of 1 MiB at most, 7 per rank
    assert gloo_ring_chunks(25 << 18, 4)[:2] == [(0, 7 * 234_058), (7 * 234_058, 14 * 234_058)]
    assert gloo_ring_chunks(2, 4) == [(0, 2), (2, 2), (2, 2), (2, 2)]
    np.testing.assert_array_equal(gloo_ring_sum([a]), a)
    with pytest.raises(ValueError, match="same number"):
        gloo_ring_sum([a, a[:3]])


def test_make_trace_writers_refuse_what_they_cannot_write(make_trace):
    with pytest.raises(ValueError, match="bulk traces cannot plant"):
        make_trace(fault=Fault(kind="outlier", step=3), bulk=True)
    with pytest.raises(ValueError, match="no audits"):
        make_trace(audit_every=2, bulk=True)
    with pytest.raises(ValueError, match="only bulk traces add attempts"):
        make_trace(attempt=1, start_step=10)
