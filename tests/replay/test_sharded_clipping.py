"""``replay/clipping.py`` against real FSDP2: ``clip_grad_norm_`` on the DTensor parameters of
``fully_shard`` models (4 gloo ranks: FSDP over 4, HSDP 2 x 2), and the one-process recomputation
from the whole gradients, bit for bit: the total norm and every clipped gradient. The models have
parameters with fewer rows than shards (an empty shard; not with the inf-norm, which torch refuses
there) and rows that do not divide evenly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.factories import gloo_job

WORLD = 4
NORM_TYPES = (2.0, 1.0, math.inf)
SEEDS = range(4)


def _model(seed: int, empty_shard: bool) -> torch.nn.Module:
    """Rows over 4 shards: 129 (33, 33, 33, 30), 10 (3, 3, 3, 1); ``empty_shard``: 9 (3, 3, 3, 0)."""
    torch.manual_seed(seed)
    rows = 9 if empty_shard else 10
    return torch.nn.Sequential(
        torch.nn.Linear(37, 129), torch.nn.ReLU(), torch.nn.LayerNorm(129), torch.nn.Linear(129, rows)
    )


def _clip_in_fsdp2(rank: int, root: str) -> list:
    """Per mesh, norm type and seed: the whole gradients before, FSDP2's total norm, the whole
    gradients after (saved by rank 0 with torch.save; returns nothing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = []
    for kind, shape, names in (("fsdp", (WORLD,), ("shard",)), ("hsdp", (2, 2), ("replicate", "shard"))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for norm_type in NORM_TYPES:
            for seed in SEEDS:
                # torch refuses the inf-norm of an empty shard (_foreach_norm has no identity for it)
                model = _model(seed, empty_shard=norm_type != math.inf)
                for layer in (model[0], model[3]):
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                gen = torch.Generator().manual_seed(rank + 100 * seed)
                model(torch.randn(16, 37, generator=gen)).square().mean().backward()
                before = [p.grad.full_tensor() for p in model.parameters()]
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type)
                after = [p.grad.full_tensor() for p in model.parameters()]
                out.append((kind, shape[-1], norm_type, before, total.full_tensor(), after))
    if rank == 0:
        torch.save(out, Path(root, "clipped.pt"))
    return []


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    root = tmp_path_factory.mktemp("clipping")
    gloo_job(_clip_in_fsdp2, WORLD, root / "results", str(root))
    return torch.load(root / "clipped.pt")


def test_the_total_norm_and_the_clipped_gradients_are_fsdp2s_bit_for_bit(clipped):
    from sdc_forensics.replay.clipping import sharded_total_norm

    assert len(clipped) == 2 * len(NORM_TYPES) * len(SEEDS)
    for kind, shards, norm_type, before, total, after in clipped:
        mine = sharded_total_norm(before, shards, norm_type)
        assert mine.item() > 1e-3, "clipping must engage for the test to mean anything"
        assert torch.equal(mine, total), (kind, norm_type, mine.item(), total.item())
        grads = [g.clone() for g in before]
        params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        torch.nn.utils.clip_grads_with_norm_(params, 1e-3, mine)
        assert all(torch.equal(p.grad, a) for p, a in zip(params, after)), (kind, norm_type)


def test_within_the_replays_context_torchs_clip_grad_norm_is_the_sharded_jobs(clipped):
    from sdc_forensics.replay.clipping import clipping_as_recorded
    from sdc_forensics.trace.mesh import ShardMesh

    kind, shards, norm_type, before, total, after = next(c for c in clipped if c[0] == "hsdp" and c[2] == 2.0)
    mesh = ShardMesh(
        kind="hsdp",
        shape=(2, 2),
        dim_names=("replicate", "shard"),
        shard_dim=1,
        coords=((0, 0), (0, 1), (1, 0), (1, 1)),
    )
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in before]
    for p, g in zip(params, before):
        p.grad = g.clone()
    with clipping_as_recorded(mesh):
        got = torch.nn.utils.clip_grad_norm_(params, 1e-3)
        assert torch.equal(torch.nn.utils.get_total_norm(before), total)  # the public name torchtitan's clipping calls
    assert torch.equal(got, total)
    assert all(torch.equal(p.grad, a) for p, a in zip(params, after))
    from torch.nn.utils import clip_grad

    assert clip_grad._get_total_norm.__module__ == "torch.nn.utils.clip_grad"  # torch's own again outside


def test_a_norm_type_the_replay_does_not_model_is_refused_in_one_line():
    from sdc_forensics.errors import RecipeError
    from sdc_forensics.replay.clipping import sharded_total_norm

    with pytest.raises(RecipeError, match="norm_type=-inf"):
        sharded_total_norm([torch.ones(3)], 2, -math.inf)
