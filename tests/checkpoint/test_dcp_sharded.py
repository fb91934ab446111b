"""A DCP checkpoint of an FSDP2 job, digested in the job without gathering any tensor
(``fsdp_checks.sharded_state_digests``), verifies against those digests, and so does the same
checkpoint loaded into an HSDP 2 x 2 job and re-saved with that other sharding (issue 23, item 4)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.factories import gloo_job

WORLD = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 70), torch.nn.ReLU(), torch.nn.LayerNorm(70), torch.nn.Linear(70, 3))


def _job(rank: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.recorder.fsdp_checks import sharded_state_digests, sharded_weights_digest

    model = _model()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    at_step_0 = sharded_weights_digest(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(5, 13, generator=torch.Generator().manual_seed(rank))).square().mean().backward()
    optimizer.step()
    state = {"model": model.state_dict()}
    noted = sharded_state_digests(state)
    plain = sharded_state_digests({"same": torch.ones(3), "per_rank": torch.full((2,), float(rank))})
    dcp.save(state, checkpoint_id=str(Path(out, "fsdp4")))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    other = _model()
    for layer in (other[0], other[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(other, mesh=mesh)
    again = {"model": other.state_dict()}
    dcp.load(again, checkpoint_id=str(Path(out, "fsdp4")))  # resharded on load
    resaved = sharded_state_digests(again)
    dcp.save(again, checkpoint_id=str(Path(out, "hsdp2x2")))
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(full, Path(out, "full.pt"))
        Path(out, "noted.json").write_text(
            json.dumps({"fsdp4": noted, "hsdp2x2": resaved, "weights_at_step_0": str(at_step_0), "plain": plain})
        )


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dcp_sharded")
    gloo_job(_job, WORLD, out / "ranks", str(out))
    return out


def test_the_job_digests_equal_the_full_tensors_digests(job):
    from sdc_forensics.fingerprint import core
    from sdc_forensics.trace.checkpoints import hex64

    noted = json.loads((job / "noted.json").read_text())
    full = torch.load(job / "full.pt", weights_only=True)
    assert noted["fsdp4"] == {f"model.{k}": hex64(core.digest(v)) for k, v in full.items()}
    assert noted["hsdp2x2"] == noted["fsdp4"]  # another sharding, the same digests


def test_a_plain_tensor_is_digested_when_every_rank_holds_the_same_and_left_out_when_they_differ(job):
    from sdc_forensics.fingerprint import core
    from sdc_forensics.trace.checkpoints import hex64

    plain = json.loads((job / "noted.json").read_text())["plain"]
    assert plain == {"same": hex64(core.digest(torch.ones(3)))}


def test_at_step_0_the_fsdp2_job_has_the_weights_digest_a_ddp_job_records(job):
    """The DDP recorder's weights digest (statedict.weights_digest) of the same model, wrapped in DDP."""
    from sdc_forensics.statedict import weights_digest

    ddp_style = [(f"module.{n}", p) for n, p in _model().named_parameters()]  # as DDP names them
    noted = json.loads((job / "noted.json").read_text())
    assert int(noted["weights_at_step_0"]) == weights_digest(ddp_style)


@pytest.mark.parametrize("saved", ["fsdp4", "hsdp2x2"])
def test_each_dcp_directory_verifies_against_the_digests_noted_in_the_job(job, saved):
    from sdc_forensics.checkpoint.verify import verify_checkpoint

    noted = json.loads((job / "noted.json").read_text())["fsdp4"]
    report = verify_checkpoint(job / saved)
    assert report.ok
    measured = {t.key: t.digest for t in report.tensors}
    assert {k: measured.get(k) for k in noted} == noted


def test_verify_checkpoint_reads_the_resharded_directory(job):
    result = subprocess.run(
        [sys.executable, "-m", "sdc_forensics", "verify-checkpoint", str(job / "hsdp2x2"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    noted = json.loads((job / "noted.json").read_text())["fsdp4"]
    digests = {t["key"]: t["digest"] for t in doc["report"]["tensors"]}
    assert {k: digests.get(k) for k in noted} == noted
