"""Decisions of the online checks on gathered numbers, and the manifest of a resumed run (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import reference
from sdc_forensics.recorder import checks, records
from sdc_forensics.recorder.audit import pick_subject, pick_tiebreaker
from sdc_forensics.recorder.identity import complete_identities, node_map
from sdc_forensics.recorder.options import RecorderOptions
from sdc_forensics.trace.format import Flag
from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, RankIdentity, read_manifest, write_manifest


def test_strict_majority():
    assert checks.strict_majority([5, 5, 7]).diverged == (2,)
    assert checks.strict_majority([5, 5, 7, 7]).value is None
    assert checks.strict_majority([1, 2, 3]).value is None
    vote = checks.strict_majority([9, 9, 9, 4])
    assert vote.value == 9 and vote.agreeing == (0, 1, 2)


def test_nonfinite_names_the_local_rank_first():
    f = checks.check_nonfinite(7, np.array([0, 3, 0]), np.array([5, 5, 5]))
    assert (f.check, f.step, f.rank, f.flag) == ("nonfinite", 7, 1, Flag.NONFINITE_LOCAL)
    collective = checks.check_nonfinite(7, np.zeros(3), np.array([1, 1, 1]))
    assert collective.rank == -1 and collective.flag == Flag.NONFINITE_REDUCED
    assert checks.check_nonfinite(7, np.zeros(3), np.array([0, 2, 0])).rank == 1
    assert checks.check_nonfinite(7, np.zeros(3), np.zeros(3)) is None


def _sketches(world_size=4, n=5000, seed=0):
    rng = np.random.default_rng(seed)
    local = rng.standard_normal((world_size, n)).astype(np.float32)
    reduced = (local.astype(np.float64).sum(axis=0) / world_size).astype(np.float32)
    return local, reduced


def _call(local, reduced_per_rank):
    sk_l = np.stack([reference.sketch(g) for g in local])
    sk_r = np.stack([reference.sketch(r) for r in reduced_per_rank])
    digests = np.array([reference.digest_bytes(r) for r in reduced_per_rank], dtype=np.uint64)
    return checks.check_allreduce(
        3,
        sk_l,
        np.linalg.norm(local.astype(np.float64), axis=1),
        sk_r,
        np.linalg.norm(np.asarray(reduced_per_rank, dtype=np.float64), axis=1),
        digests,
        "float32",
    )


def test_allreduce_check_clean_and_collective_and_single_rank():
    local, reduced = _sketches()
    finding, bad = _call(local, [reduced] * 4)
    assert finding is None and not bad.any()
    wrong = reduced.copy()
    wrong[123] += 0.5  # a wrong finite number inside the collective, identical on all ranks
    finding, bad = _call(local, [wrong] * 4)
    assert finding.rank == -1 and bad.all() and finding.flag == Flag.ALLREDUCE_MISMATCH
    finding, bad = _call(local, [reduced, reduced, wrong, reduced])
    assert finding.rank == 2 and bad.tolist() == [False, False, True, False]
    tiny = reduced.copy()
    tiny.view(np.uint32)[5] ^= 1  # below the sketch tolerance; the digest vote still sees it
    finding, _ = _call(local, [reduced, tiny, reduced, reduced])
    assert finding.rank == 1


def test_weights_check():
    assert checks.check_weights(4, np.array([1, 1, 1], dtype=np.uint64))[0] is None
    finding, vote = checks.check_weights(4, np.array([1, 1, 2, 1], dtype=np.uint64))
    assert finding.rank == 2 and finding.flag == Flag.WEIGHTS_DIVERGED and vote.agreeing == (0, 1, 3)
    finding, vote = checks.check_weights(4, np.array([1, 1, 2, 2], dtype=np.uint64))
    assert finding.rank == -1 and finding.flag == Flag.NO_MAJORITY and vote.value is None


def test_audit_partners_are_on_other_nodes():
    nodes = (0, 0, 1, 1, 2, 2)
    for rank in range(6):
        subject = pick_subject(rank, nodes)
        assert nodes[subject] != nodes[rank]
        breaker = pick_tiebreaker(rank, subject, nodes)
        assert nodes[breaker] not in (nodes[rank], nodes[subject])
    assert pick_subject(0, (0, 0, 0)) is None
    assert pick_tiebreaker(0, 1, (0, 1, 1)) is None


def test_node_map_from_hosts_and_override():
    idents = [RankIdentity(rank=r, host=h) for r, h in enumerate(["a", "a", "b", "b"])]
    done = complete_identities(idents)
    assert [i.node_rank for i in done] == [0, 0, 1, 1] and [i.local_rank for i in done] == [0, 1, 0, 1]
    assert node_map(done, None) == (0, 0, 1, 1)
    assert node_map(done, (0, 1, 2, 3)) == (0, 1, 2, 3)


def test_options_validation():
    with pytest.raises(UsageError, match="policy"):
        RecorderOptions(policy="panic")
    with pytest.raises(UsageError, match="audit_every"):
        RecorderOptions(audit_every=-1)
    opts = RecorderOptions(audit_every=5, audit_steps=(7,), weights_every=2)
    assert [s for s in range(12) if opts.audits(s)] == [0, 5, 7, 10]
    assert opts.compares_weights(4) and not opts.compares_weights(5)


def test_resumed_run_is_a_new_attempt_and_keeps_the_old_one(tmp_path):
    settings = FingerprintSettings(seed=1, sketch_k=8)
    first = records.build_manifest(
        tmp_path,
        world_size=2,
        settings=settings,
        recipe="m:r",
        checkpoint_every=10,
        audit_every=None,
        weights_every=1,
        node_of_rank=(0, 1),
        attempt=Attempt(attempt=0, start_step=0),
    )
    write_manifest(tmp_path, first)
    (tmp_path / "rank-00000.attempt-000.sdct").write_bytes(b"")
    assert records.next_attempt(tmp_path) == 1
    second = records.build_manifest(
        tmp_path,
        world_size=2,
        settings=settings,
        recipe="m:r",
        checkpoint_every=10,
        audit_every=None,
        weights_every=1,
        node_of_rank=(0, 1),
        attempt=Attempt(attempt=1, start_step=20),
    )
    write_manifest(tmp_path, second)
    assert [(a.attempt, a.start_step) for a in read_manifest(tmp_path).attempts] == [(0, 0), (1, 20)]
    with pytest.raises(UsageError, match="world size"):
        records.build_manifest(
            tmp_path,
            world_size=3,
            settings=settings,
            recipe=None,
            checkpoint_every=None,
            audit_every=None,
            weights_every=1,
            node_of_rank=(0, 1, 2),
            attempt=Attempt(attempt=2, start_step=0),
        )


def test_microbatch_ids_contiguous_or_ids_records():
    from sdc_forensics.trace import format as F

    rec = np.zeros(1, dtype=F.record_dtype(8))
    assert records.fill_ids(rec, [4, 5, 6]) is False and rec["flags"][0] & F.Flag.CONTIGUOUS_IDS
    assert rec["microbatch_first"][0] == 4 and rec["microbatch_count"][0] == 3
    rec = np.zeros(1, dtype=F.record_dtype(8))
    assert records.fill_ids(rec, [9, 2]) is True and not rec["flags"][0] & F.Flag.CONTIGUOUS_IDS


def test_non_contiguous_ids_round_trip_through_ids_records(tmp_path):
    from sdc_forensics.trace import format as F
    from sdc_forensics.trace.reader import Trace
    from sdc_forensics.trace.writer import RankTraceWriter

    settings = FingerprintSettings(seed=1, sketch_k=8)
    write_manifest(
        tmp_path,
        records.build_manifest(
            tmp_path,
            world_size=1,
            settings=settings,
            recipe=None,
            checkpoint_every=None,
            audit_every=None,
            weights_every=1,
            node_of_rank=(0,),
            attempt=Attempt(attempt=0, start_step=0),
        ),
    )
    ids = [90, 3, 17] + list(range(100, 130))  # more than one IDS record holds
    with RankTraceWriter(tmp_path, rank=0, attempt=0, world_size=1, sketch_k=8, seed=1) as writer:
        for step, step_ids in ((0, ids), (1, [5, 6])):
            records.append_with_ids(writer, writer.new(F.Kind.STEP, step), step_ids, step)
    trace = Trace.open(tmp_path)
    rows = [next(trace.step_windows(start=s, stop=s)).records[0, 0] for s in (0, 1)]
    assert trace.microbatch_ids(rows[0]).tolist() == ids
    assert trace.microbatch_ids(rows[1]).tolist() == [5, 6]
    assert int(rows[0]["microbatch_digest"]) == reference.digest_bytes(np.asarray(ids, dtype="<i8"))  # IDs as int64
