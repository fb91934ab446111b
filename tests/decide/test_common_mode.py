"""Common-mode evidence (``decide/common_mode.py`` through ``decision.decide``): a mismatch that
every rank shows at one step is one event about the state entering it, never W faults (issue 19).

The evidence is written by hand, shaped as a tolerant replay (``--threads N``) reports it: the
records issue 19 quoted (a bit-20 flip of rank 2's local gradient at step 23, read 48x the
tolerance, graded weak; at step 24 every rank's local gradient beyond the strong threshold)
gave ``corruption`` at step 24 with all four ranks "recurring: drain node" before the rule.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from sdc_forensics.decide.decision import Examined, Verdict, decide
from sdc_forensics.evidence import Evidence, EvidenceKind, Location, Strength

W = 4


def _local(step, rank, ratio, *, source="replay"):
    """A replayed local gradient off by ``ratio`` x the tolerance, graded as replay_compare grades it."""
    strength = Strength.STRONG if ratio > 1000 else Strength.WEAK
    return Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH,
        step=step,
        ranks=(rank,),
        source=source,
        location=Location.LOCAL_COMPUTE,
        strength=strength,
        found=f"residual ({ratio}x the tolerance)",
        detail=f"rank {rank}'s local gradient",
    )


def _decide(evidence, *, world_size=W, anchors=(20,), replayed=range(20, 25), tolerant=True):
    identity = lambda r: SimpleNamespace(host=f"node{r}", gpu=f"GPU-{r}")  # noqa: E731
    return decide(
        evidence,
        world_size=world_size,
        identity=identity,
        notes=(),
        files={},
        majority={},
        examined=Examined(
            first_step=0,
            replayed=frozenset(replayed),
            tolerant_steps=frozenset(replayed if tolerant else ()),
            anchors=frozenset(anchors),
        ),
    )


def test_issue_19_common_mode_jump_after_a_weak_candidate_confirms_the_candidate():
    evidence = [_local(23, 2, 48)] + [_local(24, r, 5000 + r) for r in range(W)]
    decided = _decide(evidence)
    assert (decided.verdict, decided.first_divergent_step) == (Verdict.CORRUPTION, 23)
    [suspect] = decided.suspects
    assert (suspect.rank, suspect.location, suspect.recurring, suspect.steps) == (
        2,
        Location.LOCAL_COMPUTE,
        False,
        (23,),
    )
    assert "drain" not in suspect.recommendation
    [confirmed] = [e for e in suspect.evidence if e.step == 23]
    assert confirmed.strength is Strength.STRONG and "confirmed" in confirmed.detail
    [event] = [e for e in decided.evidence if e.step == 24]
    assert event.ranks == () and not event.affects_state and "common mode" in event.detail


def test_a_common_mode_jump_within_the_drift_range_leaves_the_candidate_named_and_inconclusive():
    evidence = [_local(23, 2, 48), _local(24, 0, 5000), _local(24, 1, 40), _local(24, 2, 3000), _local(24, 3, 9000)]
    decided = _decide(evidence)
    assert (decided.verdict, decided.first_divergent_step, decided.suspects) == (Verdict.INCONCLUSIVE, None, ())
    assert decided.weak[0].step == 23 and decided.weak[0].ranks == (2,)
    assert "step 23, rank(s) 2" in decided.settle[0] and "replay exactly" in decided.settle[0]
    assert any("common mode" in line and "candidate is step 23, rank(s) 2" in line for line in decided.settle)


def test_a_common_mode_jump_with_nothing_before_it_names_no_rank():
    decided = _decide([_local(24, r, 5000) for r in range(W)])
    assert (decided.verdict, decided.first_divergent_step, decided.suspects) == (Verdict.INCONCLUSIVE, None, ())
    assert "the cause is shared" in decided.settle[0]


def test_a_single_healthy_rank_after_a_weak_candidate_is_a_consequence_not_a_suspect():
    """Issue 19's other wrong answer: one healthy rank blamed one step after the real fault."""
    decided = _decide([_local(23, 2, 48), _local(24, 0, 4000), _local(26, 1, 7000)])
    assert (decided.verdict, decided.suspects) == (Verdict.INCONCLUSIVE, ())
    assert [e.ranks for e in decided.weak] == [(2,)]
    assert all(not e.affects_state and "consequence" in e.detail for e in decided.evidence if e.step > 23)


def test_consequences_end_where_the_replay_started_again_from_a_checkpoint():
    """A window replayed from checkpoint 30 follows the record again: a fault there is its own event."""
    decided = _decide([_local(23, 2, 48), _local(31, 1, 4000)], anchors=(20, 30), replayed=range(20, 32))
    assert (decided.verdict, decided.first_divergent_step, [s.rank for s in decided.suspects]) == (
        Verdict.CORRUPTION,
        31,
        [1],
    )


def test_the_consequences_of_one_event_are_not_recurrences():
    """A second-opinion replay that ran on past the fault named every rank at every later step."""
    evidence = (
        [_local(23, 2, 48)] + [_local(s, r, 5000) for s in (24, 25, 26) for r in range(W)] + [_local(27, 2, 8000)]
    )
    decided = _decide(evidence, replayed=range(20, 28))
    [suspect] = decided.suspects
    assert (suspect.rank, suspect.recurring, suspect.steps) == (2, False, (23,))


def test_every_rank_named_by_strong_evidence_is_a_shared_cause_never_drain_every_node():
    """Trace evidence that names every rank at once (not rank-local: it is not grouped) still never
    drains the whole job."""
    evidence = [
        Evidence(kind=EvidenceKind.WEIGHT_DIVERGENCE, step=5, ranks=(r,), location=Location.OPTIMIZER_UPDATE)
        for r in range(W)
    ]
    decided = _decide(evidence, anchors=(), replayed=())
    assert len(decided.suspects) == W
    for suspect in decided.suspects:
        assert suspect.shared and not suspect.recurring
        assert "cause is most likely shared" in suspect.recommendation and "drain node" not in suspect.recommendation


def test_an_exact_replay_keeps_its_answer():
    """Exact comparisons are strong and stop at the first divergence: one rank, its step."""
    strong = Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH, step=23, ranks=(2,), source="replay", location=Location.LOCAL_COMPUTE
    )
    decided = _decide([strong], replayed=range(20, 24))
    assert (decided.verdict, decided.first_divergent_step, [s.rank for s in decided.suspects]) == (
        Verdict.CORRUPTION,
        23,
        [2],
    )


def test_two_ranks_both_named_is_common_mode_but_one_rank_is_its_own_event():
    two = _decide([_local(7, 0, 5000), _local(7, 1, 5000)], world_size=2, anchors=(5,), replayed=range(5, 8))
    assert (two.verdict, two.suspects) == (Verdict.INCONCLUSIVE, ())
    one = _decide([_local(7, 1, 5000)], world_size=2, anchors=(5,), replayed=range(5, 8))
    [suspect] = one.suspects
    assert (one.verdict, suspect.rank, suspect.steps) == (Verdict.CORRUPTION, 1, (7,))  # steps never empty (issue 25)


def test_a_collective_candidate_is_confirmed_by_the_jump():
    """A weak all-reduce residual on every rank (ranks=(), the collective) then every rank far off."""
    reduced = Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH,
        step=23,
        ranks=(),
        source="replay",
        location=Location.COLLECTIVE,
        strength=Strength.WEAK,
        found="recorded reduced sketch off (60x the tolerance) on every rank",
    )
    decided = _decide([reduced] + [_local(24, r, 5000) for r in range(W)])
    assert (decided.verdict, decided.first_divergent_step) == (Verdict.CORRUPTION, 23)
    [suspect] = decided.suspects
    assert (suspect.rank, suspect.location) == (None, Location.COLLECTIVE)


def _rest(step, rank, reach):
    """A sharded job's weight shard changed at rest on ``rank`` (``triage/trace_only._RestState``):
    shared with every rank of ``reach``, which gathered it."""
    return Evidence(
        kind=EvidenceKind.WEIGHT_DIVERGENCE,
        step=step,
        ranks=(rank,),
        source="trace",
        location=Location.STATE_AT_REST,
        strength=Strength.STRONG,
        shared=True,
        reach=tuple(reach),
        detail=f"rank {rank}'s shard changed at rest",
    )


@pytest.mark.parametrize("mismatched", [(0, 2), (0, 1, 2, 3), (3,)])
def test_a_shard_changed_at_rest_is_the_one_suspect_whichever_ranks_its_replica_computed_differently(mismatched):
    """Pure FSDP: the replica is the whole world. Every rank gathered rank 1's changed shard, but
    computed in bfloat16 a small change can leave some ranks' gradients bit for bit (the campaign's
    weights:step=5:rank=1:bit=19 changed ranks 0 and 2 only): whichever ranks differ, the shard's
    owner is the one suspect (an exact replay, so strong mismatches)."""
    evidence = [_rest(5, 1, range(W))] + [_local(5, r, 10**6) for r in mismatched]
    decided = _decide(evidence, anchors=(4,), replayed=range(4, 6))
    assert decided.verdict is Verdict.CORRUPTION and decided.first_divergent_step == 5
    assert [(s.rank, s.location) for s in decided.suspects] == [(1, Location.STATE_AT_REST)]


def test_every_rank_wrong_at_the_step_a_replay_started_from_names_the_recipe_not_the_step_before():
    """A replay from checkpoint 20, whose weights equal the record's, finds every rank's local
    gradient of step 20 wrong (a recipe that fetches the wrong microbatch, or scales its loss):
    nothing before step 20 made it, so the event names the recipe; before, it blamed "step 19",
    which no replay ran. Inconclusive, never a rank."""
    decided = _decide([_local(20, r, 9000) for r in range(W)], tolerant=False)
    assert decided.verdict is Verdict.INCONCLUSIVE and decided.suspects == ()
    [event] = decided.evidence
    assert "the first step replayed from checkpoint 20" in event.detail and "recipe" in event.detail
    assert "step 19" not in event.detail


def test_an_input_data_suspect_is_sent_to_the_recipe_and_the_host_not_to_a_gpu_diagnostic():
    """A rank whose recorded input bytes differ from its microbatches fetched again: a recipe whose
    fetch_microbatch returns other bytes for one ID looks exactly like this, so the advice names the
    recipe before the host's data path, and no GPU diagnostic (a new user's trial, stop 51)."""
    from sdc_forensics.decide.decision import Suspect

    suspect = Suspect(
        rank=2, host="node7", gpu="GPU-1", location=Location.INPUT_DATA, recurring=False, steps=(2,), evidence=()
    )
    assert "fetch_microbatch" in suspect.recommendation and "node7" in suspect.recommendation
    assert "DCGM" not in suspect.recommendation and "drain" not in suspect.recommendation
    again = dataclasses.replace(suspect, recurring=True, steps=(2, 9))
    assert "drain node node7" in again.recommendation
