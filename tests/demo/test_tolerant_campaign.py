"""The tolerant replay campaign's planning and scoring rules (benchmarks/tolerant_campaign.py), no runs."""

from __future__ import annotations

import pytest

from sdc_forensics.inject import parse_spec
from tests.factories import load_benchmark

campaign = load_benchmark("tolerant_campaign")


def _options(tmp_path, **kw):
    return campaign.CampaignOptions(**{"clean": 3, "faulted": 30, "seed": 5, "out_dir": tmp_path} | kw)


def test_plan_is_seeded_and_faults_stay_inside_the_grammar(tmp_path):
    plans = campaign.plan_runs(_options(tmp_path))
    assert plans == campaign.plan_runs(_options(tmp_path))
    assert plans != campaign.plan_runs(_options(tmp_path, seed=6))
    clean = [p for p in plans if p.kind == "clean"]
    faulted = [p for p in plans if p.kind == "faulted"]
    assert len(clean) == 3 and len(faulted) == 30 and not [p for p in plans if p.kind == "twin"]
    assert {p.variant for p in faulted} <= {p.variant for p in clean}  # every fault has a clean twin
    pairs = [(parse_spec(p.fault).location, p.step_kind) for p in faulted]
    assert len(set(pairs[:24])) == 24 and pairs[24:] == pairs[:6]  # every (location, step kind) pair once, then again
    assert {spec.location for spec in map(parse_spec, (p.fault for p in faulted))} == {
        "grad",
        "allreduce",
        "allreduce-all",
        "weights",
        "update",
        "input",
    }  # issue 19: every location
    for p in faulted:
        spec = parse_spec(p.fault)
        offset = spec.step % 10
        assert spec.location in campaign.LOCATIONS and spec.bit in campaign.BITS and 0 <= spec.rank < 4
        assert 0 <= spec.step <= 38
        assert {
            "on_checkpoint": offset == 0,
            "after_checkpoint": offset == 1,
            "before_checkpoint": offset == 9,
            "mid_interval": 2 <= offset <= 8,
        }[p.step_kind]


def test_without_clean_runs_one_twin_is_planned(tmp_path):
    plans = campaign.plan_runs(_options(tmp_path, clean=0, faulted=3))
    [twin] = [p for p in plans if p.kind == "twin"]
    assert {p.variant for p in plans} == {twin.variant}


def _row(
    kind,
    fault=None,
    verdict="clean",
    first=None,
    ranks=(),
    bisect=None,
    certify=None,
    verify=None,
    evidence=None,
    locations=(),
    recommendations=(),
):
    statuses = {"0": "clean", "10": "clean", "20": "clean"}
    return {
        "kind": kind,
        "fault": fault,
        "bisect": {
            "verdict": verdict,
            "first_divergent_step": first,
            "suspect_ranks": list(ranks),
            "suspect_locations": list(locations),
            "suspect_recommendations": list(recommendations),
            "weak_candidate": evidence,
            "statuses": bisect or statuses,
        },
        "certify": {"statuses": certify or statuses},
        "verify": {n: {"status": s} for n, s in (verify or statuses).items()},
    }


def test_a_tainted_checkpoint_in_a_clean_run_is_a_false_alarm():
    quiet = campaign.judge(_row("clean"))
    assert (quiet["false_alarm"], quiet["disagreements"]) == (False, [])
    loud = campaign.judge(_row("clean", verify={"0": "clean", "10": "clean", "20": "tainted"}))
    assert loud["false_alarm"] and loud["bad_statuses"] == ["verify 20: tainted"] and loud["disagreements"] == [20]
    assert campaign.judge(_row("clean", verdict="corruption", first=12))["false_alarm"]


def test_faulted_run_scoring():
    fault = "grad:step=13:rank=2:bit=22"
    tainted = {"0": "clean", "10": "clean", "20": "tainted"}
    exact = campaign.judge(_row("faulted", fault, "corruption", 13, [2], tainted, tainted, tainted))
    assert exact["exact_step_rank"] and exact["false_clean"] == [] and not exact["missed"]
    wrong_rank = campaign.judge(_row("faulted", fault, "corruption", 13, [1, 2], tainted, tainted, tainted))
    assert not wrong_rank["exact_step_rank"]
    missed = campaign.judge(_row("faulted", fault, certify=tainted, verify=tainted))
    assert missed["missed"] and missed["false_clean"] == ["bisect 20"] and missed["disagreements"] == [20]
    weak = campaign.judge(
        _row(
            "faulted",
            fault,
            "inconclusive",
            bisect=tainted,
            certify=tainted,
            verify=tainted,
            evidence={"step": 13, "ranks": [2]},
        )
    )
    assert weak["inconclusive"] and weak["weak_candidate_matches"] is True


def test_weak_candidate_is_the_earliest_weak_evidence():
    doc = {
        "evidence": [{"step": 15, "ranks": [0], "strength": "weak"}, {"step": 30, "ranks": [1], "strength": "strong"}],
        "hints": [{"step": 14, "ranks": [3], "strength": "weak"}],
        "suspects": [{"evidence": [{"step": 14, "ranks": [1], "strength": "weak"}]}],
    }
    assert campaign.weak_candidate(doc) == {"step": 14, "ranks": [1, 3]}
    assert campaign.weak_candidate({"evidence": [{"step": 3, "ranks": [0], "strength": "strong"}]}) is None


@pytest.mark.parametrize(
    "status,expected",
    [
        ("clean-replay-verified", "clean"),
        ("clean-trace-consistent", "clean"),
        ("clean", "clean"),
        ("tainted", "tainted"),
        (None, None),
    ],
)
def test_old_and_new_clean_spellings_count_as_clean(status, expected):
    assert campaign.normalise_status(status) == expected


def test_healthy_ranks_named_and_wrong_steps_are_counted():
    """Issue 19: corruption one step after the fault, naming every rank with "drain node" advice,
    was counted as nothing but "not exact"."""
    fault = "grad:step=23:rank=2:bit=20"
    tainted = {"0": "clean", "10": "clean", "20": "clean", "30": "tainted"}
    drain = "recurring (3 independent events): drain node n0 and take GPU g0 out of service"
    wrong = campaign.judge(
        _row("faulted", fault, "corruption", 24, [0, 1, 2, 3], tainted, tainted, tainted, recommendations=[drain])
    )
    assert wrong["healthy_ranks_named"] == [0, 1, 3] and wrong["wrong_step"] and wrong["drain_advice"]
    assert not wrong["exact_step_rank"]
    right = campaign.judge(_row("faulted", fault, "corruption", 23, [2], tainted, tainted, tainted))
    assert right["healthy_ranks_named"] == [] and not right["wrong_step"] and right["exact_step_rank"]
    collective = "allreduce-all:step=23:bit=20"
    inside = campaign.judge(
        _row("faulted", collective, "corruption", 23, [], tainted, tainted, tainted, locations=["collective"])
    )
    assert inside["exact_step_rank"] and inside["healthy_ranks_named"] == []
    assert campaign.judge(_row("faulted", collective, "corruption", 23, [1], tainted, tainted, tainted))[
        "healthy_ranks_named"
    ] == [1]
    assert campaign.judge(_row("clean", verdict="corruption", first=5, ranks=[3]))["healthy_ranks_named"] == [3]


def test_bit_classes_and_the_markdown_table():
    assert [campaign.bit_class(b) for b in (31, 30, 23, 22, 16, 15)] == [
        "sign",
        "exponent",
        "exponent",
        "high mantissa",
        "high mantissa",
        "low mantissa",
    ]
    fault = "grad:step=13:rank=2:bit=22"
    tainted = {"0": "clean", "10": "clean", "20": "tainted"}
    row = _row("faulted", fault, "corruption", 13, [2], tainted, tainted, tainted) | {
        "effect": {"effective": True, "identical_before_fault": True},
        "train_s": 1.0,
        "cli_s": 2.0,
    }
    row["outcome"] = campaign.judge(row)
    text = campaign.markdown(campaign.tally([row], 1.0) | {"rows": [row]})
    assert "| healthy ranks named as suspects (runs) | 0 (0) |" in text
    assert "| grad | high mantissa | 1 | 1 | 0 (0) | 0 |" in text
