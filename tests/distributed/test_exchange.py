"""``replay.distributed`` on its own, in real 3-process gloo groups (torchrun, CPU): the exchange
of one step's ranks is bit for bit (5 original ranks over 3 processes, mixed dtypes), so is a
second recomputation done by another process than the rank's owner, the
suspect check refuses alike on every process and ``--force-device`` passes, and the pure rule
of placement names the right process. The CLI runs are ``test_torchrun_cli.py``'s."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sdc_forensics.replay.distributed import owner, placement_refusals
from tests.distributed.launch import torchrun


def test_placement_rule_refuses_the_suspect_gpu_and_its_node_only():
    suspects = {"GPU-b": (2, "node-a")}
    places = [("node-c", "GPU-x"), ("node-a", "GPU-y"), ("node-d", "GPU-b"), ("node-e", "")]
    refusals = placement_refusals(places, suspects)
    assert refusals == [
        "replay process 1 runs on host node-a, the node of suspect rank 2 (GPU GPU-b)",
        "replay process 2 runs on GPU-b (host node-d), the GPU of suspect rank 2",
    ]
    assert placement_refusals(places, {}) == []


def test_original_ranks_are_dealt_round_robin():
    assert [owner(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.slow
def test_three_gloo_processes_exchange_bit_for_bit_and_refuse_alike(tmp_path):
    code, _, err, _ = torchrun(
        3, ["tests/distributed/exchange_worker.py", "exchange+recompute+placement", "60", str(tmp_path)], timeout_s=180
    )
    assert code == 0, err[-3000:]
    docs = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(3)]
    assert [d["rank"] for d in docs] == [0, 1, 2] and {d["backend"] for d in docs} == {"gloo"}
    assert all(d["bitwise"] for d in docs)
    assert [d["computed"] for d in docs] == [[0, 3], [1, 4], [2]]  # each process computed its own ranks only
    assert all(d["recomputed_bitwise"] for d in docs)
    assert [d["recomputed_here"] for d in docs] == [
        False,
        False,
        True,
    ]  # rank 4's owner is process 1: the next one recomputes it
    assert {d["forced"] for d in docs} == {"passed"}
    [refused] = {d["refused"] for d in docs}  # the same line on every process
    assert (
        refused.startswith("replay process 0 runs on host ")
        and "suspect rank 2" in refused
        and "--force-device" in refused
    )


def test_process_0_speaks_for_the_group_and_a_follower_only_for_its_own_errors(monkeypatch):
    from sdc_forensics.errors import CheckpointError, UsageError
    from sdc_forensics.replay import distributed

    lost = distributed.ReplayProcessLost("a replay process exited")
    assert distributed.error_line(lost) == "a replay process exited"  # single process: every line
    monkeypatch.setattr(distributed, "_role", distributed.ReplayGroup(rank=0, size=3, backend="gloo", timeout_s=5.0))
    assert distributed.error_line(UsageError("bad flag")) == "bad flag"
    monkeypatch.setattr(distributed, "_role", distributed.ReplayGroup(rank=2, size=3, backend="gloo", timeout_s=5.0))
    assert distributed.error_line(lost) is None
    # what every process raises alike: said by a follower only once process 0 had the time to say it (under
    # torchrun the launcher stops the follower meanwhile); process 0 may have been stopped still starting
    waits = []
    monkeypatch.setattr(distributed.time, "sleep", waits.append)
    for alike in (UsageError("bad flag"), distributed.PlacementRefused("on the suspect's node")):
        line = distributed.error_line(alike)
        assert line.startswith("replay process 2 of 3 (host ") and line.endswith(f", process 0 silent: {alike}")
    assert waits == [distributed.LEAD_GRACE_S] * 2
    line = distributed.error_line(CheckpointError("checkpoint 3 does not exist"))
    assert line.startswith("replay process 2 of 3 (host ") and line.endswith("checkpoint 3 does not exist")
    assert (lost.exit_code, distributed.PlacementRefused.exit_code) == (4, 2)


def test_without_a_launcher_nothing_changes(monkeypatch):
    from sdc_forensics.replay import distributed

    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not distributed.launched() and distributed.start("cpu") is None and distributed.current() is None
    assert distributed.process_device("cuda") == "cuda"
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert not distributed.launched()  # torchrun --nproc-per-node 1: the single-process path
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert distributed.launched() and distributed.process_device("cuda") == "cuda:3"
    assert distributed.process_device("cuda:1") == "cuda:1" and distributed.process_device("cpu") == "cpu"


def test_leave_ends_a_process_that_replayed_in_a_group_with_its_code_and_output_flushed():
    """After a lost peer (``finish(peer_lost=True)``), or after any group this process joined, the
    process ends at once through ``leave`` with its exit status, stdout and stderr written out (no
    interpreter teardown under gloo's threads); a process that joined none returns from ``leave``."""
    script = (
        "import sys\n"
        "from sdc_forensics.replay import distributed as d\n"
        "d.leave(3)\n"  # nothing abandoned: returns
        "sys.stdout.write('partial'); sys.stderr.write('error: lost')\n"
        "d._abandoned = True\n"
        "d.leave(4)\n"
        "raise SystemExit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (4, "partial", "error: lost")
    joined = (
        "import sys\n"
        "from sdc_forensics.replay import distributed as d\n"
        "d._role = d.ReplayGroup(rank=1, size=3, backend='gloo', timeout_s=1.0)\n"
        "sys.stdout.write('done')\n"
        "d.leave(0)\n"
        "raise SystemExit(5)\n"
    )
    done = subprocess.run([sys.executable, "-c", joined], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "done")
