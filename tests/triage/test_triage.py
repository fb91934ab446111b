"""Triage on synthetic traces: one test per evidence kind the trace alone gives."""

from __future__ import annotations

import subprocess
import sys


from sdc_forensics.evidence import EvidenceKind, Location
from sdc_forensics.triage.trace_only import TriageOptions, triage_trace
from sdc_forensics.trace.reader import Trace
from tests.factories import Fault


def _triage(path, **options):
    return triage_trace(Trace.open(path), TriageOptions(**options))


def test_clean_trace_has_no_findings(make_trace):
    result = _triage(make_trace())
    assert result.findings == ()
    assert result.first_suspect_step is None and result.suspect_window is None
    assert result.step_range == (0, 19)
    assert result.weights_checked == 20


def test_nonfinite_local_gradient_names_step_and_rank(make_trace):
    result = _triage(make_trace(fault=Fault(kind="nonfinite", step=7, rank=2)))
    [ev] = result.findings
    assert (ev.kind, ev.step, ev.ranks, ev.location) == (EvidenceKind.NONFINITE, 7, (2,), Location.LOCAL_COMPUTE)
    assert result.first_suspect_step == 7 and result.suspect_window == (7, 7)


def test_allreduce_on_one_rank_is_collective_on_that_rank(make_trace):
    result = _triage(make_trace(fault=Fault(kind="allreduce", step=5, rank=3)))
    [ev] = result.findings
    assert (ev.kind, ev.step, ev.ranks, ev.location) == (EvidenceKind.ALLREDUCE_MISMATCH, 5, (3,), Location.COLLECTIVE)


def test_allreduce_on_all_ranks_is_seen_only_by_the_sketch(make_trace):
    result = _triage(make_trace(fault=Fault(kind="allreduce-all", step=11)))
    [ev] = result.findings
    assert (ev.kind, ev.step, ev.ranks, ev.location) == (EvidenceKind.ALLREDUCE_MISMATCH, 11, (), Location.COLLECTIVE)
    assert result.first_suspect_step == 11


def test_weight_divergence_reported_at_onset_only(make_trace):
    result = _triage(make_trace(fault=Fault(kind="weights", step=9, rank=1)))
    [ev] = result.findings  # steps 10..19 keep diverging: one onset, not eleven
    assert (ev.kind, ev.step, ev.ranks) == (EvidenceKind.WEIGHT_DIVERGENCE, 9, (1,))
    assert result.first_suspect_step == 9


def test_sparse_weight_checks_widen_the_suspect_window(make_trace):
    result = _triage(make_trace(fault=Fault(kind="weights", step=9, rank=1), weights_every=4))
    [ev] = result.findings
    assert ev.step == 12  # first comparison after the fault
    assert result.suspect_window == (9, 12)  # equal at step 8: the fault is in 9..12
    assert result.first_suspect_step == 9


def test_audit_subject_loses_majority_of_three(make_trace):
    result = _triage(make_trace(fault=Fault(kind="audit-subject", step=6, rank=2), audit_every=2))
    [ev] = result.findings
    assert (ev.kind, ev.step, ev.ranks, ev.location) == (EvidenceKind.AUDIT_MISMATCH, 6, (2,), Location.LOCAL_COMPUTE)
    assert ev.affects_state and result.first_suspect_step == 6


def test_wrong_auditor_does_not_mark_the_training_state(make_trace):
    result = _triage(make_trace(fault=Fault(kind="audit-auditor", step=4), audit_every=2))
    [ev] = result.findings
    assert ev.kind is EvidenceKind.AUDIT_MISMATCH and ev.ranks == (2,)  # the auditor of subject 0
    assert not ev.affects_state
    assert result.first_suspect_step is None


def test_input_digest_mismatch_from_audit(make_trace):
    result = _triage(make_trace(fault=Fault(kind="input", step=8), audit_every=4))
    [ev] = result.findings
    assert (ev.kind, ev.step, ev.ranks, ev.location) == (EvidenceKind.INPUT_MISMATCH, 8, (0,), Location.INPUT_DATA)


def test_outlier_is_a_hint_only(make_trace):
    result = _triage(make_trace(fault=Fault(kind="outlier", step=3, rank=1)))
    assert result.findings == ()
    [hint] = result.hints
    assert (hint.kind, hint.step, hint.ranks) == (EvidenceKind.OUTLIER, 3, (1,))
    assert result.first_suspect_step is None


def test_windows_do_not_change_the_result(make_trace):
    path = make_trace(fault=Fault(kind="weights", step=9, rank=1), steps=40)
    assert _triage(path, window_steps=3).evidence == _triage(path).evidence


def test_triage_does_not_import_torch(make_trace):
    path = make_trace(fault=Fault(kind="nonfinite", step=2, rank=0))
    code = (
        "import sys; from sdc_forensics.trace.reader import Trace; from sdc_forensics.triage.trace_only import triage_trace;"
        f"r = triage_trace(Trace.open({str(path)!r})); assert r.first_suspect_step == 2; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resumed_run_uses_the_latest_attempt(make_trace, tmp_path):
    path = tmp_path / "resumed"
    make_trace(steps=20, fault=Fault(kind="weights", step=15, rank=2), bulk=True, path=path)
    make_trace(steps=10, bulk=True, attempt=1, start_step=10, path=path)  # resumed from checkpoint 10, healthy
    result = _triage(path)
    assert result.findings == () and result.first_suspect_step is None
    assert result.superseded_cells == 10 * 4
