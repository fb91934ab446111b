"""``trace/mesh.py``: the manifest's ``parallel`` object round-trips, mixed precision included, and
what a hostile one holds is refused (``tests/trace/test_hostile.py`` runs the commands on those)."""

from __future__ import annotations

import json

import pytest

from sdc_forensics.trace.mesh import ShardMesh
from tests.factories import grid_mesh

FSDP_MP = {
    "kind": "fsdp",
    "shape": [2],
    "dim_names": ["shard"],
    "shard_dim": 0,
    "coords": [[0], [1]],
    "reduce_dtype": "float32",
    "param_dtype": "bfloat16",
    "casts": [["", "bfloat16", ""], ["layers.0", "bfloat16", "float32"]],
}


def test_a_mixed_precision_mesh_round_trips_through_json():
    mesh = ShardMesh.from_json(json.loads(json.dumps(FSDP_MP)), 2)
    assert mesh.param_dtype == "bfloat16" and mesh.casts[1] == ("layers.0", "bfloat16", "float32")
    assert mesh.to_json() == FSDP_MP
    plain = {k: v for k, v in FSDP_MP.items() if k not in ("reduce_dtype", "param_dtype", "casts")}
    assert ShardMesh.from_json(plain, 2).to_json() == plain  # a job without mixed precision writes none of the keys


@pytest.mark.parametrize(
    "change",
    [
        {"param_dtype": "float64"},
        {"casts": [["", "bfloat16"]]},
        {"casts": [["", "", "int8"]]},
        {"casts": {"": "bfloat16"}},
        {"reduce_dtype": ""},
    ],
)
def test_a_wrong_mixed_precision_field_is_a_value_error(change):
    with pytest.raises(ValueError):
        ShardMesh.from_json(FSDP_MP | change, 2)


def test_forward_groups_join_tp_and_stages_of_one_data_parallel_coordinate():
    # torchtitan's 4-D mesh, rank-major: (pp, dp_replicate, dp_shard, tp)
    four = grid_mesh("pp", ("pp", "dp_replicate", "dp_shard", "tp"), (2, 2, 2, 2), shard_dim=2, tp_dim=3, pp_dim=0)
    groups = four.forward_groups()
    assert len(groups) == 4 and sorted(r for g in groups for r in g) == list(range(16))
    for group in groups:
        # one (dp_replicate, dp_shard) coordinate each, every (pp, tp) in it
        assert len({four.coords[r][1:3] for r in group}) == 1
        assert {(four.coords[r][0], four.coords[r][3]) for r in group} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    tp = grid_mesh("tp", ("dp", "tp"), (2, 2), shard_dim=0, tp_dim=1)
    assert tp.forward_groups() == [(0, 1), (2, 3)]
    # data parallel alone: every rank computes its own forward
    hsdp = grid_mesh("hsdp", ("dp_replicate", "dp_shard"), (2, 2), shard_dim=1)
    assert hsdp.forward_groups() == [(0,), (1,), (2,), (3,)]
