"""``trace/mesh.py``: the manifest's ``parallel`` object round-trips, mixed precision included, and
what a hostile one holds is refused (``tests/trace/test_hostile.py`` runs the commands on those)."""

from __future__ import annotations

import json

import pytest

from sdc_forensics.trace.mesh import ShardMesh

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
