"""A trace recorded on an H200 (``fixtures/h200-batchnorm``), replayed on this CPU.

The first GPU traces showed that a CPU replay of a conv net trained on a GPU differs from the
record by TF32's roundoff (cuDNN computes float32 convolutions with 10 mantissa bits by default),
54 float32 tolerances at step 0 on every rank: compared in float32 terms the replay stopped at a
weak common-mode mismatch and never reached the fault. Compared with TF32's roundoff
(``replay.env.recompute_dtype``) the fault is found, and the clean run stays uncertified (a
tolerant replay never certifies) with no rank named.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.replay import env
from sdc_forensics.trace.reader import Trace

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "h200-batchnorm"


def _bisect(tmp_path: Path, name: str) -> tuple[int, dict]:
    run = tmp_path / name
    shutil.copytree(FIXTURE / name, run)  # the ledger is written beside the trace: never into the repository
    result = CliRunner().invoke(
        cli, ["bisect", str(run / "trace"), "--checkpoints", str(run / "checkpoints"), "--json"]
    )
    return result.exit_code, json.loads(result.stdout)


def test_the_h200_fault_is_found_at_its_step_and_rank_by_a_cpu_replay(tmp_path):
    code, doc = _bisect(tmp_path, "grad")
    assert code == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == 4
    assert [s["rank"] for s in doc["suspects"]] == [2]
    assert doc["replayed"]["comparison"] == "tolerant"
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    assert (
        statuses[0] == "clean" and statuses[6] != "clean" and statuses[3] != "clean"
    )  # tolerant: nothing after 0 certified


def test_the_clean_h200_run_replayed_on_a_cpu_names_nobody_and_certifies_only_checkpoint_0(tmp_path):
    code, doc = _bisect(tmp_path, "clean")
    assert code == 4 and doc["verdict"] == "inconclusive" and doc["suspects"] == [] and doc["evidence"] == []
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "unverified", 6: "unverified"}
    # the clean steps' residuals sit well inside TF32's tolerance (0.13 of it measured): a margin, not luck
    assert all(w["max_residual_ratio"] < 0.5 for w in doc["replayed"]["windows"])


def test_tf32_roundoff_only_for_a_float32_gpu_trace_recomputed_elsewhere():
    trace = Trace.open(FIXTURE / "clean" / "trace")
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 4))
    cpu = torch.device("cpu")
    assert env.recompute_dtype(trace, "float32", cpu, conv) == "tfloat32"  # cudnn_allow_tf32 was on
    assert env.recompute_dtype(trace, "float32", cpu, mlp) == "float32"  # matmuls were not TF32
    assert env.recompute_dtype(trace, "bfloat16", cpu, conv) == "bfloat16"


def test_the_coarsest_precision_the_job_computed_in_sets_the_roundoff():
    """bfloat16 autocast or an FSDP2 bfloat16 ``param_dtype`` is coarser than TF32, TF32 than float32."""
    import types

    def trace(determinism: dict, param_dtype: str = ""):
        attempts = [types.SimpleNamespace(determinism=determinism)]
        parallel = types.SimpleNamespace(param_dtype=param_dtype) if param_dtype else None
        return types.SimpleNamespace(manifest=types.SimpleNamespace(attempts=attempts, parallel=parallel))

    cpu, mlp = torch.device("cpu"), torch.nn.Sequential(torch.nn.Linear(3, 4))
    gpu_tf32 = {"device_type": "cuda", "device_name": "H200", "cuda_matmul_allow_tf32": True}
    assert env.recompute_dtype(trace(gpu_tf32), "float32", cpu, mlp) == "tfloat32"
    assert env.recompute_dtype(trace({**gpu_tf32, "autocast_dtype": "bfloat16"}), "float32", cpu, mlp) == "bfloat16"
    assert env.recompute_dtype(trace({"autocast_dtype": "float16"}), "float32", cpu, mlp) == "float16"
    assert env.recompute_dtype(trace({}, "bfloat16"), "float32", cpu, mlp) == "bfloat16"
    assert env.recompute_dtype(trace({"autocast_dtype": "nonsense"}), "float32", cpu, mlp) == "float32"
    assert env.recompute_dtype(trace({}), "float32", cpu, mlp) == "float32"
