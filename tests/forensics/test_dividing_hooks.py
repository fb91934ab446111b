"""A job's own comm hook that divides by ``W`` (torch's ``allreduce_hook``: ``buffer.div_(W)``, then
``all_reduce(SUM)``), and any hook under ``RecorderOptions(reduction="ordered")``.

DDP's own reducer multiplies each gradient by ``1/W``; ``x / 3`` and ``x * (1/3)`` differ in the
last bit, so with 3 ranks a clean job reduced by ``allreduce_hook`` was never certified
(``inconclusive``: "no summation order reproduces the recorded reduced digest"). Under the ordered
reduction the replay ignored the hook altogether: a clean job with ``allreduce_hook`` or
``fp16_compress_hook`` and ``reduction="ordered"`` was called ``corruption`` at step 0, blaming
the collective of every node. The replay now tries each order both ways (``env.DIVIDED``) for a
job with its own hook, and reproduces a compressing hook under the ordered reduction.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.demo import forked
from sdc_forensics.replay import env
from tests.factories import free_port
from tests.forensics.hook_capture import capture

pytestmark = pytest.mark.heavy

HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
WORLD, STEPS, EVERY = 3, 6, 3


@pytest.mark.parametrize(
    "hook_name, ordered, order, compress, plain",
    [
        ("allreduce_hook", False, "gloo-ring" + env.DIVIDED, None, "gloo-ring"),
        ("allreduce_hook", True, env.ORDERED + env.DIVIDED, None, env.ORDERED),
        ("fp16_compress_hook", True, env.ORDERED, torch.float16, env.ORDERED),
        ("sum_then_divide_hook", False, "gloo-ring" + env.DIVIDED_AFTER, None, "gloo-ring" + env.DIVIDED),
        ("sum_then_divide_hook", True, env.ORDERED + env.DIVIDED_AFTER, None, env.ORDERED + env.DIVIDED),
        ("sum_then_scale_hook", False, "gloo-ring" + env.SCALED_AFTER, None, "gloo-ring" + env.DIVIDED_AFTER),
        ("sum_then_scale_hook", True, env.ORDERED + env.SCALED_AFTER, None, env.ORDERED + env.DIVIDED_AFTER),
    ],
    ids=[
        "allreduce-hook",
        "allreduce-hook-ordered",
        "fp16-ordered",
        "sum-then-divide",
        "sum-then-divide-ordered",
        "sum-then-scale",
        "sum-then-scale-ordered",
    ],
)
def test_the_replay_reproduces_the_hook_bit_for_bit(tmp_path, hook_name, ordered, order, compress, plain):
    forked.start(capture, (WORLD, free_port(), str(tmp_path), hook_name, ordered), WORLD)
    buckets = sorted({p.name.split("-b")[1] for p in tmp_path.glob("r0-b*.pt")})
    assert len(buckets) > 1
    for bucket in buckets:
        saved = [torch.load(tmp_path / f"r{r}-b{bucket}", weights_only=True) for r in range(WORLD)]
        locals_ = [[s["local"]] for s in saved]
        [replayed] = env.reduce_buckets(locals_, order, compress=compress)
        # what the replay computed before: DDP's 1/W scaling, the hook's compression ignored
        [before] = env.reduce_buckets(locals_, plain)
        assert not torch.equal(replayed, before)  # the difference is visible: the test can fail
        for r, s in enumerate(saved):
            assert torch.equal(s["reduced"].view(torch.int32), replayed.view(torch.int32)), (bucket, r)


def test_orders_to_try_adds_the_divided_orders_for_a_hook_of_the_job_s_own():
    assert env.orders_to_try({}) == env.REDUCTION_ORDERS
    assert env.orders_to_try({"reduction": "ordered"}) == (env.ORDERED,)
    mine = {"comm_hook": "train.my_hook"}
    assert env.orders_to_try(mine) == (
        "gloo-ring",
        "sequential",
        "gloo-ring-divided",
        "sequential-divided",
        "gloo-ring-summed-then-divided",
        "sequential-summed-then-divided",
        "gloo-ring-summed-then-scaled",
        "sequential-summed-then-scaled",
    )
    assert env.orders_to_try({**mine, "reduction": "ordered"}) == (
        env.ORDERED,
        env.ORDERED + env.DIVIDED,
        env.ORDERED + env.DIVIDED_AFTER,
        env.ORDERED + env.SCALED_AFTER,
    )
    # torch's compressing hooks are reproduced as they are (they divide)
    assert env.orders_to_try({"comm_hook": f"{HOOKS}.fp16_compress_hook"}) == env.REDUCTION_ORDERS


@pytest.mark.parametrize(
    "hook, reduction",
    [
        (f"{HOOKS}:allreduce_hook", "native"),
        (f"{HOOKS}:allreduce_hook", "ordered"),
        (f"{HOOKS}:fp16_compress_hook", "ordered"),
        # a new user's conv net job with this hook was called corruption at step 0 under "ordered"
        ("tests.forensics.hook_capture:sum_then_divide_hook", "native"),
        ("tests.forensics.hook_capture:sum_then_divide_hook", "ordered"),
    ],
    ids=["allreduce-hook", "allreduce-hook-ordered", "fp16-ordered", "sum-then-divide", "sum-then-divide-ordered"],
)
def test_a_clean_job_with_the_hook_is_certified_on_three_ranks(demo_run, hook, reduction):
    trace = (
        demo_run(
            (),
            steps=STEPS,
            checkpoint_every=EVERY,
            world_size=WORLD,
            reduction=reduction,
            comm_hook=hook,
        )
        / "trace"
    )
    done = CliRunner().invoke(cli, ["certify", str(trace), "--json", "--no-ledger"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert [c["status"] for c in doc["checkpoints"]] == ["clean"] * 3 and doc["resume_step"] == STEPS


def test_a_fault_in_a_job_with_a_dividing_hook_is_found_at_its_step_and_rank(demo_run):
    trace = (
        demo_run(
            "grad:step=4:rank=1:bit=27",
            steps=STEPS,
            checkpoint_every=EVERY,
            world_size=WORLD,
            reduction="ordered",
            comm_hook=f"{HOOKS}:allreduce_hook",
        )
        / "trace"
    )
    found = CliRunner().invoke(cli, ["bisect", str(trace), "--json", "--no-ledger"])
    assert found.exit_code == 1, found.output
    doc = json.loads(found.stdout)
    assert doc["first_divergent_step"] == 4 and [s["rank"] for s in doc["suspects"]] == [1]
    assert doc["replayed"]["comparison"] == "exact"
    assert [c["status"] for c in doc["checkpoints"]][:2] == ["clean", "clean"]
