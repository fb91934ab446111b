"""``verify-checkpoint`` without ``--trace`` reads the file alone: replay options are refused, not ignored.

A user who asked for ``--threads 2`` or ``--recipe`` was shown a "VERIFIED" that had used
neither, with nothing saying so. They are a usage error (exit 2) naming the options; the
options every reading uses (the read limits) and the environment's ledger switch still pass.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from sdc_forensics.cli.main import cli


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4)}, path)
    return path


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--threads", "2"], "--threads sets"),
        (["--device", "cpu", "--recipe", "x:y"], "--recipe, --device set"),
        (["--tolerant"], "--tolerant sets"),
        (["--no-ledger"], "--no-ledger sets"),
    ],
)
def test_replay_options_without_a_trace_are_a_usage_error(checkpoint, flags, named):
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(checkpoint), *flags])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "--trace" in lines[0]


def test_the_file_alone_still_verifies(checkpoint, monkeypatch):
    monkeypatch.setenv("SDC_FORENSICS_NO_LEDGER", "1")
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(checkpoint), "--max-tensors", "10"])
    assert result.exit_code == 0, result.output
    assert "(safetensors, 1 tensor)" in result.output


@pytest.mark.parametrize("command", ["certify", "bisect"])
def test_ledger_and_no_ledger_together_are_a_usage_error(tmp_path, command):
    """A trial user's ``--ledger X --no-ledger`` was accepted in silence (the docs call them alternatives)."""
    result = CliRunner().invoke(cli, [command, str(tmp_path), "--ledger", str(tmp_path / "l.jsonl"), "--no-ledger"])
    assert result.exit_code == 2, result.output
    assert "--ledger PATH and --no-ledger are alternatives" in result.output
