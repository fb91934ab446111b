"""The exactness preflight (``replay/preflight.py``) and the numerics contract it reads
(``sdc_forensics/numerics.py``): said before any replay, reapplied during it (issue 21)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from sdc_forensics import numerics
from sdc_forensics.cli.main import cli
from sdc_forensics.replay import preflight
from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, Manifest, RankIdentity

H100 = "NVIDIA H100 80GB HBM3"


def _manifest(*determinisms, device="cpu"):
    ranks = tuple(RankIdentity(rank=r, host="n0", device=device) for r in range(2))
    return Manifest(
        format_version=1,
        world_size=2,
        fingerprint=FingerprintSettings(seed=1, sketch_k=8),
        attempts=tuple(
            Attempt(attempt=i, start_step=10 * i, ranks=ranks, determinism=d) for i, d in enumerate(determinisms)
        ),
    )


def _cuda(**extra):
    return {
        "device_type": "cuda",
        "device_name": H100,
        "backend": "nccl",
        "reduction": "native",
        "cudnn_benchmark": False,
        "deterministic_algorithms": True,
    } | extra


def test_cpu_job_on_cpu_is_exact_through_gloo_s_ring():
    flight = preflight.check(_manifest({"device_type": "cpu", "backend": "gloo", "num_threads": 1}))
    assert flight.exact and flight.mechanism == "gloo-ring" and not flight.blockers
    assert flight.lines()[0].startswith("exact replay possible on cpu")


def test_an_old_trace_without_the_contract_is_judged_from_its_ranks_devices():
    assert preflight.check(_manifest({"num_threads": 1})).exact
    old_gpu = preflight.check(_manifest({}, device="cuda:0"))
    assert not old_gpu.exact and old_gpu.mechanism == "unknown"


def test_gpu_job_replayed_on_cpu_says_why_and_the_one_fix():
    flight = preflight.check(_manifest(_cuda(reduction="ordered")), device="cpu")
    assert not flight.exact and flight.mechanism == "ordered"
    assert flight.blockers[0].startswith(f"trained on {H100}, replaying on cpu")
    assert flight.fix == f"replay with --device cuda on an {H100}"
    assert "nothing can be certified" in flight.lines()[0]


def test_gpu_job_with_nccl_s_own_order_cannot_be_exact_even_on_its_gpu():
    flight = preflight.check(_manifest(_cuda(nccl_env={"NCCL_ALGO": "Tree"})), device="cuda", device_name=H100)
    assert not flight.exact and flight.mechanism == "unknown"
    assert "nccl in its own summation order" in flight.blockers[0]
    assert "replayable()" in flight.fix and any("NCCL_ALGO=Tree" in c for c in flight.caveats)


def test_the_replays_own_collective_lifts_the_unknown_order_on_the_same_gpu():
    """--collective: NCCL's order is not modelled but run; self-checked per step (a caveat, not a blocker)."""
    flight = preflight.check(
        _manifest(_cuda(nccl_env={"NCCL_ALGO": "Tree"})), device="cuda", device_name=H100, collective=True
    )
    assert flight.exact and flight.mechanism == "collective" and not flight.blockers
    assert any("checked against the recorded reduced digest" in c for c in flight.caveats)
    hooked = preflight.check(
        _manifest({"device_type": "cpu", "backend": "gloo", "comm_hook": "job.hooks.tree_mean"}), collective=True
    )
    assert hooked.mechanism == "collective" and any(
        "job.hooks.tree_mean is the first suspect" in c for c in hooked.caveats
    )
    on_cpu = preflight.check(_manifest(_cuda()), device="cpu", collective=True)
    assert not on_cpu.exact and on_cpu.blockers[0].startswith(f"trained on {H100}, replaying on cpu")


def test_cudnn_benchmark_in_training_blocks_exactness():
    flight = preflight.check(
        _manifest(_cuda(reduction="ordered", cudnn_benchmark=True)), device="cuda", device_name=H100
    )
    assert not flight.exact and "cudnn.benchmark=True" in flight.blockers[0]


def test_the_ordered_reduction_on_the_recorded_gpu_model_is_exact():
    flight = preflight.check(_manifest(_cuda(reduction="ordered")), device="cuda:1", device_name=H100)
    assert flight.exact and flight.mechanism == "ordered"
    other = preflight.check(_manifest(_cuda(reduction="ordered")), device="cuda", device_name="NVIDIA A100-SXM4-80GB")
    assert not other.exact and other.fix == f"replay on an {H100}"


def test_threads_and_tolerant_requests_are_blockers_on_cpu():
    manifest = _manifest({"device_type": "cpu", "backend": "gloo", "num_threads": 1})
    threads = preflight.check(manifest, num_threads=2)
    assert not threads.exact and threads.fix == "replay without --threads"
    assert preflight.check(manifest, num_threads=1).exact
    assert preflight.check(manifest, force_tolerant=True).fix == "replay without --tolerant"


def test_every_attempt_counts():
    """A run resumed on other hardware: the worst attempt decides."""
    flight = preflight.check(_manifest({"device_type": "cpu", "backend": "gloo"}, _cuda()), device="cpu")
    assert not flight.exact and "cpu" in flight.trained_on and H100 in flight.trained_on


def test_recorded_settings_are_applied_for_the_replay_and_restored_after():
    before = numerics._current()
    recorded = {
        "deterministic_algorithms": False,
        "cudnn_allow_tf32": not before["cudnn_allow_tf32"],
        "float32_matmul_precision": "medium",
        "cudnn_benchmark": True,
        "device_type": "cpu",
    }
    with numerics.reproduce(recorded, torch.device("cpu"), 1) as applied:
        assert torch.backends.cudnn.allow_tf32 == recorded["cudnn_allow_tf32"]
        assert torch.get_float32_matmul_precision() == "medium" and torch.backends.cudnn.benchmark
        assert not torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 1
        assert applied["source"] == "recorded" and applied["not_reproduced"] == []
    assert numerics._current() == before


def test_a_trace_that_recorded_nothing_gets_the_old_deterministic_settings():
    with numerics.reproduce({}, torch.device("cpu"), None) as applied:
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.allow_tf32
    assert applied["source"].startswith("imposed")


def test_what_a_cpu_replay_cannot_reproduce_of_a_gpu_run_is_named():
    said = numerics.not_reproduced(_cuda(nccl_env={"NCCL_PROTO": "LL"}), torch.device("cpu"))
    assert said[0] == f"trained on {H100}, replaying on cpu" and "NCCL_PROTO=LL" in said[1]


def test_the_recorder_records_the_contract():
    flags = numerics.record(torch.device("cpu"), "gloo", "ordered", "mytrain.hook")
    assert (flags["device_type"], flags["backend"], flags["reduction"], flags["comm_hook"]) == (
        "cpu",
        "gloo",
        "ordered",
        "mytrain.hook",
    )
    assert {"float32_matmul_precision", "cudnn_benchmark", "sdpa_backends", "nccl_env", "num_threads"} <= set(flags)


@pytest.mark.slow
def test_bisect_says_it_first_and_in_json(demo_run):
    out = demo_run("none", steps=4, checkpoint_every=2)
    answer = CliRunner().invoke(cli, ["bisect", str(out / "trace"), "--json", "--threads", "3"])
    doc = json.loads(answer.stdout)
    assert doc["preflight"]["exact"] is False and doc["preflight"]["fix"] == "replay without --threads"
    first = [line for line in answer.stderr.splitlines() if line.strip()][0]
    assert first.startswith("note: no exact replay on cpu: --threads 3")  # before any replay
    assert any("could not be exact" in s for s in doc["settle"])
    exact = json.loads(CliRunner().invoke(cli, ["bisect", str(out / "trace"), "--json"]).stdout)
    assert exact["preflight"]["exact"] is True and exact["preflight"]["mechanism"] == "gloo-ring"
    inspect = json.loads(CliRunner().invoke(cli, ["inspect", str(out / "trace"), "--json"]).stdout)
    assert inspect["preflight"]["exact"] is True


def test_zero_above_two_ranks_is_said_not_exact_before_any_replay():
    """A trial user's clean 4-rank ZeRO 2 job: the preflight said 'exact replay possible, a clean replay
    certifies' and advised recording with reduction='ordered', which DeepSpeed does not apply (and the
    recorder now refuses under it); the replay then answered inconclusive. ZeRO's order above 2 ranks
    is not one the replay knows: said first, with no advice that leads nowhere."""
    import dataclasses

    det = {"device_type": "cpu", "backend": "gloo", "comm_hook": "deepspeed.zero.stage2"}
    two = preflight.check(_manifest(det))
    assert two.exact and not any("reduction='ordered'" in c for c in two.caveats + two.blockers)
    four = preflight.check(dataclasses.replace(_manifest(det), world_size=4))
    assert not four.exact and "order the replay does not know above 2 ranks" in four.blockers[0]
    assert not any("reduction='ordered'" in line for line in (*four.caveats, *four.blockers, four.fix))
    own = preflight.check(_manifest({"device_type": "cpu", "backend": "gloo", "comm_hook": "job.hooks.mean"}))
    assert any("reduction='ordered'" in c for c in own.caveats)  # a job's own DDP hook: still the advice
