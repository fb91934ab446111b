"""``replay/pp_exact.through_handoffs``: a forward that goes wrong in one pipeline stage reaches the
other stages of its pipeline (the later ones through what it hands on, the earlier ones through the
gradients it hands back). With the hand-offs the job recorded (HANDOFF records) the replay at the
job's layout puts those mismatches on the stage the forward went wrong in; a stage whose hand-offs
match, or another data-parallel coordinate, keeps its own evidence."""

from __future__ import annotations

from sdc_forensics.evidence import Evidence, EvidenceKind, Location
from sdc_forensics.replay.pp_exact import through_handoffs
from tests.factories import grid_mesh

# PP 2 x DP 2: rank = pp * 2 + dp; ranks 0 and 2 share a pipeline, 1 and 3
PP = grid_mesh("pp", ("pp", "dp"), (2, 2), shard_dim=1, pp_dim=0, stages=(0, 1))
# PP 2 x DP 2 x TP 2: rank = (pp * 2 + dp) * 2 + tp; ranks 0, 1, 4, 5 share a pipeline
THREE_D = grid_mesh(
    "pp", ("pp", "dp", "tp"), (2, 2, 2), shard_dim=1, pp_dim=0, tp_dim=2, stages=(0, 1), tp_shards=(-1, -1)
)
SAME, OTHER = (5, 6), (7, 8)


def _mismatch(rank: int) -> Evidence:
    return Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH,
        step=4,
        ranks=(rank,),
        source="replay",
        location=Location.LOCAL_COMPUTE,
        detail="",
    )


def _handoffs(world: int, last: set, sent_off=(), back_off=()) -> dict:
    """rank -> (recorded, replayed): the last stage's None; the ``sent_off`` ranks' outputs and the
    ``back_off`` ranks' handed-back gradients differ from the replay's."""
    out = {}
    for r in range(world):
        if r in last:
            out[r] = (None, None)
            continue
        recorded = (OTHER[0] if r in sent_off else SAME[0], OTHER[1] if r in back_off else SAME[1])
        out[r] = (recorded, SAME)
    return out


def test_a_last_stage_forward_fault_is_put_on_the_last_stage_alone():
    # rank 2's forward went wrong: rank 0 sent the right activations and was handed back wrong gradients
    evidence = [_mismatch(0), _mismatch(2), _mismatch(1)]
    out = through_handoffs(evidence, {0, 1, 2}, _handoffs(4, {2, 3}, back_off={0}), PP)
    assert [e.ranks for e in out] == [(2,), (1,), (2,)]
    assert "rank 0's recorded local gradient differs too" in out[-1].detail
    # rank 1 (the other data-parallel coordinate) keeps its own


def test_a_wrong_output_puts_the_later_stage_on_the_stage_that_sent_it():
    evidence = [_mismatch(1), _mismatch(3)]
    out = through_handoffs(evidence, {1, 3}, _handoffs(4, {2, 3}, sent_off={1}, back_off={1}), PP)
    assert {e.ranks for e in out} == {(1,)}


def test_matching_hand_offs_or_a_missing_record_leave_the_evidence_as_it_is():
    evidence = [_mismatch(0), _mismatch(2)]
    assert through_handoffs(evidence, {0, 2}, _handoffs(4, {2, 3}), PP) == evidence
    unrecorded = {r: (None, SAME) for r in range(4)}
    assert through_handoffs(evidence, {0, 2}, unrecorded, PP) == evidence
    # the stage it points to computed its own gradient right: nothing to put on it
    assert through_handoffs([_mismatch(0)], {0}, _handoffs(4, {2, 3}, back_off={0}), PP) == [_mismatch(0)]


def test_in_3d_the_other_stages_evidence_goes_to_the_rank_of_its_tp_coordinate():
    # stage 1's TP pair (4, 5) went wrong in the forward: stage 0's ranks 0 and 1 were handed back wrong gradients
    evidence = [_mismatch(0), _mismatch(1), _mismatch(4), _mismatch(5)]
    out = through_handoffs(evidence, {0, 1, 4, 5}, _handoffs(8, {4, 5, 6, 7}, back_off={0, 1}), THREE_D)
    assert sorted(e.ranks for e in out) == [(4,), (4,), (5,), (5,)]
