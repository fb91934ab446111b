"""Issue 24: a PyTorch Lightning ``DDPStrategy`` job recorded with ``SdcCallback``
(tests/integrations/pljob.py, 2 gloo processes on CPU, ``accumulate_grad_batches=2`` with an
epoch that ends mid-cycle, ``gradient_clip_val``, AdamW, a per-step schedule, ``ModelCheckpoint``)
is replayed exactly and judged by the unchanged CLI; so is the same module sharded with FSDP2 in
``configure_model`` under ``ModelParallelStrategy`` (its checkpoints distributed DCP directories).
Skipped, with the reason, without the ``lightning`` extra.
"""

from __future__ import annotations

import json
import shutil
import types

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed: pip install -e '.[lightning]'")

from tests.cli.installed import run_installed  # noqa: E402
from tests.integrations.launch import REPO, assert_ok, run_ranks  # noqa: E402

JOB = "tests.integrations.pljob"
ENV = {"PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """One clean 6-step fit (checkpoints 0, 3 and 6), read by the tests below and never written to."""
    where = tmp_path_factory.mktemp("pl-clean")
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out"], cwd=where))
    return where


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """One 6-step fit with a flip in rank 1's gradient at step 4: read as it is, or copied first by a test that resumes it."""
    where = tmp_path_factory.mktemp("pl-faulty")
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=1:bit=29"], cwd=where))
    return where


@pytest.mark.slow
@pytest.mark.heavy
def test_a_clean_lightning_run_is_certified_and_its_checkpoints_verify(clean_run, tmp_path):
    import lightning

    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=clean_run).stdout)
    assert inspected["framework"] == {
        "name": "lightning",
        "version": lightning.__version__,
        "adapter": "sdc_forensics.integrations.lightning",
    }
    certified = run_installed(["certify", "trace", "--json"], tmp_path, cwd=clean_run, env=ENV)
    assert certified.returncode == 0, certified.stderr
    doc = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert "(exact)" in certified.stderr, certified.stderr
    assert sorted(p.name for p in (clean_run / "out").iterdir()) == ["sdc-step=0.ckpt", "step=3.ckpt", "step=6.ckpt"]
    ran = run_installed(["verify-checkpoint", str(clean_run / "out" / "step=3.ckpt")], tmp_path)  # the file alone
    assert ran.returncode == 0 and "VERIFIED" in ran.stderr, ran.stderr


@pytest.mark.slow
@pytest.mark.heavy
def test_every_recorded_lightning_step_carries_its_weights_after_the_update(clean_run):
    """The weights digest after each update is what makes a replay's update checked (issue 33,
    "exact means every digest of the step"). The adapter closed each step in an optimizer post-hook
    registered before the recorder's own, so no Lightning step had one (found by
    benchmarks/bench_adapter_overhead.py); a recipe with the learning rate off then certified."""
    import numpy as np

    from sdc_forensics.trace import format as F
    from sdc_forensics.trace.reader import Trace

    records = Trace.open(clean_run / "trace").records(F.Kind.STEP)  # every step of the 6-step fit, both ranks
    assert len(records) == 2 * 6, len(records)
    flags = records["flags"].astype(np.int64)
    assert ((flags & int(F.Flag.HAS_WEIGHTS)) != 0).all() and ((flags & int(F.Flag.WEIGHTS_CHECKED)) != 0).all(), flags


@pytest.mark.slow
@pytest.mark.heavy
def test_a_fault_injected_through_the_lightning_callback_is_found_at_its_step_and_rank(faulty_run, tmp_path):
    ran = run_installed(["bisect", "trace", "--json"], tmp_path, cwd=faulty_run, env=ENV)
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
        assert_ok(
            run_ranks(JOB, ["--trace", "trace", "--out", "out", "--strategy", "model_parallel", *extra], cwd=where)
        )
    certified = run_installed(["certify", "trace", "--json"], clean, cwd=clean, env=ENV)
    assert certified.returncode == 0, certified.stderr
    assert {c["step"]: c["status"] for c in json.loads(certified.stdout)["checkpoints"]} == {
        0: "clean",
        3: "clean",
        6: "clean",
    }
    assert (
        clean / "out" / "step=3.ckpt" / "meta.pt"
    ).is_file()  # a distributed checkpoint, Lightning's own file beside
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
        base = dict(
            strategy=strategy,
            world_size=2,
            precision="32-true",
            optimizers=[object()],
            lr_scheduler_configs=[],
            gradient_clip_val=0.0,
            gradient_clip_algorithm=None,
        )
        return types.SimpleNamespace(**{**base, **changes})

    module = Tiny()
    assert _refusals(trainer(DDPStrategy()), module) == []
    assert _refusals(trainer(ModelParallelStrategy(), accumulate_grad_batches=1), module) == []  # FSDP2: recorded
    (line,) = _refusals(trainer(ModelParallelStrategy(), accumulate_grad_batches=2), module)
    assert "reduce-scatters every microbatch" in line and "accumulate_grad_batches=1" in line
    (line,) = _refusals(
        trainer(ModelParallelStrategy(save_distributed_checkpoint=False), accumulate_grad_batches=1), module
    )
    assert "save_distributed_checkpoint=True" in line
    assert any("precision '16-mixed'" in p for p in _refusals(trainer(DDPStrategy(), precision="16-mixed"), module))
    assert any("precision 'bf16-mixed'" in p for p in _refusals(trainer(DDPStrategy(), precision="bf16-mixed"), module))
    import torch

    compiled = Tiny()
    compiled.net[0] = torch.compile(
        compiled.net[0]
    )  # torch.compile on a submodule (issue 40: replay failed on _orig_mod.)
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
def test_a_resumed_fit_starts_its_attempt_at_the_restored_step_and_writes_over_no_checkpoint(faulty_run, tmp_path):
    """Issue 40: fit(ckpt_path=step=3.ckpt) after a first attempt with a flip at step 4. Lightning
    restores global_step after on_fit_start; the callback starts attempt 1 at step 3, saves no
    checkpoint 0, and every file of attempt 0 stays byte for byte (step 6 goes to step=6-v1.ckpt).
    bisect still reports attempt 0's fault (rank 1 at step 4, with its attempt: corruption), while
    the resumed attempt's checkpoint certifies on its own replay."""
    tmp_path = tmp_path / "run"
    shutil.copytree(faulty_run, tmp_path)  # attempt 0: the faulty fit, copied (the resume adds attempt 1 to it)
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
    # the first attempt's fault, judged on its own records: its rank, its attempt, its step
    assert (ran.returncode, doc["verdict"], doc["first_divergent_step"]) == (1, "corruption", None), ran.stderr
    assert [(s["rank"], s.get("attempt"), s["steps"]) for s in doc["suspects"]] == [(1, 0, [4])], doc["suspects"]


@pytest.mark.slow
@pytest.mark.heavy
def test_a_lightning_job_with_dropout_replays_its_masks_and_certifies(tmp_path):
    """Issue 40: nn.Dropout(0.1) in the module: the callback seeds each microbatch's training_step
    from (step seed, microbatch), the recipe seeds its training_step alike: certified exactly."""
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--dropout", "0.1"], cwd=tmp_path))
    certified = run_installed(["certify", "trace", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert certified.returncode == 0, certified.stderr
    assert {c["step"]: c["status"] for c in json.loads(certified.stdout)["checkpoints"]} == {
        0: "clean",
        3: "clean",
        6: "clean",
    }
    assert "(exact)" in certified.stderr, certified.stderr


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize(
    "argv, code, last_step",
    [
        (
            ["--policy", "raise", "--inject", "allreduce:step=2:rank=1:bit=30"],
            18,
            2,
        ),  # the alarm, through exit_on_alarm
        (["--interrupt-at", "2"], 1, 1),  # KeyboardInterrupt inside step 2: Lightning calls on_exception, then exits 1
    ],
    ids=["alarm", "keyboard-interrupt"],
)
def test_a_fit_stopped_by_an_alarm_or_ctrl_c_closes_every_ranks_trace(tmp_path, argv, code, last_step):
    """Issue 40: however fit() ends, the callback closes the trace (END record, on an exception)."""
    ranks = run_ranks(JOB, ["--trace", "trace", "--out", "out", *argv], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [code, code], [r.stderr[-2000:] for r in ranks]
    end = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)["end"]
    assert [(r["closed"], r["closed_on_error"]) for r in end["ranks"]] == [(True, True), (True, True)], end
    assert "no rank closed its trace" not in end["summary"] and end["last_step"] == last_step, end


def _attaching_trainer(tmp_path, checkpoint_callbacks):
    """What ``SdcCallback.on_fit_start`` reads of a 2-process ``DDPStrategy`` fit, without launching one."""
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from tests.integrations.pljob import Tiny, make_dataset

    module = Tiny()
    trainer = types.SimpleNamespace(
        strategy=DDPStrategy(),
        world_size=2,
        precision="32-true",
        optimizers=[torch.optim.AdamW(module.parameters())],
        lr_scheduler_configs=[],
        gradient_clip_val=0.0,
        gradient_clip_algorithm=None,
        checkpoint_callbacks=checkpoint_callbacks,
        fit_loop=types.SimpleNamespace(
            _data_source=types.SimpleNamespace(
                instance=torch.utils.data.DataLoader(make_dataset(), batch_size=4), name="train_dataloader"
            )
        ),
        save_checkpoint=lambda *args, **kwargs: None,
        default_root_dir=str(tmp_path),
    )
    return trainer, module


@pytest.mark.parametrize(
    "save_top_k, said", [(1, True), (-1, False)]
)  # 1: ModelCheckpoint's default, the last one kept
def test_a_modelcheckpoint_that_rotates_is_said_when_the_callback_attaches(
    tmp_path, monkeypatch, caplog, save_top_k, said
):
    """Issue 40: a ModelCheckpoint with save_top_k other than -1 deletes early checkpoints: on_fit_start
    says so on rank 0 (one line naming the setting and `certify --follow`), and nothing on rank 1."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from sdc_forensics.integrations.lightning import SdcCallback

    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "out"), every_n_train_steps=3, save_top_k=save_top_k)
    for rank, expected in (("0", said), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        trainer, module = _attaching_trainer(tmp_path, [checkpoints])
        caplog.clear()
        with caplog.at_level("WARNING"):
            SdcCallback(tmp_path / "trace", dataset="tests.integrations.pljob:make_dataset").on_fit_start(
                trainer, module
            )
        lines = [r.getMessage() for r in caplog.records if "deletes early checkpoints" in r.getMessage()]
        if expected:
            (line,) = lines
            assert line.startswith(f"sdc-forensics: ModelCheckpoint(save_top_k={save_top_k}) deletes early checkpoints")
            assert "certify --follow" in line
        else:
            assert lines == [], rank
    assert not (tmp_path / "trace").exists()  # the recorder starts in on_train_start
