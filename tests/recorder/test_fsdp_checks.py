"""FSDP2 and HSDP online checks (``recorder/fsdp_checks.py``) on real ``fully_shard`` jobs, gloo, 6 processes:
a flipped bit in one replica of one shard is named by the vote (3 replicas), detected without
blame (2 replicas); a rank that gathers a parameter wrong is named among all ranks."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from tests.factories import gloo_job

WORLD = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 4))


def _sharded(mesh=None) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    kwargs = {"mesh": mesh} if mesh is not None else {}
    for layer in (model[0], model[3]):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _train_step(model: torch.nn.Module, rank: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    model(torch.randn(8, 16, generator=gen)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _flip(rank: int, target_rank: int, target: str):
    def corrupt(name: str, tensor: torch.Tensor) -> None:
        if rank == target_rank and name == target:
            with torch.no_grad():
                tensor.view(-1).view(torch.int32)[0] ^= 1 << 22

    return corrupt


def _summary(result) -> dict:
    return {
        "kind": result.kind,
        "clean": result.clean,
        "suspects": list(result.suspects),
        "note": result.note,
        "lines": result.lines(),
        "groups": [list(g) for g in result.groups],
        "disagreements": [[d.param, list(d.group), list(d.suspects), d.attributed] for d in result.disagreements],
    }


def _job(rank: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder.fsdp_checks import check_gathered, check_shards

    found = {}
    fsdp = _sharded()  # 1-D: no replicas of a shard
    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder import RecorderOptions
    from sdc_forensics.recorder.recorder import Recorder

    try:  # what the sharded recorder does not do yet, it refuses before writing anything
        Recorder(
            Path(out, f"trace{rank}"),
            fsdp,
            torch.optim.SGD(fsdp.parameters(), lr=0.1),
            recipe="no.such:recipe",
            options=RecorderOptions(audit_every=2),
            inject=["grad:step=1:rank=0:bit=3"],
        )
        found["recorder"] = None
    except UsageError as refusal:
        found["recorder"] = [str(refusal), Path(out, f"trace{rank}").exists()]
    _train_step(fsdp, rank)
    found["fsdp_shards"] = _summary(check_shards(fsdp))
    found["fsdp_gathered_clean"] = _summary(check_gathered(fsdp))
    found["fsdp_gathered_bad"] = _summary(check_gathered(fsdp, corrupt=_flip(rank, 3, "0.weight")))

    three = _sharded(init_device_mesh("cpu", (3, 2), mesh_dim_names=("replicate", "shard")))
    _train_step(three, 0)  # every replica must see the same data to stay equal
    found["hsdp3_clean"] = _summary(check_shards(three))
    found["hsdp3_bad"] = _summary(check_shards(three, corrupt=_flip(rank, 4, "3.weight")))
    try:
        check_shards(three, policy="raise", step=7)  # rank 4's shard is still flipped
        found["hsdp3_raise"] = None
    except SdcAlarm as alarm:
        found["hsdp3_raise"] = [str(alarm), alarm.rank, alarm.step]

    from torch.distributed.fsdp import fully_shard

    mixed = _model()  # blocks on an HSDP mesh, the root's parameters on the 1-D world mesh
    hsdp_mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("replicate", "shard"))
    for layer in (mixed[0], mixed[3]):
        fully_shard(layer, mesh=hsdp_mesh)
    fully_shard(mixed)
    _train_step(mixed, 0)
    found["mixed_meshes"] = _summary(check_shards(mixed))

    two = _sharded(init_device_mesh("cpu", (2, 3), mesh_dim_names=("replicate", "shard")))
    _train_step(two, 0)
    found["hsdp2_bad"] = _summary(check_shards(two, corrupt=_flip(rank, 1, "2.bias")))
    return found


@pytest.fixture(scope="module")
def found(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_checks")
    return gloo_job(_job, WORLD, out, str(out))


def test_every_rank_reaches_the_same_result(found):
    assert all(f == found[0] for f in found)


def test_the_sharded_recorder_refuses_what_it_cannot_record_in_one_line_before_writing(found):
    message, wrote = found[0]["recorder"]
    assert "grad are DDP's" in message and "local-gradient" in message and "\n" not in message
    assert not wrote  # refused before anything was written


def test_fsdp_without_replicas_says_so_and_the_gathered_vote_names_the_rank_that_gathered_wrong(found):
    f = found[0]
    assert f["fsdp_shards"]["clean"] and "no replicate dimension" in f["fsdp_shards"]["note"]
    assert f["fsdp_gathered_clean"]["clean"]
    bad = f["fsdp_gathered_bad"]
    assert bad["suspects"] == [3]
    assert bad["disagreements"] == [["0.weight", list(range(WORLD)), [3], True]]


def test_hsdp_with_three_replicas_names_the_replica_whose_shard_flipped(found):
    f = found[0]
    assert f["hsdp3_clean"]["clean"]
    assert sorted(map(sorted, f["hsdp3_clean"]["groups"])) == [[0, 2, 4], [1, 3, 5]]
    bad = f["hsdp3_bad"]
    assert bad["suspects"] == [4]
    assert bad["disagreements"] == [["3.weight", [0, 2, 4], [4], True]]
    message, rank, step = f["hsdp3_raise"]
    assert rank == 4 and step == 7 and "step 7" in message
    assert f"rank 4 (host {socket.gethostname()}, cpu, mesh replicate=2 shard=0)" in message  # where to look


def test_a_model_mixing_meshes_votes_each_parameter_within_its_own_mesh(found):
    mixed = found[0]["mixed_meshes"]
    assert mixed["clean"], mixed["lines"]  # the root's 1-D shards are not compared across HSDP replicas
    assert sorted(map(sorted, mixed["groups"])) == [[0, 2, 4], [1, 3, 5]]


def test_hsdp_with_two_replicas_detects_and_blames_nobody(found):
    bad = found[0]["hsdp2_bad"]
    assert not bad["clean"] and bad["suspects"] == []
    ((param, group, suspects, attributed),) = bad["disagreements"]
    assert param == "2.bias" and 1 in group and len(group) == 2 and not attributed
    assert "detected, not attributed" in bad["lines"][0]
