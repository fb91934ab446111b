"""Issue 24: a PyTorch Lightning ``DDPStrategy`` job recorded with ``SdcCallback``
(tests/integrations/pljob.py, 2 gloo processes on CPU, ``accumulate_grad_batches=2`` with an
epoch that ends mid-cycle, ``gradient_clip_val``, AdamW, a per-step schedule, ``ModelCheckpoint``)
is replayed exactly and judged by the unchanged CLI; so is the same module sharded with FSDP2 in
``configure_model`` under ``ModelParallelStrategy`` (its checkpoints distributed DCP directories).
Skipped, with the reason, without the ``lightning`` extra.
"""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed: pip install -e '.[lightning]'")

from tests.cli.installed import run_installed  # noqa: E402
from tests.integrations.launch import REPO, assert_ok, run_ranks  # noqa: E402

JOB = "tests.integrations.pljob"
ENV = {"PYTHONPATH": str(REPO)}


@pytest.mark.slow
@pytest.mark.heavy
def test_a_clean_lightning_run_is_certified_and_its_checkpoints_verify(tmp_path):
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out"], cwd=tmp_path))
    import lightning

    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)
    assert inspected["framework"] == {"name": "lightning", "version": lightning.__version__,
                                      "adapter": "sdc_forensics.integrations.lightning"}
    certified = run_installed(["certify", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert certified.returncode == 0, certified.stderr
    doc = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert "(exact)" in certified.stderr, certified.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sdc-step=0.ckpt", "step=3.ckpt", "step=6.ckpt"]
    ran = run_installed(["verify-checkpoint", str(tmp_path / "out" / "step=3.ckpt")], tmp_path)  # the file alone
    assert ran.returncode == 0 and "VERIFIED" in ran.stderr, ran.stderr


@pytest.mark.slow
@pytest.mark.heavy
def test_a_fault_injected_through_the_lightning_callback_is_found_at_its_step_and_rank(tmp_path):
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=1:bit=29"], cwd=tmp_path))
    ran = run_installed(["bisect", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    assert (doc["verdict"], doc["first_divergent_step"], [s["rank"] for s in doc["suspects"]]) == ("corruption", 4, [1])
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "tainted"}


@pytest.mark.slow
@pytest.mark.heavy
def test_a_model_parallel_fsdp2_run_is_certified_and_a_fault_in_it_found(tmp_path):
    """ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), fully_shard in configure_model,
    the ordered reduce-scatter: the clean run's DCP checkpoints (with Lightning's meta.pt) certify, and
    a flip in rank 1's local gradient at step 4 is named with its mesh coordinate."""
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    for where, extra in ((clean, []), (faulty, ["--inject", "local-gradient:step=4:rank=1:bit=29"])):
        where.mkdir()
        assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--strategy", "model_parallel", *extra], cwd=where))
    certified = run_installed(["certify", "trace", "--json"], clean, cwd=clean, env=ENV)
    assert certified.returncode == 0, certified.stderr
    assert {c["step"]: c["status"] for c in json.loads(certified.stdout)["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert (clean / "out" / "step=3.ckpt" / "meta.pt").is_file()  # a distributed checkpoint, Lightning's own file beside
    ran = run_installed(["bisect", "trace", "--json"], faulty, cwd=faulty, env=ENV)
    doc = json.loads(ran.stdout)
    assert (ran.returncode, doc["first_divergent_step"]) == (1, 4), ran.stderr
    assert [(s["rank"], s["mesh"]) for s in doc["suspects"]] == [(1, "data_parallel=1")]
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "tainted"}


def test_model_parallel_and_other_settings_are_refused_with_one_line():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from sdc_forensics.integrations.lightning import _refusals
    from tests.integrations.pljob import Tiny

    def trainer(strategy, **changes):
        base = dict(strategy=strategy, world_size=2, precision="32-true", optimizers=[object()], lr_scheduler_configs=[],
                    gradient_clip_val=0.0, gradient_clip_algorithm=None)
        return types.SimpleNamespace(**{**base, **changes})

    module = Tiny()
    assert _refusals(trainer(DDPStrategy()), module) == []
    assert _refusals(trainer(ModelParallelStrategy(), accumulate_grad_batches=1), module) == []  # FSDP2: recorded
    (line,) = _refusals(trainer(ModelParallelStrategy(), accumulate_grad_batches=2), module)
    assert "reduce-scatters every microbatch" in line and "accumulate_grad_batches=1" in line
    (line,) = _refusals(trainer(ModelParallelStrategy(save_distributed_checkpoint=False), accumulate_grad_batches=1), module)
    assert "save_distributed_checkpoint=True" in line
    assert any("precision '16-mixed'" in p for p in _refusals(trainer(DDPStrategy(), precision="16-mixed"), module))
    assert any("precision 'bf16-mixed'" in p for p in _refusals(trainer(DDPStrategy(), precision="bf16-mixed"), module))
    import torch

    compiled = Tiny()
    compiled.net[0] = torch.compile(compiled.net[0])  # torch.compile on a submodule (issue 40: replay failed on _orig_mod.)
    (line,) = _refusals(trainer(DDPStrategy()), compiled)
    assert "torch.compile wraps 'net.0'" in line
    epoch = types.SimpleNamespace(interval="epoch", frequency=1, reduce_on_plateau=False)
    assert any("interval='step'" in p for p in _refusals(trainer(DDPStrategy(), lr_scheduler_configs=[epoch]), module))
    hooked = DDPStrategy(ddp_comm_hook=lambda state, bucket: None)
    assert any("SdcCallback(comm_hook=" in p for p in _refusals(trainer(hooked), module))


def _hashes(folder) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow
@pytest.mark.heavy
def test_a_resumed_fit_starts_its_attempt_at_the_restored_step_and_writes_over_no_checkpoint(tmp_path):
    """Issue 40: fit(ckpt_path=step=3.ckpt) after a first attempt with a flip at step 4. Lightning
    restores global_step after on_fit_start; the callback starts attempt 1 at step 3, saves no
    checkpoint 0, and every file of attempt 0 stays byte for byte (step 6 goes to step=6-v1.ckpt)."""
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=1:bit=29"], cwd=tmp_path))
    before = _hashes(tmp_path / "out")
    assert sorted(before) == ["sdc-step=0.ckpt", "step=3.ckpt", "step=6.ckpt"]
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--resume", "out/step=3.ckpt"], cwd=tmp_path))
    after = _hashes(tmp_path / "out")
    assert {name: after[name] for name in before} == before
    # step 6 under ModelCheckpoint's version counter; its repeat of step 3 (over step=3.ckpt) is not saved
    assert sorted(set(after) - set(before)) == ["step=6-v1.ckpt"]
    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)
    assert [(a["attempt"], a["start_step"]) for a in inspected["attempts"]] == [(0, 0), (1, 3)]
    ran = run_installed(["bisect", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    doc = json.loads(ran.stdout)
    statuses = {(c["step"], c["path"].rsplit("/", 1)[-1]): c["status"] for c in doc["checkpoints"]}
    # the resumed attempt's steps 3..5 replay bit for bit from step=3.ckpt: its checkpoint 6 is certified
    assert statuses[(3, "step=3.ckpt")] == "clean" and statuses[(6, "step=6-v1.ckpt")] == "clean", statuses
    assert (0, "sdc-step=0.ckpt") in statuses, statuses  # the first attempt's checkpoint 0, not a resumed one


@pytest.mark.slow
@pytest.mark.heavy
def test_a_lightning_job_with_dropout_replays_its_masks_and_certifies(tmp_path):
    """Issue 40: nn.Dropout(0.1) in the module: the callback seeds each microbatch's training_step
    from (step seed, microbatch), the recipe seeds its training_step alike: certified exactly."""
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--dropout", "0.1"], cwd=tmp_path))
    certified = run_installed(["certify", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert certified.returncode == 0, certified.stderr
    assert {c["step"]: c["status"] for c in json.loads(certified.stdout)["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert "(exact)" in certified.stderr, certified.stderr
