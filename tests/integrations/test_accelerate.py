"""Issue 24: an ``accelerate`` loop recorded with ``sdc_forensics.integrations.accelerate.record``
(tests/integrations/accjob.py, 2 gloo processes on CPU, accumulation 2 with an epoch that ends
mid-cycle, clipping, AdamW, a warmup schedule stepped as Accelerate steps it) is replayed exactly
and judged by the unchanged CLI. Skipped, with the reason, without the ``accelerate`` extra.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("accelerate", reason="the accelerate extra is not installed: pip install -e '.[accelerate]'")

from tests.cli.installed import run_installed  # noqa: E402
from tests.integrations.launch import REPO, assert_ok, run_ranks  # noqa: E402

JOB = "tests.integrations.accjob"
ENV = {"PYTHONPATH": str(REPO)}


@pytest.mark.slow
@pytest.mark.heavy
def test_a_clean_accelerate_run_is_certified_and_its_save_state_folders_verify(tmp_path):
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out"], cwd=tmp_path))
    inspected = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)
    import accelerate

    assert inspected["framework"] == {
        "name": "accelerate",
        "version": accelerate.__version__,
        "adapter": "sdc_forensics.integrations.accelerate",
    }
    certified = run_installed(["certify", "trace", "--allow-numpy", "--json"], tmp_path, cwd=tmp_path, env=ENV)
    assert certified.returncode == 0, certified.stderr
    doc = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "clean"}
    assert "(exact)" in certified.stderr, certified.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-0", "step-3", "step-6"]
    folder = tmp_path / "out" / "step-3"  # the folder alone (certify has checked all three against their notes)
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= {
        p.name for p in folder.iterdir()
    }
    ran = run_installed(["verify-checkpoint", str(folder), "--allow-numpy"], tmp_path)
    assert ran.returncode == 0 and "VERIFIED" in ran.stderr and "not verifiable" not in ran.stderr, ran.stderr


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """One 6-step loop with a flip in rank 0's gradient at step 4: read as it is, or copied first by a test that resumes it."""
    where = tmp_path_factory.mktemp("acc-faulty")
    assert_ok(run_ranks(JOB, ["--trace", "trace", "--out", "out", "--inject", "grad:step=4:rank=0:bit=29"], cwd=where))
    return where


@pytest.mark.slow
@pytest.mark.heavy
def test_a_fault_injected_through_the_accelerate_adapter_is_found_at_its_step_and_rank(faulty_run, tmp_path):
    ran = run_installed(["bisect", "trace", "--allow-numpy", "--json"], tmp_path, cwd=faulty_run, env=ENV)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    assert (doc["verdict"], doc["first_divergent_step"], [s["rank"] for s in doc["suspects"]]) == ("corruption", 4, [0])
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 3: "clean", 6: "tainted"}


@pytest.mark.slow
@pytest.mark.heavy
def test_a_resumed_loop_starts_its_attempt_at_the_loaded_folders_step_and_writes_over_no_checkpoint(
    faulty_run, tmp_path
):
    """Issue 40: attempt 0 with a flip at step 4 saves step-0, -3, -6; accelerator.load_state(out/step-3)
    starts attempt 1 at step 3 (the step the trace noted for that folder), it saves into a new
    folder (save_state over out/step-6 would be refused), attempt 0's files stay byte for byte,
    and attempt 1's checkpoint 6 certifies. bisect still reports attempt 0's fault (rank 0 at step 4,
    with its attempt: corruption)."""
    import hashlib

    def hashes(folder):
        return {
            str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }

    tmp_path = tmp_path / "run"
    shutil.copytree(faulty_run, tmp_path)  # attempt 0: the faulty loop, copied (the resume adds attempt 1 to it)
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
    # the first attempt's fault, judged on its own records: its rank, its attempt, its step
    assert (ran.returncode, doc["verdict"], doc["first_divergent_step"]) == (1, "corruption", None), ran.stderr
    assert [(s["rank"], s.get("attempt"), s["steps"]) for s in doc["suspects"]] == [(0, 0, [4])], doc["suspects"]


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
        (["--interrupt-at", "2"], 1, 1),  # KeyboardInterrupt inside step 2, after its first backward
    ],
    ids=["alarm", "keyboard-interrupt"],
)
def test_a_loop_stopped_by_an_alarm_or_ctrl_c_closes_every_ranks_trace(tmp_path, argv, code, last_step):
    """Issue 40: the recording's block closes the trace however the loop leaves it (END record, on an exception)."""
    ranks = run_ranks(JOB, ["--trace", "trace", "--out", "out", *argv], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [code, code], [r.stderr[-2000:] for r in ranks]
    end = json.loads(run_installed(["inspect", "trace", "--json"], tmp_path, cwd=tmp_path).stdout)["end"]
    assert [(r["closed"], r["closed_on_error"]) for r in end["ranks"]] == [(True, True), (True, True)], end
    assert "no rank closed its trace" not in end["summary"] and end["last_step"] == last_step, end


def _prepared(tmp_path, *, compiled: bool = False, total_limit=None):
    """A one-process Accelerator that prepared accjob's model (its first layer ``torch.compile``d if asked)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from tests.integrations import accjob

    accelerator = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path / "project"), total_limit=total_limit)
    )
    model = accjob.build_model()
    if compiled:
        model[0] = torch.compile(model[0])  # a compiled submodule: its state dict keys gain "_orig_mod."
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(accjob.make_dataset(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return accelerator, model


def _record(accelerator, model, tmp_path):
    from sdc_forensics.integrations import accelerate as sdc

    return sdc.record(
        accelerator,
        tmp_path / "trace",
        model=model,
        model_fn="tests.integrations.accjob:build_model",
        loss_fn="tests.integrations.accjob:loss",
        dataset="tests.integrations.accjob:make_dataset",
    )


ONE_PROCESS = "the job runs 1 process"


def test_a_compiled_submodule_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Issue 40: torch.compile on a submodule (not only Accelerate's dynamo_backend) is refused at
    record(), one line on rank 0's stderr, nothing written. One process stands in for rank 0 of a
    DDP job: its own refusal (one process) is set aside."""
    from sdc_forensics.errors import UsageError
    from sdc_forensics.integrations import accelerate as sdc

    accelerator, model = _prepared(tmp_path)
    assert [p for p in sdc._refusals(accelerator) if not p.startswith(ONE_PROCESS)] == []
    accelerator, model = _prepared(tmp_path, compiled=True)
    (line,) = [p for p in sdc._refusals(accelerator) if not p.startswith(ONE_PROCESS)]
    assert line.startswith("torch.compile wraps '0'") and "_orig_mod" in line
    real = sdc._refusals
    monkeypatch.setattr(sdc, "_refusals", lambda acc: [p for p in real(acc) if not p.startswith(ONE_PROCESS)])
    monkeypatch.delenv("RANK", raising=False)
    capsys.readouterr()
    with pytest.raises(UsageError) as refused:
        _record(accelerator, model, tmp_path)
    assert "torch.compile wraps '0'" in str(refused.value) and "\n" not in str(refused.value)
    assert capsys.readouterr().err == f"sdc-forensics: {refused.value}\n"
    assert not (tmp_path / "trace").exists()


@pytest.mark.parametrize("total_limit, said", [(2, True), (None, False)])
def test_a_checkpoint_total_limit_is_said_at_attach(tmp_path, monkeypatch, caplog, total_limit, said):
    """Issue 40: ProjectConfiguration(total_limit=N) rotates save_state folders away: record() says
    so on rank 0, one line naming the setting and `certify --follow`. (One process: it is then
    refused for want of a DDP wrapper, after the warning.)"""
    from sdc_forensics.errors import UsageError
    from sdc_forensics.integrations import accelerate as sdc

    real = sdc._refusals
    monkeypatch.setattr(sdc, "_refusals", lambda acc: [p for p in real(acc) if not p.startswith(ONE_PROCESS)])
    monkeypatch.delenv("RANK", raising=False)
    accelerator, model = _prepared(tmp_path, total_limit=total_limit)
    with caplog.at_level("WARNING"), pytest.raises(UsageError, match="DistributedDataParallel"):
        _record(accelerator, model, tmp_path)
    lines = [r.getMessage() for r in caplog.records if "deletes early checkpoints" in r.getMessage()]
    if said:
        (line,) = lines
        assert line.startswith("sdc-forensics: ProjectConfiguration(total_limit=2) deletes early checkpoints")
        assert "certify --follow" in line and "\n" not in line
    else:
        assert lines == []
