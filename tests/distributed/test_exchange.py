"""``forensics.distributed`` on its own, in real 3-process gloo groups (torchrun, CPU): the exchange
of one step's ranks is bit for bit (5 original ranks over 3 processes, mixed dtypes), the
suspect check refuses alike on every process and ``--force-device`` passes, and the pure rule
of placement names the right process. The CLI runs are ``test_torchrun_cli.py``'s."""

from __future__ import annotations

import json

import pytest

from sdc_forensics.forensics.distributed import owner, placement_refusals
from tests.distributed.launch import torchrun


def test_placement_rule_refuses_the_suspect_gpu_and_its_node_only():
    suspects = {"GPU-b": (2, "node-a")}
    places = [("node-c", "GPU-x"), ("node-a", "GPU-y"), ("node-d", "GPU-b"), ("node-e", "")]
    refusals = placement_refusals(places, suspects)
    assert refusals == ["replay process 1 runs on host node-a, the node of suspect rank 2 (GPU GPU-b)",
                        "replay process 2 runs on GPU-b (host node-d), the GPU of suspect rank 2"]
    assert placement_refusals(places, {}) == []


def test_original_ranks_are_dealt_round_robin():
    assert [owner(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.slow
def test_three_gloo_processes_exchange_bit_for_bit_and_refuse_alike():
    code, out, err, _ = torchrun(3, ["tests/distributed/exchange_worker.py", "exchange+placement", "60"], timeout_s=180)
    assert code == 0, err[-3000:]
    docs = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda d: d["rank"])
    assert [d["rank"] for d in docs] == [0, 1, 2] and {d["backend"] for d in docs} == {"gloo"}
    assert all(d["bitwise"] for d in docs)
    assert [d["computed"] for d in docs] == [[0, 3], [1, 4], [2]]  # each process computed its own ranks only
    assert {d["forced"] for d in docs} == {"passed"}
    [refused] = {d["refused"] for d in docs}  # the same line on every process
    assert refused.startswith("replay process 0 runs on host ") and "suspect rank 2" in refused and "--force-device" in refused
