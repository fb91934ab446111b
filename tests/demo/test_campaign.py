"""The fault campaign (benchmarks/campaign.py): its plan, its scoring rules, and a CI-sized campaign.

The CI-sized campaign trains 3 clean and 20 faulted conv-net runs (4-process gloo DDP) and judges
each with bisect, certify and verify-checkpoint --trace of every checkpoint; the assertions are
the issue's bar (every effective fault detected, >= 98 % exact step and rank, no false-clean
certificate, no false alarm), and of the online checks alone (bisect --trace-only) what holds by
construction whatever the draw: no false alarm, no wrong rank named for a local-gradient fault, no
checkpoint-file flip seen. The full campaign's figures are in docs/benchmarks.md.
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


def _answer(verdict="clean", first=None, suspects=(), statuses=None):
    """What campaign.py keeps of one bisect --json document."""
    return {
        "verdict": verdict,
        "first_divergent_step": first,
        "error": None,
        "weak_candidate": None,
        "suspects": [{"rank": r, "location": loc} for r, loc in suspects],
        "statuses": statuses or {"0": "clean", "4": "clean", "8": "clean"},
    }


def _row(
    fault=None, verdict="clean", first=None, suspects=(), statuses=None, verify_exit=0, location="", trace_only=None
):
    statuses = statuses or {"0": "clean", "4": "clean", "8": "clean"}
    row = {
        "fault": fault,
        "location": location or (parse_spec(fault).location if fault else ""),
        "replay_threads": 0,
        "bisect": _answer(verdict, first, suspects, statuses),
        "certify": {"statuses": statuses, "error": None},
        "verify": {
            n: {"status": s, "exit_code": verify_exit if s == "clean" else 1, "error": None}
            for n, s in statuses.items()
        },
    }
    return row if trace_only is None else row | {"trace_only": trace_only}


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
    assert not campaign.judge(
        _row(fault, "corruption", 5, [(2, "optimizer_update"), (1, "optimizer_update")], tainted)
    )["exact_step_rank"]
    missed = campaign.judge(_row(fault))
    assert (
        missed["missed"] and not missed["detected"] and missed["false_clean"] == ["bisect 8", "certify 8", "verify 8"]
    )
    everyone = campaign.judge(
        _row("allreduce-all:step=5:rank=2:bit=30", "corruption", 5, [(None, "collective")], tainted)
    )
    assert everyone["exact_step_rank"] and everyone["location_correct"]  # no single rank to name


def test_a_weight_changed_at_rest_is_located_at_rest_not_in_the_compute():
    """A ``weights`` fault (a parameter flipped after one update, before the next forward) is only
    located right as ``state_at_rest``: the step and rank alone, blamed on the forward/backward
    (``local_compute``, what bisect said before issue 33), score as the wrong place."""
    tainted = {"0": "clean", "4": "clean", "8": "tainted"}
    fault = "weights:step=5:rank=2:bit=30"
    at_rest = campaign.judge(_row(fault, "corruption", 5, [(2, "state_at_rest")], tainted))
    assert at_rest["exact_step_rank"] and at_rest["location_correct"] and at_rest["false_clean"] == []
    in_compute = campaign.judge(_row(fault, "corruption", 5, [(2, "local_compute")], tainted))
    assert in_compute["exact_step_rank"] and not in_compute["location_correct"]


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
    rows = [
        _row(),
        _row(statuses=unverified),
        _row(
            "grad:step=5:rank=2:bit=30",
            "corruption",
            5,
            [(2, "local_compute")],
            {"0": "clean", "4": "clean", "8": "tainted"},
        ),
    ]
    for row, plan in zip(rows, (0, 1, 0)):
        row |= {
            "variant": plan,
            "replay_threads": 0,
            "train_s": 1.0,
            "cli_s": 1.0,
            "step_kind": "",
            "bit_class": "exponent",
        }
        row["outcome"] = campaign.judge(row)
        row["effect"] = {"effective": True, "effect": 9.0, "identical_before_fault": True}
    result = campaign.tally(rows, 1.0)
    assert (result["clean_runs"], result["clean_runs_certified"], result["certified_after_0"]) == (2, 1, 2)


def test_trace_only_scoring():
    """The trace-only answer is judged by the replay's rules; a row from before it says None (not measured)."""
    unverified = {"0": "clean", "4": "unverified", "8": "unverified"}
    assert campaign.judge(_row(trace_only=_answer("clean", statuses=unverified)))["trace_only_false_alarm"] is False
    assert (
        campaign.judge(_row(trace_only=_answer("inconclusive", statuses=unverified)))["trace_only_false_alarm"] is False
    )
    assert (
        campaign.judge(_row(trace_only=_answer("corruption", 5, [(1, "collective")])))["trace_only_false_alarm"] is True
    )
    assert campaign.judge(_row(trace_only=_answer(statuses={"0": "clean", "4": "corrupt", "8": "unverified"})))[
        "trace_only_false_alarm"
    ]
    tainted = {"0": "clean", "4": "clean", "8": "tainted"}
    fault, replay = "allreduce:step=5:rank=2:bit=30", ("corruption", 5, [(2, "collective")], tainted)
    right = campaign.judge(_row(fault, *replay, trace_only=_answer("corruption", 5, [(2, "collective")], tainted)))
    assert (right["trace_only_detected"], right["trace_only_exact"], right["trace_only_wrong_ranks"]) == (
        True,
        True,
        [],
    )
    wrong = campaign.judge(
        _row(fault, *replay, trace_only=_answer("corruption", 5, [(1, "collective"), (2, "collective")]))
    )
    assert (wrong["trace_only_detected"], wrong["trace_only_exact"], wrong["trace_only_wrong_ranks"]) == (
        True,
        False,
        [1],
    )
    late = campaign.judge(_row(fault, *replay, trace_only=_answer("corruption", 6, [(2, "collective")])))
    assert (late["trace_only_exact"], late["trace_only_wrong_ranks"]) == (False, [])  # the right rank, a step late
    unseen = campaign.judge(_row(fault, *replay, trace_only=_answer("inconclusive")))
    assert (unseen["trace_only_detected"], unseen["trace_only_exact"], unseen["trace_only_wrong_ranks"]) == (
        False,
        False,
        [],
    )
    everyone = campaign.judge(
        _row("allreduce-all:step=5:rank=2:bit=30", *replay, trace_only=_answer("corruption", 5, [(None, "collective")]))
    )
    assert everyone["trace_only_exact"] and everyone["trace_only_wrong_ranks"] == []  # no single rank to name
    old = campaign.judge(_row(fault, *replay))
    assert old["exact_step_rank"] and old["trace_only_detected"] is None and old["trace_only_exact"] is None


def test_trace_only_tally():
    """Rates per location over effective faults, counted by hand; an older campaign's rows: not measured."""
    tainted = {"0": "clean", "4": "clean", "8": "tainted"}
    seen = _answer("corruption", 5, [(2, "collective")], tainted)
    rows = [
        _row(trace_only=_answer()),
        _row("allreduce:step=5:rank=2:bit=30", "corruption", 5, [(2, "collective")], tainted, trace_only=seen),
        _row(
            "allreduce:step=5:rank=2:bit=20",
            "corruption",
            5,
            [(2, "collective")],
            tainted,
            trace_only=_answer("inconclusive"),
        ),
        _row("grad:step=5:rank=2:bit=30", "corruption", 5, [(2, "local_compute")], tainted, trace_only=_answer()),
        _row("grad:step=5:rank=2:bit=1", "corruption", 5, [(2, "local_compute")], tainted, trace_only=_answer()),
    ]
    for row, effective, bits in zip(
        rows, (None, True, True, True, False), ("", "exponent", "high_mantissa", "exponent", "low_mantissa")
    ):
        row |= {"variant": 0, "train_s": 1.0, "cli_s": 1.0, "step_kind": "", "bit_class": bits}
        row["outcome"] = campaign.judge(row)
        row["effect"] = {"effective": effective, "effect": 9.0, "identical_before_fault": True}
    result = campaign.tally(rows, 1.0)
    assert result["trace_only_measured"] and (
        result["effective"],
        result["trace_only_detected"],
        result["trace_only_exact"],
    ) == (3, 1, 1)
    assert result["by_location"]["allreduce"] == {
        "faults": 2,
        "effective": 2,
        "detected": 2,
        "exact_step_rank": 2,
        "trace_only_detected": 1,
        "trace_only_exact": 1,
    }
    rates = result["trace_only_rates"]
    assert rates["by_location"]["allreduce"]["trace_only_detection_rate"] == 0.5
    assert rates["by_location"]["grad"] == {
        "faults": 2,
        "effective": 1,
        "replay_detected": 1,
        "replay_exact": 1,
        "trace_only_detected": 0,
        "trace_only_exact": 0,
        "trace_only_detection_rate": 0.0,
        "trace_only_exact_rate": 0.0,
    }
    assert rates["overall"]["trace_only_detection_rate"] == round(1 / 3, 4) and rates["trace_only_false_alarms"] == 0
    for row in rows:
        del row["trace_only"]
        row["outcome"] = campaign.judge(row)
    old = campaign.tally(rows, 1.0)
    assert (
        old["trace_only_measured"] is False and old["trace_only_detected"] is None and old["trace_only_rates"] is None
    )
    assert (old["detected"], old["exact_step_rank"]) == (3, 3)  # the replay's tallies as before


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
    # The online checks alone (bisect --trace-only), true of any draw, not of this one:
    assert (
        result["trace_only_measured"] and result["trace_only_false_alarms"] == 0
    )  # its evidence is a subset of the replay's
    for row in result["rows"]:
        if row["location"] == "grad":  # only the faulted rank's local gradient differs between ranks at the fault step
            assert row["outcome"]["trace_only_wrong_ranks"] == [], row["fault"]
        if (
            row["location"] == "checkpoint-file"
        ):  # the flip is made after the save, in the file, which trace-only never reads
            assert row["outcome"]["trace_only_detected"] is False, row["fault"]


def test_a_sharded_plan_draws_the_sharded_locations_only(tmp_path):
    for parallel in ("fsdp", "hsdp"):
        plans = campaign.plan_runs(_options(tmp_path, parallel=parallel))
        drawn = {p.location for p in plans if p.fault is not None}
        assert drawn == set(campaign.SHARDED_LOCATIONS[parallel])
        for plan in plans:
            if plan.fault is not None:
                assert campaign.EXPECTED_LOCATION[plan.location]  # every drawn location has an expected blame
    with pytest.raises(SystemExit, match="DDP's"):
        _options(tmp_path, parallel="fsdp", reduction="ordered")


@pytest.mark.slow
@pytest.mark.campaign
def test_ci_sized_sharded_campaign(tmp_path):
    """10 faults and 2 clean runs of the FSDP2 job (4 gloo ranks, the ordered reduce-scatter) through
    the same commands and rules: the issue's bar, asserted. The job is the one people run (issue 33):
    a tied-head transformer with AdamW whose clip_grad_norm_ engages on every step; every effective
    fault must also be blamed on the right place (an all-gather output changed on one rank is its
    local compute, not its weights at rest)."""
    options = campaign.Options(
        faults=10,
        clean=2,
        seed=2027,
        out_dir=tmp_path,
        steps=8,
        checkpoint_every=4,
        jobs=2,
        parallel="fsdp",
        job="clipped-lm",
    )
    result = campaign.campaign(options, progress=lambda line: None)
    print({k: v for k, v in result.items() if k not in ("rows", "settings")})
    assert result["errors"] == 0 and result["disagreements"] == 0 and result["twins_valid"]
    assert result["effective"] >= 6
    assert result["detected"] == result["effective"]
    assert result["exact_step_rank"] >= 0.98 * result["effective"]
    assert result["false_clean_certificates"] == 0 and result["false_alarms"] == 0
    assert result["inconclusive_clean_bitwise"] == 0  # the bitwise replay of a clean sharded run certifies it
    assert result["trace_only_false_alarms"] == 0
    assert result["location_correct"] == result["effective"], result["not_exact"]
