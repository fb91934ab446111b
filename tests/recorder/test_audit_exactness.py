"""Issue 21, item 1: an audit that cannot be exact says so instead of voting. On a GPU with
non-deterministic kernels a healthy rank's recomputation may differ in the last bits, so the
recorder skips the audit (said once at the first audited step) rather than dispute a clean rank.
The rule reads only the job's global settings, so it is tested without a GPU."""

from __future__ import annotations

import pytest
import torch

from sdc_forensics.recorder.audit import inexact_reason


@pytest.fixture
def restore_flags():
    deterministic, benchmark = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = benchmark


def test_cpu_audits_are_exact_whatever_the_gpu_settings(restore_flags):
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    assert inexact_reason(torch.device("cpu")) is None


def test_a_gpu_audit_votes_only_with_deterministic_kernels(restore_flags):
    cuda = torch.device("cuda", 0)  # only its type is read: no GPU needed
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    assert "torch.use_deterministic_algorithms(False)" in inexact_reason(cuda)
    torch.use_deterministic_algorithms(True)
    assert inexact_reason(cuda) is None
    torch.backends.cudnn.benchmark = True
    assert "cudnn.benchmark=True" in inexact_reason(cuda)
