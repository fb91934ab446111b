"""``replay/compare._through_shared_forward``: in a TP or pipeline job the ranks of one
data-parallel coordinate compute one forward, so one rank's wrong input changes all their
gradients. The replay puts those mismatches on the rank whose input bytes differ; a rank of
another coordinate keeps its own evidence (a second fault is not hidden)."""

from __future__ import annotations

from sdc_forensics.evidence import Evidence, EvidenceKind, Location
from sdc_forensics.replay.compare import _through_shared_forward
from tests.factories import grid_mesh


def _mismatch(rank: int, location=Location.LOCAL_COMPUTE) -> Evidence:
    return Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH, step=3, ranks=(rank,), source="replay", location=location, detail=""
    )


def test_the_tp_peers_mismatch_goes_to_the_rank_whose_input_differs_and_other_coordinates_keep_theirs():
    # (dp, tp) = (2, 2): ranks 0, 1 share a forward, and 2, 3
    mesh = grid_mesh("tp", ("dp", "tp"), (2, 2), shard_dim=0, tp_dim=1)
    wrong_input = Evidence(
        kind=EvidenceKind.INPUT_MISMATCH, step=3, ranks=(1,), source="replay", location=Location.INPUT_DATA, detail=""
    )
    evidence = [_mismatch(0), wrong_input, _mismatch(1, Location.INPUT_DATA), _mismatch(2)]
    out = _through_shared_forward(evidence, {1}, mesh)
    # rank 1's own evidence first, unchanged; rank 2 (another data-parallel coordinate) keeps its own
    assert out[:3] == [wrong_input, _mismatch(1, Location.INPUT_DATA), _mismatch(2)]
    (moved,) = out[3:]
    assert moved.ranks == (1,) and moved.location is Location.INPUT_DATA and "rank 0's" in moved.detail
    # nothing names rank 0 any more
    assert all(0 not in e.ranks for e in out)


def test_without_model_parallel_nothing_moves():
    hsdp = grid_mesh("hsdp", ("dp_replicate", "dp_shard"), (2, 2), shard_dim=1)
    evidence = [_mismatch(0), _mismatch(1, Location.INPUT_DATA)]
    assert _through_shared_forward(evidence, {1}, hsdp) == evidence
