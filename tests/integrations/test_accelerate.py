"""Issue 24: an ``accelerate`` loop recorded with ``sdc_forensics.integrations.accelerate.record``
(tests/integrations/accjob.py, 2 gloo processes on CPU, accumulation 2 with an epoch that ends
mid-cycle, clipping, AdamW, a warmup schedule stepped as Accelerate steps it) is replayed exactly
and judged by the unchanged CLI. Skipped, with the reason, without the ``accelerate`` extra.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("accelerate", reason="the accelerate extra is not installed: pip install -e '.[accelerate]'")

from tests.cli.installed import run_installed  # noqa: E402
from tests.integrations.launch import REPO, assert_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # ~60 s: heavy (README command budget)
JOB = "tests.integrations.accjob"
ENV = {"PYTHONPATH": str(REPO)}


def test_a_clean_accelerate_run_is_certified_and_its_save_state_folders_verify(tmp_path):
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out"], cwd=tmp_path))
    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)
    import accelerate

    assert inspected["framework"] == {"name": "accelerate", "version": accelerate.__version__,
                                      "adapter": "sdc_forensics.integrations.accelerate"}
    certified = run_installed(["certify", "trace", "--allow-numpy", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert certified.returncode == 0, certified.stderr
    doc = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert "(exact)" in certified.stderr, certified.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-0", "step-3", "step-6"]
    folder = tmp_path / "out" / "step-3"  # the folder alone (certify has checked all three against their notes)
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= {p.name for p in folder.iterdir()}
    ran = run_installed(["verify-checkpoint", str(folder), "--allow-numpy"], tmp_path)
    assert ran.returncode == 0 and "VERIFIED" in ran.stderr and "not verifiable" not in ran.stderr, ran.stderr


def test_a_fault_injected_through_the_accelerate_adapter_is_found_at_its_step_and_rank(tmp_path):
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=0:bit=29"], cwd=tmp_path))
    ran = run_installed(["bisect", "trace", "--allow-numpy", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    assert (doc["verdict"], doc["first_divergent_step"], [s["rank"] for s in doc["suspects"]]) == ("corruption", 4, [0])
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "tainted"}


def test_a_resumed_loop_starts_its_attempt_at_the_loaded_folders_step_and_writes_over_no_checkpoint(tmp_path):
    """Issue 40: attempt 0 with a flip at step 4 saves step-0, -3, -6; accelerator.load_state(out/step-3)
    starts attempt 1 at step 3 (the step the trace noted for that folder), it saves into a new
    folder (save_state over out/step-6 would be refused), attempt 0's files stay byte for byte,
    and attempt 1's checkpoint 6 certifies."""
    import hashlib

    def hashes(folder):
        return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}

    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=0:bit=29"], cwd=tmp_path))
    before = hashes(tmp_path / "out")
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out2", "--resume", "out/step-3"], cwd=tmp_path))
    assert hashes(tmp_path / "out") == before
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["step-6"]
    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)
    assert [(a["attempt"], a["start_step"]) for a in inspected["attempts"]] == [(0, 0), (1, 3)]
    ran = run_installed(["bisect", "trace", "--allow-numpy", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    doc = json.loads(ran.stdout)
    statuses = {(c["step"], c["path"].split("/")[-2]): c["status"] for c in doc["checkpoints"]}
    assert statuses[(3, "out")] == "clean" and statuses[(6, "out2")] == "clean", (statuses, ran.stderr)
