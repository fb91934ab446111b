"""Coverage per checkpoint: each step before it counted once, under the strongest examination it had.

Spans are checked against values worked out by hand for a run of steps 0..39, checkpoints every
10: the ledger holds 0..9 exactly, this analysis replayed 10..19 exactly and 20..29 exactly up to
step 24 then within tolerance, and 30..39 was not replayed.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from sdc_forensics.decide.common_mode import UPDATE_NOT_REPRODUCED
from sdc_forensics.decide.verdict import LedgerSummary, ReplayedWindow, ReplaySummary, ReusedWindow
from sdc_forensics.forensics.certify import coverage_of
from sdc_forensics.present.coverage import coverage_text
from sdc_forensics.evidence import Evidence, EvidenceKind, Location

RECORD = "a" * 32


def _result():
    windows = (
        ReplayedWindow(start=10, stop=19, last=19, comparison="exact", tolerant_from=None, reason=""),
        ReplayedWindow(start=20, stop=29, last=29, comparison="tolerant", tolerant_from=25, reason=""),
    )
    ledger = LedgerSummary(path="ledger.jsonl", reused=(ReusedWindow(start=0, last=9, record_ids=(RECORD,)),))
    checkpoints = tuple(SimpleNamespace(step=n) for n in (0, 10, 20, 30, 40, 50))
    return SimpleNamespace(
        step_range=(0, 39), replayed=ReplaySummary(windows=windows, ledger=ledger), checkpoints=checkpoints, evidence=()
    )


def test_each_step_counts_once_under_its_strongest_examination():
    by_step = {c.step: c for c in coverage_of(_result())}
    assert by_step[0].exact_now == by_step[0].exact_ledger == by_step[0].lacking_replay == ()
    assert (by_step[10].exact_ledger, by_step[10].exact_now, by_step[10].record_ids) == (((0, 9),), (), (RECORD,))
    assert by_step[20].exact_now == ((10, 19),) and by_step[20].lacking_replay == ()
    assert by_step[30].exact_now == ((10, 24),) and by_step[30].tolerant == ((25, 29),)
    assert by_step[40].online_only == ((30, 39),) and by_step[40].lacking_replay == ((25, 39),)
    assert by_step[50].nothing == ((40, 49),) and by_step[50].lacking_replay == ((25, 49),)


def test_a_step_whose_update_the_replay_did_not_reproduce_is_not_exact():
    """Step 12 replayed, its gradients matched, its update not (``decide/common_mode.py`` rule 5): it
    lacks exact replay, under its own heading, and the steps around it stay exact."""
    off = Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH,
        step=12,
        location=Location.OPTIMIZER_UPDATE,
        source="replay",
        affects_state=False,
        detail=f"{UPDATE_NOT_REPRODUCED}: ...",
    )
    by_step = {c.step: c for c in coverage_of(_with(off))}
    assert by_step[10].unreproduced == () and by_step[20].unreproduced == ((12, 12),)
    assert by_step[20].exact_now == ((10, 11), (13, 19)) and by_step[20].lacking_replay == ((12, 12),)
    assert by_step[40].lacking_replay == ((12, 12), (25, 39))
    assert "replayed, not reproduced 12" in coverage_text(by_step[20])


def test_a_step_whose_local_gradients_the_replay_did_not_reproduce_is_not_exact():
    """Every rank's local gradient of step 12 differs from the replay's (the common-mode event of a
    recipe that accumulates wrong): not exact either; it was listed "exact now"."""
    off = Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH,
        step=12,
        ranks=(0, 1),
        location=Location.UNKNOWN,
        source="replay",
        detail="common mode: every rank's local gradient differs ...",
    )
    by_step = {c.step: c for c in coverage_of(_with(off))}
    assert by_step[20].unreproduced == ((12, 12),) and by_step[20].exact_now == ((10, 11), (13, 19))


def _with(*evidence):
    result = _result()
    result.evidence = evidence
    return result


def test_the_line_for_people_names_what_lacks_replay():
    line = coverage_text(coverage_of(_result())[4])
    assert line == (
        "checkpoint 40: exact now 10..24; exact from the ledger 0..9; tolerant 25..29; online checks only 30..39"
        " — lacks exact replay: steps 25..39"
    )


def test_the_reports_unverified_checkpoint_names_its_online_checks_cost_and_the_measured_rate():
    from sdc_forensics.decide.coverage import ReplayCost, coverage_of
    from sdc_forensics.present.coverage import online_rate_line
    from sdc_forensics.present.report import not_checked
    from sdc_forensics.trace.online import OnlineChecks

    result = _result()
    status = SimpleNamespace(value="unverified")
    result.checkpoints = (SimpleNamespace(step=40, status=status, reasons=["steps 30..39 were not replayed"]),)
    result.mode, result.damage, result.settle = "replay", (), ()
    (c40,) = [c for c in coverage_of(result) if c.step == 40]
    c40 = dataclasses.replace(
        c40,
        online=OnlineChecks(steps=10, complete=10, gradients=10, weights=10, world_size=4),
        cost=ReplayCost(rank_steps=60, seconds_per_rank_step=0.5, records=3),
    )
    lines = not_checked(result, None, (c40,))
    assert lines[0] == (
        "Checkpoint 40 is unverified: steps 30..39 were not replayed (steps without an exact replay: 25..39; online "
        "checks on the steps not replayed: NaN/Inf and all-reduce sketch on every step; replica vote (4 replicas) on "
        "every step; replaying them costs about 30 s (60 rank-steps x 0.5 s measured per rank-step over 3 ledger "
        "record(s)))."
    )
    assert online_rate_line() and lines[1] == f"For the steps the online checks alone examined: {online_rate_line()}."
