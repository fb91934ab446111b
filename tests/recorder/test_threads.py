"""The intra-op CPU thread count of every step in STEP ``aux_value``, and the warning on a change.

One in-process gloo group of world size 1 (fast, ``caplog`` sees the warning) and one real
3-process gloo DDP run where the ranks use different counts, set late or changed mid-run.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sdc_forensics.trace.manifest import read_manifest
from sdc_forensics.trace.reader import Trace, step_threads
from sdc_forensics.trace.synthetic import write_synthetic_trace
from tests.factories import num_threads
from sdc_forensics.demo import forked

NUM_STEPS = 6
# (S, R) the count each rank sets before its step: rank 0 sets 1 only after building the recorder
# (built at 2), rank 1 changes 2 -> 3 inside step 3, rank 2 changes 1 -> 3 between steps 4 and 5
PLAN = np.array([[1, 2, 1], [1, 2, 1], [1, 2, 1], [1, 3, 1], [1, 3, 1], [1, 3, 3]])
CHANGES = {0: [], 1: [(3, 2, 3)], 2: [(5, 1, 3)]}  # rank -> [(step, old, new)]


def _train(
    trace_dir: Path,
    rank: int,
    counts_before_step,
    *,
    threads_at_build: int,
    threads_after_build: int,
    inside_step: bool,
    autocast: torch.dtype | None = None,
) -> None:
    """A tiny DDP job: step ``s`` sets ``counts_before_step[s]`` threads (inside the step or just before it)."""
    from torch.nn.parallel import DistributedDataParallel

    from sdc_forensics.recorder import Recorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.set_num_threads(threads_at_build)
    rec = Recorder(trace_dir, ddp, optimizer)
    torch.set_num_threads(threads_after_build)
    world_size = dist.get_world_size()
    try:
        for step, count in enumerate(counts_before_step):
            if not inside_step:
                torch.set_num_threads(int(count))
            mb = step * world_size + rank
            with rec.step(step, microbatch_ids=[mb]) as s:
                if inside_step:
                    torch.set_num_threads(int(count))
                gen = torch.Generator().manual_seed(mb)
                x, y = s.input((torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)))
                with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
                loss.backward()
                s.loss(loss)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        rec.close()


def _free_port() -> int:
    from sdc_forensics.demo.ports import free_port as below_ephemeral

    return below_ephemeral()


def test_single_rank_records_each_steps_threads_and_warns_once_per_change(tmp_path, caplog):
    counts = [2, 2, 1, 1, 3]
    with num_threads(torch.get_num_threads()):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            with caplog.at_level(logging.WARNING, logger="sdc_forensics.recorder"):
                _train(tmp_path / "trace", 0, counts, threads_at_build=4, threads_after_build=2, inside_step=True)
        finally:
            dist.destroy_process_group()
    trace = Trace.open(tmp_path / "trace")
    window = next(trace.step_windows())
    assert window.records["aux_value"][:, 0].tolist() == [float(c) for c in counts]
    assert step_threads(window.records)[:, 0].tolist() == counts
    assert (window.records["aux_rank"] == -1).all()
    warnings = [r.getMessage() for r in caplog.records if "intra-op CPU threads" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert "rank 0" in warnings[0] and "from 2 (step 1) to 1 at step 2" in warnings[0]
    assert "from 1 (step 3) to 3 at step 4" in warnings[1]
    assert all(r.levelno == logging.WARNING for r in caplog.records if "intra-op" in r.getMessage())
    # the manifest holds the count of the first recorded step, not the one at construction (4)
    assert read_manifest(tmp_path / "trace").attempts[0].determinism["num_threads"] == 2


@pytest.mark.parametrize("autocast", [torch.bfloat16, None])
def test_the_manifest_says_which_dtype_autocast_computed_in(tmp_path, autocast):
    """A replay at another thread count compares within the dtype the job computed in
    (``replay.env.recompute_dtype``); autocast is a context around the forward, seen only there."""
    from sdc_forensics.fingerprint.tolerance import UNIT_ROUNDOFF
    from sdc_forensics.replay import env

    with num_threads(torch.get_num_threads()):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            _train(
                tmp_path / "trace",
                0,
                [1, 1],
                threads_at_build=1,
                threads_after_build=1,
                inside_step=False,
                autocast=autocast,
            )
        finally:
            dist.destroy_process_group()
    trace = Trace.open(tmp_path / "trace")
    determinism = trace.manifest.attempts[0].determinism
    assert determinism["num_threads"] == 1
    assert determinism.get("autocast_dtype") == ("bfloat16" if autocast else None)
    model = torch.nn.Linear(2, 2)
    assert env.recompute_dtype(trace, "float32", torch.device("cpu"), model) == ("bfloat16" if autocast else "float32")
    assert UNIT_ROUNDOFF["bfloat16"] > UNIT_ROUNDOFF["tfloat32"] > UNIT_ROUNDOFF["float32"]


def test_step_threads_is_zero_for_traces_without_counts_and_for_other_kinds(tmp_path):
    write_synthetic_trace(tmp_path, num_ranks=2, num_steps=5)
    trace = Trace.open(tmp_path)
    window = next(trace.step_windows())
    assert step_threads(window.records).shape == (5, 2) and not step_threads(window.records).any()
    assert not step_threads(next(trace.step_windows(fields=("aux_value",))).records).any()
    records = window.records.copy()
    records["aux_value"][0, 0], records["aux_value"][1, 0], records["aux_value"][2, 0] = 8.0, np.nan, -3.0
    records["kind"][3, 1], records["aux_value"][3, 1] = 4, 2.0  # an ALARM's aux_value is no count
    threads = step_threads(records)
    assert threads.dtype == np.int64 and threads[0, 0] == 8 and threads[1, 0] == threads[2, 0] == threads[3, 1] == 0


def _worker(rank: int, trace_dir: str, port: int, out_dir: str) -> None:
    """One rank of the 3-process run: train per PLAN, write its recorder log records to JSON."""
    captured: list[dict] = []

    class _Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append({"logger": record.name, "level": record.levelname, "message": record.getMessage()})

    logger = logging.getLogger("sdc_forensics.recorder")
    logger.addHandler(_Capture(level=logging.DEBUG))
    logger.setLevel(logging.DEBUG)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=PLAN.shape[1],
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        _train(
            Path(trace_dir),
            rank,
            PLAN[:, rank],
            threads_at_build=2,
            threads_after_build=int(PLAN[0, rank]),
            inside_step=rank == 1,  # rank 1 changes inside step 3, rank 2 between steps 4 and 5
        )
    finally:
        dist.destroy_process_group()
    path = Path(out_dir) / f"log-{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(captured), encoding="utf-8")
    os.replace(path.with_suffix(".tmp"), path)


@pytest.mark.slow
def test_ddp_ranks_record_their_own_threads_per_step_and_warn_at_the_change(tmp_path):
    trace_dir = tmp_path / "trace"
    forked.start(_worker, (str(trace_dir), _free_port(), str(tmp_path)), PLAN.shape[1])
    trace = Trace.open(trace_dir)
    assert trace.damage() == []
    window = next(trace.step_windows())
    assert window.present.all() and window.steps.tolist() == list(range(NUM_STEPS))
    np.testing.assert_array_equal(window.records["aux_value"], PLAN.astype(np.float64))  # (S, R)
    np.testing.assert_array_equal(step_threads(window.records), PLAN)
    # built at 2 threads everywhere; rank 0's count at its first step is 1
    assert trace.manifest.attempts[0].determinism["num_threads"] == 1
    for rank, changes in CHANGES.items():
        logged = json.loads((tmp_path / f"log-{rank}.json").read_text(encoding="utf-8"))
        warnings = [r for r in logged if "intra-op CPU threads" in r["message"]]
        assert len(warnings) == len(changes), (rank, logged)
        for record, (step, old, new) in zip(warnings, changes):
            assert record["level"] == "WARNING" and record["logger"] == "sdc_forensics.recorder"
            assert (
                f"rank {rank} changed its intra-op CPU threads from {old} (step {step - 1}) to {new} at step {step}"
                in record["message"]
            )


@pytest.mark.slow
def test_audits_recompute_at_the_audited_ranks_thread_count(tmp_path):
    """A clean conv net (convolution and GroupNorm reductions split by the thread count) with ranks
    at 2, 1, 2, 1 threads, every step audited: an auditor at its own count disputed clean ranks
    (this test failed on the development machine before the audit ran at the subject's count);
    recomputed at the subject's count, no audit mismatches."""
    from sdc_forensics.demo.run import run_demo
    from sdc_forensics.trace.format import Flag

    result = run_demo(
        tmp_path / "run",
        injections=("none",),
        steps=3,
        checkpoint_every=3,
        audit_every=1,
        recipe="sdc_forensics.demo.convnet:recipe",
        threads=(2, 1, 2, 1),
    )
    assert result.alarms == (), result.alarms
    window = next(Trace.open(tmp_path / "run" / "trace").step_windows())
    flags = window.records["flags"].astype(np.int64)
    assert (flags & int(Flag.AUDITED)).all()  # every rank-step was audited: the check ran
    assert not (flags & int(Flag.AUDIT_MISMATCH)).any()
    np.testing.assert_array_equal(step_threads(window.records), np.tile([2, 1, 2, 1], (3, 1)))
