"""The decision module's checkpoint statuses (``decide/decision.py``) on hand-made runs:
clean, unverified, tainted, corrupt, and the resume point."""

from __future__ import annotations

import dataclasses

from sdc_forensics.checkpoint.locate import locate_checkpoint
from sdc_forensics.checkpoint.verify import VerifyOptions, verify_checkpoint
from sdc_forensics.decide.decision import (
    CheckpointFile,
    Examined,
    Status,
    Verdict,
    checkpoint_status,
    decide,
    last_clean,
)
from sdc_forensics.evidence import Evidence, EvidenceKind, Location, Strength
from sdc_forensics.trace.checkpoints import read_checkpoint_notes
from tests.factories import flip_byte, zip_member_offset


def _file(note, checkpoints=None, base=None):
    path = locate_checkpoint(note, checkpoints, base)
    return (
        CheckpointFile(path=str(path), report=verify_checkpoint(path, note=note, options=VerifyOptions()))
        if path
        else CheckpointFile()
    )


def _statuses(run, *, first="run", notes=None, replayed=None, weak=(), checkpoints=None, trace_consistent=True):
    """The decision module's status of every checkpoint of ``run``; by default every step replayed clean."""
    notes = notes or read_checkpoint_notes(run.trace_dir)
    last = max(n.step for n in notes)
    examined = Examined(
        first_step=0,
        replayed=frozenset(range(last) if replayed is None else replayed),
        files_read=True,
        trace_consistent=trace_consistent,
    )
    first = run.first_divergent_step if first == "run" else first
    return {
        n.step: checkpoint_status(
            n, _file(n, checkpoints, run.trace_dir.parent), first=first, weak=weak, majority=None, examined=examined
        )
        for n in notes
    }


def test_no_divergence_every_step_replayed_every_checkpoint_clean(make_run):
    run = make_run(steps=4)
    statuses = _statuses(run)
    assert {n: s.status for n, s in statuses.items()} == {0: Status.CLEAN, 2: Status.CLEAN, 4: Status.CLEAN}
    assert last_clean(list(statuses.values())).step == 4


def test_a_checkpoint_whose_earlier_steps_were_not_all_replayed_is_not_clean(make_run):
    """Certified clean only when every step before it was examined (design brief)."""
    run = make_run(steps=4)
    statuses = _statuses(run, replayed={2, 3})
    assert statuses[0].status == Status.CLEAN  # no step before it
    assert statuses[2].status == Status.UNVERIFIED and "steps 0..1 were not replayed" in statuses[2].reasons[0]
    assert statuses[4].status == Status.UNVERIFIED


def test_weak_evidence_before_a_checkpoint_leaves_it_unverified(make_run):
    run = make_run(steps=4)
    weak = (
        Evidence(
            kind=EvidenceKind.REPLAY_MISMATCH,
            step=2,
            ranks=(1,),
            source="replay",
            location=Location.LOCAL_COMPUTE,
            strength=Strength.WEAK,
            found="residual 3x the tolerance",
        ),
    )
    statuses = _statuses(run, weak=weak)
    assert [statuses[n].status for n in (0, 2, 4)] == [Status.CLEAN, Status.CLEAN, Status.UNVERIFIED]
    assert "weak evidence at step 2" in statuses[4].reasons[0]


def test_checkpoints_after_the_first_divergent_step_are_tainted(make_run):
    run = make_run(steps=8, diverge=(3, 1))  # θ_4 on rank 1 is wrong; rank 0 (healthy) saves
    statuses = _statuses(run)
    assert statuses[0].status == Status.CLEAN and statuses[2].status == Status.CLEAN
    for step in (4, 6, 8):
        assert statuses[step].status == Status.TAINTED, statuses[step]
        assert "first divergent step 3" in statuses[step].reasons[0]
    assert last_clean(list(statuses.values())).step == 2


def test_checkpoint_at_the_first_divergent_step_is_clean(make_run):
    """N <= s*: θ_{s*} is still clean (checkpoint 4 with s* = 4)."""
    run = make_run(steps=6, diverge=(4, 2))
    assert _statuses(run)[4].status == Status.CLEAN
    assert _statuses(run)[6].status == Status.TAINTED


def test_checkpoint_saved_from_the_diverged_replica_is_not_certified(make_run):
    """A weights injection on rank 1 at step 3, checkpoints saved by rank 1: never clean, even if
    the divergence were not known (content is not the majority's)."""
    run = make_run(steps=6, diverge=(3, 1), save_from=1)
    statuses = _statuses(run)
    assert statuses[4].status == Status.CORRUPT
    assert any("diverged replica" in r for r in statuses[4].reasons)
    unknown = _statuses(run, first=None)
    assert unknown[4].status == Status.CORRUPT and unknown[6].status == Status.CORRUPT
    assert last_clean(list(unknown.values())).step == 2


def test_content_not_matching_majority_is_corrupt_even_if_note_blesses_it(make_run):
    run = make_run(steps=6, diverge=(3, 1), save_from=1, blessed=True)
    notes = [
        dataclasses.replace(n, diverged_ranks=()) for n in read_checkpoint_notes(run.trace_dir)
    ]  # recorder missed it
    statuses = _statuses(run, notes=notes, first=None)
    assert statuses[4].status == Status.CORRUPT
    assert any(f.kind.value == "weights-not-majority" for f in statuses[4].findings)


def test_storage_corruption_makes_a_checkpoint_corrupt_and_moves_the_resume_point(make_run):
    run = make_run(steps=4)
    start, size = zip_member_offset(run.checkpoints[4], "/data/1")
    flip_byte(run.checkpoints[4], start + size - 1, 0x40)
    statuses = _statuses(run)
    assert statuses[4].status == Status.CORRUPT
    assert last_clean(list(statuses.values())).step == 2


def test_missing_file_or_no_majority_digest_is_unverified(make_run, tmp_path):
    run = make_run(steps=2)
    run.checkpoints[2].unlink()
    statuses = _statuses(run, first=None)
    assert statuses[2].status == Status.UNVERIFIED and "not found" in statuses[2].reasons[0]
    blank = [dataclasses.replace(n, weights_digest="") for n in read_checkpoint_notes(run.trace_dir)]
    assert _statuses(run, notes=blank, first=None)[0].status == Status.UNVERIFIED
    assert _statuses(run, first=None, trace_consistent=False)[0].status == Status.UNVERIFIED


def test_checkpoints_found_in_another_directory(make_run, tmp_path):
    run = make_run(steps=2)
    moved = tmp_path / "moved"
    run.checkpoints_dir.rename(moved)
    assert [s.status for s in _statuses(run, first=None, checkpoints=moved).values()] == [Status.CLEAN] * 2


class _Ident:
    host, gpu = "node0", "GPU-0"


def _ev(kind, step, ranks, location, **kw):
    return Evidence(kind=kind, step=step, ranks=ranks, location=location, **kw)


def test_a_replay_that_examined_a_weights_bound_pins_the_first_divergent_step():
    """Replicas found different at step 12, equal at step 8: the fault is in 9..12 (s* = 9 from the
    trace alone). Once a replay examined 9..12 and found the update going wrong at 11, s* is 11."""
    bound = _ev(EvidenceKind.WEIGHT_DIVERGENCE, 12, (1,), Location.UNKNOWN, earliest_step=9)
    replayed = _ev(EvidenceKind.REPLAY_MISMATCH, 11, (1,), Location.OPTIMIZER_UPDATE, source="replay")
    common = dict(world_size=4, identity=lambda r: _Ident(), notes=(), files={}, majority={})
    alone = decide([bound], examined=Examined(trace_only=True), **common)
    assert (alone.first_divergent_step, alone.divergence_window) == (9, (9, 12))
    pinned = decide([bound, replayed], examined=Examined(replayed=frozenset(range(13))), **common)
    assert (pinned.verdict, pinned.first_divergent_step) == (Verdict.CORRUPTION, 11)
    [suspect] = pinned.suspects
    assert (suspect.rank, suspect.location, suspect.steps, suspect.recurring) == (
        1,
        Location.OPTIMIZER_UPDATE,
        (11,),
        False,
    )
    partly = decide([bound, replayed], examined=Examined(replayed=frozenset(range(10, 13))), **common)
    assert partly.first_divergent_step == 9  # step 9 was not replayed: the bound still holds


def test_weak_evidence_before_a_confirmed_divergence_widens_its_window():
    weak = _ev(EvidenceKind.REPLAY_MISMATCH, 3, (2,), Location.LOCAL_COMPUTE, source="replay", strength=Strength.WEAK)
    strong = _ev(EvidenceKind.NONFINITE, 7, (2,), Location.LOCAL_COMPUTE)
    decided = decide(
        [weak, strong],
        world_size=4,
        identity=lambda r: _Ident(),
        notes=(),
        files={},
        majority={},
        examined=Examined(replayed=frozenset(range(8))),
    )
    assert (decided.verdict, decided.first_divergent_step, decided.divergence_window) == (Verdict.CORRUPTION, 7, (3, 7))
    assert "precedes the first confirmed divergence" in " ".join(decided.settle)


def test_weak_evidence_alone_is_inconclusive_never_corruption():
    weak = _ev(
        EvidenceKind.REPLAY_MISMATCH,
        3,
        (2,),
        Location.LOCAL_COMPUTE,
        source="replay",
        strength=Strength.WEAK,
        found="residual 40x the tolerance",
    )
    decided = decide(
        [weak],
        world_size=4,
        identity=lambda r: _Ident(),
        notes=(),
        files={},
        majority={},
        examined=Examined(replayed=frozenset(range(8))),
    )
    assert (decided.verdict, decided.first_divergent_step, decided.suspects) == (Verdict.INCONCLUSIVE, None, ())
    assert "replay exactly" in decided.settle[0]


def test_nothing_found_in_a_damaged_trace_is_inconclusive_never_clean():
    """A trace with holes (a rank file unreadable, bad checksums, missing steps) gives no clean
    bill: nothing found in what could be read is not every rank's every step (issue #9: bisect
    --trace-only said clean, exit 0, when rank 0's only file was garbage)."""

    def verdict(**examined):
        return decide(
            [],
            world_size=4,
            identity=lambda r: _Ident(),
            notes=(),
            files={},
            majority={},
            examined=Examined(**examined),
        )

    assert verdict(replayed=frozenset(range(8))).verdict is Verdict.CLEAN
    assert verdict(trace_only=True).verdict is Verdict.CLEAN  # trace checks only, on an intact trace
    for damaged in ({"replayed": frozenset(range(8))}, {"trace_only": True}):
        decided = verdict(trace_consistent=False, **damaged)
        assert decided.verdict is Verdict.INCONCLUSIVE and "the trace is damaged" in decided.settle[-1]


def test_finding_kind_sets_are_the_enum_and_classify_every_kind_once():
    """The decision's sets hold ``FindingKind`` members (no copies of their strings): every kind is
    storage damage, a wrong saved state, or not verifiable, exactly one of them."""
    from sdc_forensics.checkpoint.findings import FindingKind
    from sdc_forensics.decide.decision import STATE_FINDINGS, STORAGE_FINDINGS, UNVERIFIABLE_FINDINGS

    sets = (STORAGE_FINDINGS, STATE_FINDINGS, UNVERIFIABLE_FINDINGS)
    assert all(type(kind) is FindingKind for group in sets for kind in group)
    assert sorted(kind for group in sets for kind in group) == sorted(FindingKind)
    assert STORAGE_FINDINGS == {
        FindingKind.DIGEST_MISMATCH,
        FindingKind.FILE_DAMAGED,
        FindingKind.FILE_CHECKSUM_MISMATCH,
        FindingKind.MISSING_TENSOR,
        FindingKind.UNEXPECTED_TENSOR,
    }
    assert UNVERIFIABLE_FINDINGS == {FindingKind.NOT_VERIFIABLE}


def _update_everywhere(step, ranks=(0, 1, 2, 3)):
    """What the replay reports when every rank's weights after ``step`` differ from its exact update."""
    return _ev(
        EvidenceKind.REPLAY_MISMATCH,
        step,
        ranks,
        Location.OPTIMIZER_UPDATE,
        source="replay",
        expected="0x1",
        found=", ".join("0x2" for _ in ranks),
    )


def test_an_update_no_rank_reproduces_is_inconclusive_names_the_recipe_and_certifies_nothing_after_it(make_run):
    """Issue 33: the gradients of step 2 reproduced bit for bit, the weights after its update differ on
    every rank alike (a recipe with a wrong learning rate, or without its clipping): no rank is named,
    no divergent step is set, checkpoint 2 (before it) stays clean and checkpoint 4 is not certified."""
    run = make_run(steps=4)
    notes = read_checkpoint_notes(run.trace_dir)
    files = {n.step: _file(n, None, run.trace_dir.parent) for n in notes}
    decided = decide(
        [_update_everywhere(2)],
        world_size=4,
        identity=lambda r: _Ident(),
        notes=notes,
        files=files,
        majority={},
        examined=Examined(replayed=frozenset(range(4)), files_read=True),
    )
    assert (decided.verdict, decided.first_divergent_step, decided.suspects) == (Verdict.INCONCLUSIVE, None, ())
    statuses = {c.step: c for c in decided.checkpoints}
    assert [statuses[n].status for n in (0, 2, 4)] == [Status.CLEAN, Status.CLEAN, Status.UNVERIFIED]
    assert "did not reproduce the update of step(s) 2" in statuses[4].reasons[0]
    assert not any("bit for bit" in r for r in statuses[4].reasons)
    line = decided.settle[0]
    assert "does not reproduce the update of step(s) 2" in line
    assert all(word in line for word in ("recipe", "optimizer", "clipping", "learning rate", "scheduler"))
    # the one-time fault that leaves the same evidence under a clip norm spanning the ranks is named too
    assert "clip coefficient" in line and "does not record which rank" in line


def test_an_update_mismatch_with_other_strong_evidence_at_its_step_is_not_called_the_recipe():
    """Rule 5 holds only with nothing else strong at the step: a NaN in rank 1's local gradient there
    is the verdict, and the update mismatch is no recipe event."""
    nan = _ev(EvidenceKind.NONFINITE, 2, (1,), Location.LOCAL_COMPUTE)
    decided = decide(
        [_update_everywhere(2), nan],
        world_size=4,
        identity=lambda r: _Ident(),
        notes=(),
        files={},
        majority={},
        examined=Examined(replayed=frozenset(range(4))),
    )
    assert decided.verdict is Verdict.CORRUPTION and decided.first_divergent_step == 2
    assert not any("does not reproduce the update" in line for line in decided.settle)


def test_weights_changed_at_rest_are_located_at_rest_not_in_local_compute():
    """DDP: rank 2's local gradient of step 3 is wrong (replay) and its weights after step 3 differ from
    the majority's while they were equal after step 2 (trace): its weights changed at rest. The same
    wrong gradient without the divergence is local compute (averaged into every replica alike)."""
    local = _ev(EvidenceKind.REPLAY_MISMATCH, 3, (2,), Location.LOCAL_COMPUTE, source="replay")
    diverged = _ev(EvidenceKind.WEIGHT_DIVERGENCE, 3, (2,), Location.UNKNOWN)
    common = dict(
        world_size=4,
        identity=lambda r: _Ident(),
        notes=(),
        files={},
        majority={},
        examined=Examined(replayed=frozenset(range(6))),
    )
    [at_rest] = decide([local, diverged], **common).suspects
    assert (at_rest.rank, at_rest.location, at_rest.steps) == (2, Location.STATE_AT_REST, (3,))
    [compute] = decide([local], **common).suspects
    assert (compute.rank, compute.location) == (2, Location.LOCAL_COMPUTE)
    later = _ev(EvidenceKind.WEIGHT_DIVERGENCE, 5, (2,), Location.UNKNOWN)  # diverged only after another, later step
    assert {s.location for s in decide([local, later], **common).suspects} == {Location.LOCAL_COMPUTE}


def test_two_replicas_without_a_majority_the_replay_names_the_one_whose_weights_changed_at_rest():
    """A 2-rank job (a new user's nanoGPT-style DDP job, weights flipped on rank 1 before step 6): the
    vote finds no strict majority (it names no rank), the replay finds rank 1's local gradient of step
    6 computed from other weights than the replicas'. Before, that was local compute; a wrong local
    gradient alone is averaged into both replicas alike, so it was the weights, at rest."""
    local = _ev(EvidenceKind.REPLAY_MISMATCH, 6, (1,), Location.LOCAL_COMPUTE, source="replay")
    split = _ev(EvidenceKind.WEIGHT_DIVERGENCE, 6, (), Location.UNKNOWN)
    common = dict(
        world_size=2,
        identity=lambda r: _Ident(),
        notes=(),
        files={},
        majority={},
        examined=Examined(replayed=frozenset(range(8))),
    )
    [at_rest] = decide([local, split], **common).suspects
    assert (at_rest.rank, at_rest.location, at_rest.steps) == (1, Location.STATE_AT_REST, (6,))
    earlier = _ev(EvidenceKind.REPLAY_MISMATCH, 4, (1,), Location.LOCAL_COMPUTE, source="replay")
    assert {s.location for s in decide([earlier, split], **common).suspects} == {Location.LOCAL_COMPUTE}


def test_a_sharded_checkpoint_holding_a_diverged_replicas_shard_says_so_not_storage():
    """Issue 33: an HSDP checkpoint saved after rank 3's weights diverged holds rank 3's shard (DCP writes
    one replica's copy): its tensor digests differ from the note, and the reason names the diverged
    replica, not the disk. The same findings in a DDP checkpoint saved by a healthy rank stay storage."""
    from types import SimpleNamespace

    from sdc_forensics.checkpoint.findings import FindingKind
    from sdc_forensics.checkpoint.verify import Finding
    from sdc_forensics.trace.checkpoints import CheckpointNote

    findings = (
        Finding(
            kind=FindingKind.DIGEST_MISMATCH,
            subject="model.3.weight",
            expected="0x1",
            found="0x2",
            detail="bytes differ from what was saved (storage corruption)",
        ),
    )
    file = CheckpointFile(path="step-4", report=SimpleNamespace(findings=findings))
    for note in (
        CheckpointNote(step=4, path="step-4", weights_digest="0x9", saved_by_rank=0, blessed=False),
        CheckpointNote(
            step=4,
            path="step-4",
            weights_digest="0x9",
            saved_by_rank=0,
            blessed=True,
            agreeing_ranks=(0, 1, 2),
            diverged_ranks=(3,),
        ),
    ):
        status = checkpoint_status(
            note, file, first=3, majority=None, examined=Examined(replayed=frozenset(range(4))), sharded=True
        )
        assert status.status is Status.CORRUPT
        text = " ".join(status.reasons)
        assert "holds a diverged replica's weights" in text and "storage" not in text.replace("not storage damage", "")
        ddp = checkpoint_status(note, file, first=3, majority=None, examined=Examined(replayed=frozenset(range(4))))
        assert "storage corruption" in " ".join(ddp.reasons) and "diverged replica's weights" not in " ".join(
            ddp.reasons
        )


def _decision(verdict, first=None, suspects=(), settle=()):
    from sdc_forensics.decide.decision import Decision

    return Decision(
        verdict=verdict,
        first_divergent_step=first,
        divergence_window=None,
        suspects=suspects,
        checkpoints=(),
        weak=(),
        settle=settle,
    )


def test_an_earlier_attempts_corruption_is_the_runs_verdict_but_not_its_lineages_first_step():
    """Issue 33: a resumed run's earlier attempt went wrong at step 5 on rank 1; the latest lineage is
    clean. The verdict is corruption with rank 1 named for attempt 0; s* and the checkpoints stay the
    lineage's. An earlier attempt that could not be settled only says so."""
    from sdc_forensics.decide.decision import EarlierAttempt, with_earlier_attempts

    wrong = _ev(EvidenceKind.REPLAY_MISMATCH, 5, (1,), Location.LOCAL_COMPUTE, source="replay")
    common = dict(world_size=3, identity=lambda r: _Ident(), notes=(), files={}, majority={})
    past = decide([wrong], examined=Examined(first_step=4, replayed=frozenset(range(4, 8)), files_read=True), **common)
    latest = _decision(Verdict.CLEAN)
    merged = with_earlier_attempts(latest, [EarlierAttempt(attempt=0, resumed_by=1, steps=(4, 7), decision=past)])
    assert merged.verdict is Verdict.CORRUPTION and merged.first_divergent_step is None and merged.checkpoints == ()
    assert [(s.rank, s.attempt, s.steps) for s in merged.suspects] == [(1, 0, (5,))]
    assert merged.suspects[0].to_json()["attempt"] == 0 and "attempt" not in past.suspects[0].to_json()
    assert merged.settle[0].startswith("attempt 0 went wrong at step 5: rank 1 (node0, GPU-0) (local_compute)")
    assert wrong in merged.evidence
    # a clean earlier attempt changes nothing; an unsettled one adds a line and keeps the verdict
    assert (
        with_earlier_attempts(
            latest, [EarlierAttempt(attempt=0, resumed_by=1, steps=(4, 7), decision=_decision(Verdict.CLEAN))]
        )
        is latest
    )
    unsettled = with_earlier_attempts(
        latest,
        [
            EarlierAttempt(
                attempt=0, resumed_by=1, steps=(4, 4), decision=_decision(Verdict.INCONCLUSIVE, settle=("replay it",))
            )
        ],
    )
    assert unsettled.verdict is Verdict.CLEAN and unsettled.settle == (
        "attempt 0's step 4, re-executed by attempt 1, could not be settled: replay it",
    )
    # the latest lineage's own corruption keeps its first step, and both suspects are named
    own = _decision(Verdict.CORRUPTION, first=9, suspects=past.suspects)
    both = with_earlier_attempts(own, [EarlierAttempt(attempt=0, resumed_by=1, steps=(4, 7), decision=past)])
    assert both.first_divergent_step == 9 and [s.attempt for s in both.suspects] == [None, 0]


def test_a_gathered_copy_found_different_leaves_the_wrong_gradient_in_local_compute():
    """A sharded job's vote of the all-gathered parameters names rank 1 at step 4 (its gathered copy,
    not its own shard, differed: located local_compute), and the replay finds rank 1's local gradient
    of step 4 wrong: the fault is its compute on a transient copy, not weights changed at rest (the
    clipped tied-head FSDP campaign's all-gather fault was blamed at rest before). A DDP replica's
    weights found diverged at the same step still moves it at rest."""
    gathered = _ev(EvidenceKind.WEIGHT_DIVERGENCE, 4, (1,), Location.LOCAL_COMPUTE)
    replayed = _ev(EvidenceKind.REPLAY_MISMATCH, 4, (1,), Location.LOCAL_COMPUTE, source="replay")
    common = dict(
        world_size=4,
        identity=lambda r: _Ident(),
        notes=(),
        files={},
        majority={},
        examined=Examined(replayed=frozenset(range(8)), files_read=True),
    )
    assert [(s.rank, s.location) for s in decide([gathered, replayed], **common).suspects] == [
        (1, Location.LOCAL_COMPUTE)
    ]
    replica = _ev(EvidenceKind.WEIGHT_DIVERGENCE, 4, (1,), Location.UNKNOWN, earliest_step=4)
    assert [(s.rank, s.location) for s in decide([replica, replayed], **common).suspects] == [
        (1, Location.STATE_AT_REST)
    ]
