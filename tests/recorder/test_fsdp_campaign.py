"""A CI-sized run of ``benchmarks/fsdp_campaign.py``: faults at every FSDP2/HSDP location on real
``fully_shard`` jobs (a tied-head transformer, AdamW, clipping that engages on every step), with
what the online checks must get right whatever the draw."""

from __future__ import annotations

from tests.factories import load_benchmark

fsdp_campaign = load_benchmark("fsdp_campaign")


def test_the_online_checks_never_blame_a_healthy_rank_and_catch_what_they_promise():
    trials, fired, clipped = fsdp_campaign.run(faults=18, clean=2, seed=2026)
    assert fired is not None, "every rank reaches the same result"
    for fault, (steps_clipped, steps_updated) in zip(trials, clipped):  # the job clips on every step it updates
        assert steps_clipped == steps_updated and (fault is not None or steps_updated == fsdp_campaign.STEPS), (
            fault,
            clipped,
        )
    outcomes = [fsdp_campaign.judge(fault, seen) for fault, seen in zip(trials, fired)]
    assert {f["location"] for f in trials if f} == set(fsdp_campaign.LOCATIONS)
    for fault, seen, outcome in zip(trials, fired, outcomes):
        if fault is None:
            assert outcome == "clean", seen  # no false alarm
            continue
        assert all(int(step) >= fault["step"] for step in seen), (fault, seen)  # nothing fires before the fault
        location = fault["location"]
        if location in ("local-gradient-nan", "gathered"):  # a NaN is counted; a gathered copy is digested exactly
            assert outcome == "exact", (fault, seen)
        elif location == "weights-shard":  # 2 replicas: always detected (exact digests), never attributed
            assert outcome == "detected" and seen[str(fault["step"])] == [], (fault, seen)
        else:  # sketch checks (and a finite local gradient, summed consistently): the right rank, or nothing
            assert outcome in ("exact", "missed"), (fault, seen)
            if location != "local-gradient" and fault["bit"] == 30:  # an exponent's top bit: far above tolerance
                assert outcome == "exact", (fault, seen)
