"""A job's own compressing comm hook (torch's ``fp16_compress_hook``/``bf16_compress_hook``): the
recorder takes its dtype for the all-reduce tolerance without being told, and the replay reproduces
the hook's arithmetic (cast, divide by ``W`` in the low dtype, gloo's ring sum in it, cast back) bit
for bit, so a clean run is certified and a fault found at its step and rank. Before, such a clean
run was called ``corruption`` at step 0 on every rank ("check the interconnect of every node").
PowerSGD, which all-reduces a low-rank approximation, is refused in one line before anything is
written.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.replay import env
from tests.factories import free_port
from sdc_forensics.demo import forked
from tests.forensics.hook_capture import capture

pytestmark = pytest.mark.slow

HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
STEPS, EVERY = 6, 3
_HOOK_OF = {"float16": "fp16_compress_hook", "bfloat16": "bf16_compress_hook"}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_replay_reproduces_torch_s_compress_hook_on_gloo_bit_for_bit(tmp_path, dtype):
    world_size = 3
    forked.start(capture, (world_size, free_port(), str(tmp_path), _HOOK_OF[dtype]), world_size)
    buckets = sorted({p.name.split("-b")[1] for p in tmp_path.glob("r0-b*.pt")})
    assert len(buckets) > 1
    compress = getattr(torch, dtype)
    for bucket in buckets:
        saved = [torch.load(tmp_path / f"r{r}-b{bucket}", weights_only=True) for r in range(world_size)]
        [replayed] = env.reduce_buckets([[s["local"]] for s in saved], "gloo-ring", compress=compress)
        [uncompressed] = env.reduce_buckets([[s["local"]] for s in saved], "gloo-ring")
        assert not torch.equal(replayed, uncompressed)  # the compression is visible: the test can fail
        for r, s in enumerate(saved):
            assert torch.equal(s["reduced"].view(torch.int32), replayed.view(torch.int32)), (bucket, r)


def test_a_job_with_a_compress_hook_is_certified_and_its_fault_found(demo_run):
    clean = demo_run((), steps=STEPS, checkpoint_every=EVERY, comm_hook=f"{HOOKS}:fp16_compress_hook") / "trace"
    manifest = json.loads((clean / "manifest.json").read_text())
    assert manifest["fingerprint"]["grad_dtype"] == "float16"  # taken from the hook, not from the user
    certified = CliRunner().invoke(cli, ["certify", str(clean), "--json"])
    assert certified.exit_code == 0, certified.output
    doc = json.loads(certified.stdout)
    assert [c["status"] for c in doc["checkpoints"]] == ["clean"] * 3 and doc["resume_step"] == STEPS

    faulty = (
        demo_run(
            "grad:step=4:rank=2:bit=27", steps=STEPS, checkpoint_every=EVERY, comm_hook=f"{HOOKS}:bf16_compress_hook"
        )
        / "trace"
    )
    found = CliRunner().invoke(cli, ["bisect", str(faulty), "--json"])
    assert found.exit_code == 1, found.output
    doc = json.loads(found.stdout)
    assert doc["first_divergent_step"] == 4 and [s["rank"] for s in doc["suspects"]] == [2]
    assert doc["replayed"]["comparison"] == "exact"


def test_powersgd_is_refused_before_anything_is_written(tmp_path):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    from sdc_forensics.errors import UsageError
    from sdc_forensics.recorder import Recorder

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1)
        with pytest.raises(UsageError, match="PowerSGD.*low-rank approximation.*fp16_compress_hook"):
            Recorder(
                tmp_path / "trace",
                ddp,
                torch.optim.SGD(ddp.parameters(), lr=0.1),
                comm_hook=powersgd.powerSGD_hook,
                comm_state=state,
            )
        assert not (tmp_path / "trace").exists() or not any((tmp_path / "trace").iterdir())
    finally:
        dist.destroy_process_group()
