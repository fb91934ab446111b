"""Issue 24's changes outside the adapters, without any framework installed: the manifest's
optional ``framework`` key (absent in older traces, which read as before; a damaged one refused),
and ``verify-checkpoint`` reading Lightning's ModelCheckpoint scores (infinite by design) without
calling them NaN/Inf while a NaN in training state is still found."""

from __future__ import annotations

import json

import pytest
import torch

from sdc_forensics.checkpoint.findings import FindingKind
from sdc_forensics.checkpoint.verify import verify_checkpoint
from sdc_forensics.errors import TraceError
from sdc_forensics.trace.manifest import parse_manifest


def _manifest(trace_dir, **extra) -> dict:
    doc = json.loads((trace_dir / "manifest.json").read_text())
    doc.update(extra)
    return doc


def test_the_framework_key_is_optional_and_checked(make_trace):
    trace = make_trace(ranks=2, steps=3)
    old = parse_manifest(_manifest(trace))
    assert old.framework is None and "framework" not in old.to_json()
    fw = {"name": "transformers", "version": "5.24.0", "adapter": "sdc_forensics.integrations.hf"}
    new = parse_manifest(_manifest(trace, framework=fw))
    assert new.framework == fw and new.to_json()["framework"] == fw
    with pytest.raises(TraceError, match="framework"):
        parse_manifest(_manifest(trace, framework={"name": 7}))


def test_modelcheckpoint_scores_may_be_infinite_but_training_state_may_not(tmp_path):
    key = "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 3}"
    # EarlyStopping's best_score is inf before the first validation (a trial user's clean .ckpt was called NaN/Inf)
    stopping = "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"
    state = {
        "state_dict": {"w": torch.ones(3)},
        "callbacks": {
            key: {"kth_value": torch.tensor(float("inf")), "best_model_score": None},
            stopping: {"best_score": torch.tensor(float("inf")), "wait_count": 0},
        },
    }
    torch.save(state, tmp_path / "a.ckpt")
    report = verify_checkpoint(tmp_path / "a.ckpt")
    assert not [f for f in report.findings if f.kind is FindingKind.NONFINITE]
    assert all(t.status == "ok" for t in report.tensors)  # the scores' table rows too
    state["state_dict"]["w"][1] = float("nan")
    state["callbacks"]["Other"] = {
        "kth_value": torch.tensor(float("inf"))
    }  # only ModelCheckpoint's scores are bookkeeping
    torch.save(state, tmp_path / "b.ckpt")
    found = {f.subject for f in verify_checkpoint(tmp_path / "b.ckpt").findings if f.kind is FindingKind.NONFINITE}
    assert found == {"state_dict.w", "callbacks.Other.kth_value"}


def test_a_refusal_is_one_line_on_rank_0_and_exit_2_without_a_traceback(tmp_path):
    """Issue 40: an adapter's refusal is a UsageError that is also a SystemExit(2): uncaught, the
    process exits 2 with the one line rank 0 printed, no traceback; other ranks print nothing."""
    import subprocess
    import sys

    from sdc_forensics.errors import UsageError
    from sdc_forensics.integrations._common import Refusal
    from tests.integrations.launch import REPO

    assert issubclass(Refusal, UsageError) and issubclass(Refusal, SystemExit)
    script = "from sdc_forensics.integrations._common import refuse\nraise refuse('bf16 is not replayed: train in float32')\n"
    for rank, expected in (("0", "sdc-forensics: bf16 is not replayed: train in float32\n"), ("1", "")):
        ran = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={"PYTHONPATH": str(REPO), "RANK": rank, "PATH": "/usr/bin:/bin"},
            timeout=120,
        )
        assert (ran.returncode, ran.stderr) == (2, expected), ran.stderr


def test_a_compiled_submodule_anywhere_in_the_model_is_found():
    from sdc_forensics.integrations._common import compile_refusal, compiled_parts, random_parts

    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    )
    assert compiled_parts(model) == [] and compile_refusal(model) == []
    assert random_parts(model) == ["1.1"]
    model[1][0] = torch.compile(model[1][0])  # an OptimizedModule: its state dict keys gain "_orig_mod."
    assert compiled_parts(model) == ["1.0"]
    (line,) = compile_refusal(model)
    assert "torch.compile wraps '1.0'" in line and "_orig_mod" in line
    inplace = torch.nn.Linear(2, 2)
    inplace.compile()  # nn.Module.compile(): the module itself, in place
    assert compiled_parts(inplace) == ["the model itself"]
    assert random_parts(torch.nn.Dropout(0.0)) == []


def test_an_adapter_closing_on_an_alarm_braces_the_rank_for_exit_on_alarm_first(monkeypatch):
    """Issue 40: each adapter closes its trace on the way out through ``_common.close_on_error``. On an
    SdcAlarm inside an ``exit_on_alarm`` block it first ignores SIGTERM, as the recorder's own ``with``
    does, so that under torchrun a peer exiting 18 first cannot have this rank killed mid-close; on
    anything else (KeyboardInterrupt) SIGTERM stays the job's. Leaving the block gives SIGTERM back."""
    import signal

    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.integrations._common import close_on_error
    from sdc_forensics.recorder import exit_on_alarm

    seen = []

    class Recorder:
        def close(self, *, on_error):
            seen.append((on_error, signal.getsignal(signal.SIGTERM)))

    # a fresh process: an earlier in-process test whose alarm left exit_on_alarm (a SystemExit pytest caught) left this
    # process braced for an exit that never came: SIGTERM ignored and the module's state saying so
    from sdc_forensics.recorder import exit as exit_module

    monkeypatch.setattr(exit_module, "_saved_sigterm", exit_module._NOT_BRACED)
    monkeypatch.setattr(exit_module, "_exiting", False)
    monkeypatch.setattr(exit_module, "_armed", 0)
    outer = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        before = signal.getsignal(signal.SIGTERM)
        assert before is not signal.SIG_IGN
        with exit_on_alarm():
            close_on_error(Recorder(), KeyboardInterrupt())
            close_on_error(None, KeyboardInterrupt())  # training left before the recorder was made: nothing to close
            close_on_error(Recorder(), SdcAlarm("allreduce check fired", step=2, rank=1))
        assert seen == [(True, before), (True, signal.SIG_IGN)]
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        signal.signal(signal.SIGTERM, outer)


def test_the_recorded_optimizer_is_the_same_in_every_attempt_under_a_schedule():
    """A trial user's HF job with warmup: attempt 0 recorded the live rate 0.0 and the resume 6.8e-4, so the
    manifest's recipe arguments changed and every ledger record made before the resume was 'other job settings:
    not reused'. The schedule's base rate is recorded instead; the live one comes back with each checkpoint."""
    from sdc_forensics.integrations._common import build_optimizer, optimizer_spec

    model = torch.nn.Linear(3, 2)
    specs = []
    for steps in (0, 7):  # attach at the start, and at a resume 7 steps into the warmup
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / 10))
        for _ in range(steps):
            optimizer.step()
            schedule.step()
        specs.append(optimizer_spec(optimizer, model))
    assert specs[0] == specs[1] and specs[0]["groups"][0]["options"]["lr"] == 1e-3
    rebuilt = build_optimizer(specs[1], model)
    rebuilt.load_state_dict(optimizer.state_dict())  # what every replay does: the live rate is the checkpoint's
    assert rebuilt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 7e-4
