"""The TP layout's arithmetic without processes: a rank's box as runs of the flattened tensor
(checked against numpy's own indexing), the mesh notes' TP keys, and TP then FSDP's cut."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdc_forensics.fingerprint import core, shards
from sdc_forensics.trace.mesh import ShardMesh


@pytest.mark.parametrize(
    "shape,local,offsets",
    [((8, 6), (4, 3), (4, 3)), ((8, 6), (2, 6), (6, 0)), ((4, 3, 5), (2, 3, 2), (1, 0, 3)), ((7,), (3,), (4,))],
)
def test_box_runs_are_numpy_indexing(shape, local, offsets):
    whole = np.arange(int(np.prod(shape))).reshape(shape)
    box = whole[tuple(slice(o, o + n) for o, n in zip(offsets, local))].reshape(-1)
    runs = shards.box_runs(shape, local, offsets)
    got = np.concatenate([np.arange(place, place + length) for _, length, place in runs])
    assert np.array_equal(got, box)
    assert [start for start, _, _ in runs] == list(np.cumsum([0] + [n for _, n, _ in runs])[:-1])


def _tp_mesh(tp_shards):
    return ShardMesh(
        kind="tp",
        shape=(2, 2),
        dim_names=("dp", "tp"),
        shard_dim=0,
        coords=((0, 0), (0, 1), (1, 0), (1, 1)),
        tp_dim=1,
        tp_shards=tp_shards,
    )


def test_boxes_of_all_ranks_cover_each_parameter_once_and_combine_to_its_digest():
    mesh = _tp_mesh((0, 1, -1))
    params = [torch.randn(8, 6), torch.randn(6, 8), torch.randn(10)]
    for index, param in enumerate(params):
        # replicated over tp: the ranks of one DP coordinate hold the same box; count each box once
        boxes = {mesh.rank_box(r, index, tuple(param.shape)) for r in range(4)}
        pieces, seen = [], []
        for box, at in boxes:
            runs = shards.box_runs(tuple(param.shape), box, at)
            sliced = param[tuple(slice(o, o + n) for o, n in zip(at, box))]
            pieces += shards.box_pieces(sliced, runs)
            seen += [i for _, n, place in runs for i in range(place, place + n)]
        assert sorted(seen) == list(range(param.numel()))
        assert shards.combine_pieces(pieces).digest == core.fingerprint(param).digest


def test_tp_then_fsdp_cut():
    mesh = _tp_mesh((0, 1))
    # column-parallel rows 4..7 on tp=1, FSDP's first half of them on dp=0
    assert mesh.rank_box(1, 0, (8, 6)) == ((2, 6), (4, 0))
    # row-parallel columns 3..5 on tp=1, FSDP's rows 4..7 on dp=1
    assert mesh.rank_box(3, 1, (8, 6)) == ((4, 3), (4, 3))
    assert mesh.tp_box(3, 1, (8, 6)) == ((8, 3), (0, 3))
    assert mesh.where(2) == "mesh (dp=1, tp=0)"
    assert mesh.reduce_groups() == [(0, 2), (1, 3)]


def test_mesh_notes_round_trip_and_older_traces_read():
    mesh = _tp_mesh((0, 1, -1))
    assert ShardMesh.from_json(mesh.to_json(), 4) == mesh
    older = ShardMesh(kind="fsdp", shape=(4,), dim_names=("shard",), shard_dim=0, coords=((0,), (1,), (2,), (3,)))
    doc = older.to_json()
    assert "tp_dim" not in doc and ShardMesh.from_json(doc, 4) == older
    with pytest.raises(ValueError):
        ShardMesh.from_json({**doc, "tp_dim": 0}, 4)
