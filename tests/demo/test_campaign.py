"""The fault campaign (benchmarks/campaign.py): its plan, its scoring rules, and a CI-sized campaign.

The CI-sized campaign trains 3 clean and 20 faulted conv-net runs (4-process gloo DDP) and judges
each with bisect, certify and verify-checkpoint --trace of every checkpoint; the assertions are
the issue's bar (every effective fault detected, >= 98 % exact step and rank, no false-clean
certificate, no false alarm). The full campaign's figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest

from sdc_forensics.inject import LOCATIONS, parse_spec
from tests.factories import load_benchmark

campaign = load_benchmark("campaign")


def _options(tmp_path, **kw):
    return campaign.Options(**{"faults": 56, "clean": 4, "seed": 5, "out_dir": tmp_path} | kw)


def test_plan_covers_every_location_bit_class_and_step_kind(tmp_path):
    plans = campaign.plan_runs(_options(tmp_path))
    assert plans == campaign.plan_runs(_options(tmp_path))
    assert plans != campaign.plan_runs(_options(tmp_path, seed=6))
    clean = [p for p in plans if p.fault is None]
    faulted = [p for p in plans if p.fault is not None]
    assert len(clean) == 4 and len(faulted) == 56
    assert [p.replay_threads for p in clean] == [0, 2, 0, 2]  # half the clean runs are replayed non-bitwise
    assert {p.variant for p in faulted} <= {p.variant for p in clean}  # every fault has its clean twin
    pairs = [(p.location, p.bit_class) for p in faulted]
    assert len(set(pairs[:28])) == 28 and pairs[28:] == pairs[:28]  # every (location, bit class) pair, then again
    assert {p.location for p in faulted} == set(LOCATIONS)
    checkpoints = set(range(0, 13, 4))
    for p in faulted:
        spec = parse_spec(p.fault)
        assert spec.location == p.location and spec.bit in campaign.BIT_CLASSES[p.bit_class] and 0 <= spec.rank < 4
        if p.location == "checkpoint-file":
            assert spec.step in checkpoints - {0}
            continue
        assert 0 <= spec.step <= 10  # a later step exists to see the effect on
        offset = spec.step % 4
        assert {"on_checkpoint": offset == 0, "after_checkpoint": offset == 1, "mid_interval": offset >= 2}[p.step_kind]
    kinds = {p.step_kind for p in faulted if p.location != "checkpoint-file"}
    assert kinds == set(campaign.STEP_KINDS)


def _row(fault=None, verdict="clean", first=None, suspects=(), statuses=None, verify_exit=0, location=""):
    statuses = statuses or {"0": "clean", "4": "clean", "8": "clean"}
    return {
        "fault": fault, "location": location or (parse_spec(fault).location if fault else ""), "replay_threads": 0,
        "bisect": {"verdict": verdict, "first_divergent_step": first, "error": None, "weak_candidate": None,
                   "suspects": [{"rank": r, "location": loc} for r, loc in suspects], "statuses": statuses},
        "certify": {"statuses": statuses, "error": None},
        "verify": {n: {"status": s, "exit_code": verify_exit if s == "clean" else 1, "error": None} for n, s in statuses.items()},
    }


def test_clean_run_scoring():
    assert not campaign.judge(_row())["false_alarm"]
    assert campaign.judge(_row(verdict="corruption", first=5))["false_alarm"]
    assert campaign.judge(_row(statuses={"0": "clean", "4": "clean", "8": "tainted"}))["false_alarm"]
    assert campaign.judge(_row(verify_exit=1))["false_alarm"]  # verify-checkpoint exit 1 on a clean run
    assert not campaign.judge(_row(verdict="inconclusive"))["false_alarm"]  # tolerant replay: no firm answer


def test_training_fault_scoring():
    tainted = {"0": "clean", "4": "clean", "8": "tainted"}
    fault = "update:step=5:rank=2:bit=30"
    exact = campaign.judge(_row(fault, "corruption", 5, [(2, "optimizer_update")], tainted))
    assert exact["exact_step_rank"] and exact["location_correct"] and exact["false_clean"] == []
    wrong_place = campaign.judge(_row(fault, "corruption", 5, [(2, "local_compute")], tainted))
    assert wrong_place["exact_step_rank"] and not wrong_place["location_correct"]
    assert not campaign.judge(_row(fault, "corruption", 5, [(2, "optimizer_update"), (1, "optimizer_update")], tainted))["exact_step_rank"]
    missed = campaign.judge(_row(fault))
    assert missed["missed"] and not missed["detected"] and missed["false_clean"] == ["bisect 8", "certify 8", "verify 8"]
    everyone = campaign.judge(_row("allreduce-all:step=5:rank=2:bit=30", "corruption", 5, [(None, "collective")], tainted))
    assert everyone["exact_step_rank"] and everyone["location_correct"]  # no single rank to name


def test_checkpoint_file_scoring():
    fault = "checkpoint-file:step=4:rank=3:bit=30"
    corrupt = {"0": "clean", "4": "corrupt", "8": "clean"}
    exact = campaign.judge(_row(fault, "corruption", None, [(0, "storage")], corrupt))
    assert exact["exact_step_rank"] and exact["location_correct"] and exact["false_clean"] == []
    certified = campaign.judge(_row(fault, "clean"))
    assert certified["false_clean"] == ["bisect 4", "certify 4", "verify 4"]  # the damaged file itself called clean


def test_certified_runs_are_counted():
    """Issue 21's tallies: a clean run counts as certified only when certify calls every checkpoint
    clean; a run counts as certified after 0 when certify calls any later checkpoint clean."""
    unverified = {"0": "clean", "4": "unverified", "8": "unverified"}
    rows = [_row(), _row(statuses=unverified), _row("grad:step=5:rank=2:bit=30", "corruption", 5, [(2, "local_compute")],
                                                   {"0": "clean", "4": "clean", "8": "tainted"})]
    for row, plan in zip(rows, (0, 1, 0)):
        row |= {"variant": plan, "replay_threads": 0, "train_s": 1.0, "cli_s": 1.0, "step_kind": "", "bit_class": "exponent"}
        row["outcome"] = campaign.judge(row)
        row["effect"] = {"effective": True, "effect": 9.0, "identical_before_fault": True}
    result = campaign.tally(rows, 1.0)
    assert (result["clean_runs"], result["clean_runs_certified"], result["certified_after_0"]) == (2, 1, 2)


@pytest.mark.slow
@pytest.mark.campaign
def test_ci_sized_campaign(tmp_path):
    """~20 faults and 3 clean runs through the three commands: the issue's bar, asserted."""
    options = campaign.Options(faults=20, clean=3, seed=2026, out_dir=tmp_path, steps=8, checkpoint_every=4, jobs=2)
    result = campaign.campaign(options, progress=lambda line: None)
    print({k: v for k, v in result.items() if k not in ("rows", "settings")})  # pytest -s: the figures
    assert result["errors"] == 0 and result["disagreements"] == 0 and result["twins_valid"]
    assert result["faults"] == 20 and result["clean_runs"] == 3 and result["clean_runs_tolerant"] == 1
    assert result["effective"] >= 12  # most draws change training beyond tolerance: the bar is not vacuous
    assert result["detected"] == result["effective"]
    assert result["exact_step_rank"] >= 0.98 * result["effective"]
    assert result["location_correct"] >= 0.98 * result["effective"]
    assert result["false_clean_certificates"] == 0 and result["false_clean_ineffective"] == 0
    assert result["false_alarms"] == 0
    assert result["inconclusive_clean_bitwise"] == 0  # a bitwise replay of a clean run certifies it
    assert {r["location"] for r in result["rows"] if r["fault"]} == set(LOCATIONS)
