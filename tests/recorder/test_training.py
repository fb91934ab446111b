"""Real DDP runs (gloo, CPU, W = 3 and 4) of the demo recipe: each online check on its fault.

Each run is one spawned process group (~10 s on 2 cores) shared by the tests of its scenario.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sdc_forensics.demo.recipe import recipe
from sdc_forensics.fingerprint import tolerance
from sdc_forensics.fingerprint.core import combine, fingerprint, num_sketch_blocks
from sdc_forensics.statedict import flatten_state, weights_digest_from_state
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import hex64, read_checkpoint_notes
from sdc_forensics.trace.reader import Trace

from .conftest import nan_input_element

pytestmark = pytest.mark.slow

FAULTS = dict(  # W = 4, record and continue: several faults that do not mask each other
    steps=16,
    checkpoint_every=5,
    world_size=4,
    policy="continue",
    audit_every=4,
    injections=(
        "grad:step=4:rank=2:bit=25",  # a wrong finite local gradient (x16 or /16) at an audited step
        "allreduce-all:step=9:rank=0:bit=30",  # inside the collective: identical on every rank
        "weights:step=13:rank=3:bit=20",  # a weight at rest on rank 3
        "checkpoint-file:step=10:bit=30",  # the file of checkpoint 10, after it was noted
    ),
)
CLEAN = dict(steps=12, checkpoint_every=5, world_size=4, policy="raise", audit_every=2, injections=())


def _first(alarms, check):
    return next(a for a in alarms if a["check"] == check)


def test_audit_names_the_rank_with_a_wrong_finite_gradient(demo_run):
    result = demo_run(**FAULTS, result=True)
    fired = next(f for f in result.fired if f["location"] == "grad")
    assert np.isfinite(fired["new"]) and abs(fired["new"] / fired["old"]) in (16.0, 1 / 16)
    assert not [a for a in result.alarms if a["check"] == "nonfinite"]
    audit = _first(result.alarms, "audit")
    assert (audit["step"], audit["rank"]) == (4, 2), audit
    trace = Trace.open(result.config.trace_dir)
    audits = trace.records(F.Kind.AUDIT)
    at4 = audits[audits["step"] == 4]
    tiebreak = at4[(at4["flags"] & F.Flag.AUDIT_TIEBREAK) != 0]
    assert len(tiebreak) == 1 and tiebreak["aux_rank"][0] == 2 and tiebreak["rank"][0] not in (1, 2)
    mismatch = at4[(at4["flags"] & F.Flag.AUDIT_MISMATCH) != 0]
    assert set(mismatch["aux_rank"].tolist()) == {2}
    step4 = next(trace.step_windows(start=4, stop=4)).records[0]  # (R,)
    assert step4["flags"][2] & F.Flag.AUDIT_MISMATCH and all(step4["flags"] & F.Flag.AUDITED)


def test_allreduce_check_catches_corruption_inside_the_collective(demo_run):
    result = demo_run(**FAULTS, result=True)
    alarm = _first(result.alarms, "allreduce")
    assert (alarm["step"], alarm["rank"]) == (9, -1), alarm
    trace = Trace.open(result.config.trace_dir)
    row = next(trace.step_windows(start=9, stop=9)).records[0]
    assert all(row["flags"] & F.Flag.ALLREDUCE_MISMATCH)
    assert len(set(row["weights_digest"].tolist())) == 1  # replicas stay equal: only the sketches see it


def test_weights_check_names_the_diverged_replica_and_checkpoint_is_saved_from_the_majority(demo_run):
    result = demo_run(**FAULTS, result=True)
    alarm = _first(result.alarms, "weights")
    assert (alarm["step"], alarm["rank"]) == (13, 3), alarm
    notes = {n.step: n for n in read_checkpoint_notes(result.config.trace_dir)}
    assert notes[15].blessed and notes[15].diverged_ranks == (3,) and notes[15].saved_by_rank == 0
    assert notes[10].diverged_ranks == () and notes[10].blessed
    keys = [(a["check"], a["step"], a["rank"]) for a in result.alarms]
    assert len(keys) == len(set(keys)), keys  # a checkpoint reuses its step's vote: no second alarm


def test_checkpoint_file_flip_is_visible_against_the_note(demo_run):
    result = demo_run(**FAULTS, result=True)
    notes = {n.step: n for n in read_checkpoint_notes(result.config.trace_dir)}
    from sdc_forensics.statedict import state_digests

    for step, expect_equal in ((5, True), (10, False)):
        on_disk = state_digests(torch.load(result.config.checkpoint_path(step), weights_only=True))
        assert (on_disk == notes[step].tensors) is expect_equal


def test_nonfinite_check_raises_with_step_rank_and_host_w3(demo_run):
    element = nan_input_element(3, 1, 3)
    result = demo_run(
        (f"input:step=3:rank=1:bit=30:element={element}",),
        steps=8,
        checkpoint_every=4,
        world_size=3,
        policy="raise",
        result=True,
    )
    assert result.raised["check"] == "nonfinite" and (result.raised["step"], result.raised["rank"]) == (3, 1)
    assert result.raised["host"] and "sdc-forensics bisect" in result.raised["message"]
    assert result.exit_codes == (18, 18, 18)  # every worker, under exit_on_alarm: ALARM_EXIT_CODE, a documented 18
    trace = Trace.open(result.config.trace_dir)
    alarms = trace.records(F.Kind.ALARM)
    assert set(alarms["rank"].tolist()) == {0, 1, 2} and set(alarms["aux_rank"].tolist()) == {1}
    assert trace.step_range() == (0, 3)  # the step that raised is on disk; nothing after it
    row = next(trace.step_windows(start=3, stop=3)).records[0]
    assert row["flags"][1] & F.Flag.NONFINITE_LOCAL and row["nonfinite_local"][1] > 0
    assert not row["flags"][1] & F.Flag.HAS_WEIGHTS  # stopped before the update


def test_update_fault_and_single_rank_allreduce_fault_w3(demo_run):
    result = demo_run(
        ("update:step=2:rank=2:bit=20", "allreduce:step=5:rank=1:bit=20"),
        steps=7,
        checkpoint_every=10,
        world_size=3,
        policy="continue",
        result=True,
    )
    weights = _first(result.alarms, "weights")
    assert (weights["step"], weights["rank"]) == (2, 2)
    allreduce = _first(result.alarms, "allreduce")
    assert (allreduce["step"], allreduce["rank"]) == (5, 1)


def test_clean_run_raises_nothing_and_audits(demo_run):
    result = demo_run(**CLEAN, result=True)
    assert result.raised is None and result.alarms == ()
    trace = Trace.open(result.config.trace_dir)
    assert trace.damage() == []
    audits = trace.records(F.Kind.AUDIT)
    assert sorted(set(audits["step"].tolist())) == [0, 2, 4, 6, 8, 10]
    assert not (audits["flags"] & F.Flag.AUDIT_MISMATCH).any()


def test_recorded_fingerprints_equal_fingerprints_recomputed_from_tensors(demo_run):
    result = demo_run(**CLEAN, result=True)
    cfg = result.config
    trace = Trace.open(cfg.trace_dir)
    world_size, step = cfg.world_size, 5
    layouts = json.loads((cfg.trace_dir / "buckets.attempt-000.json").read_text())["layouts"]
    layout = [entry for entry in layouts if entry["from_step"] <= step][-1]["buckets"]
    model, optimizer, _ = recipe.build("cpu")
    recipe.load_checkpoint(cfg.checkpoint_path(step), model, optimizer, None)  # theta_5
    params = list(model.parameters())
    row = next(trace.step_windows(start=step, stop=step)).records[0]  # (R,)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local_sketches = []
        for rank in range(world_size):
            ids = recipe.microbatch_ids(step, rank, world_size)
            model.zero_grad(set_to_none=True)
            for mb in ids:
                recipe.loss(model, recipe.fetch_microbatch(mb)).backward()
            parts, offset = [], 0
            for bucket in layout:
                flat = torch.cat([params[i].grad.reshape(-1) for i in bucket])
                parts.append(fingerprint(flat, block_offset=offset))
                offset += num_sketch_blocks(flat.numel())
            local = combine(parts)
            local_sketches.append(local.sketch)
            assert int(row["local_digest"][rank]) == local.digest % (1 << 64), f"rank {rank}"
            assert np.allclose(row["local_sketch"][rank], local.sketch, rtol=1e-5, atol=1e-6)
            assert trace.microbatch_ids(row[rank]).tolist() == ids
    finally:
        torch.set_num_threads(threads)
    assert len(set(row["reduced_digest"].tolist())) == 1
    residual = tolerance.allreduce_residual(np.stack(local_sketches), row["reduced_sketch"][0].astype(np.float64))
    assert residual <= 1e-4 * float(row["reduced_norm"][0]) + 1e-6
    note = {n.step: n for n in read_checkpoint_notes(cfg.trace_dir)}[step]
    on_disk = flatten_state(torch.load(cfg.checkpoint_path(step), weights_only=True))
    assert hex64(weights_digest_from_state(on_disk, note.param_names)) == note.weights_digest
    previous = next(trace.step_windows(start=step - 1, stop=step - 1)).records[0]
    assert all(hex64(int(d)) == note.weights_digest for d in previous["weights_digest"])


def test_recording_does_not_change_training_numerics(demo_run):
    recorded = demo_run(**CLEAN, result=True)
    bare = demo_run(**CLEAN, record=False, result=True)
    assert len(set(recorded.final_weights_digests)) == 1
    assert recorded.final_weights_digests == bare.final_weights_digests


KILLED = dict(steps=8, checkpoint_every=2, world_size=3, policy="raise", injections=(), kill_rank=1, kill_step=4)


def test_killed_rank_leaves_a_trace_readable_to_the_last_complete_step(demo_run):
    result = demo_run(**KILLED, result=True)
    trace = Trace.open(result.config.trace_dir)
    assert trace.step_range() == (0, 4)  # rank 1 recorded step 4, then was killed
    window = next(trace.step_windows())
    assert window.present[:, 1].all()
    # the other ranks were killed by the launcher right after: step 3 at least is complete everywhere
    assert window.present[:4].all()
    assert not [d for d in trace.damage() if d.kind in ("bad_checksum", "bad_header")]


def test_resumed_run_is_a_new_attempt_that_supersedes_the_re_executed_steps(demo_run):
    from sdc_forensics.demo.run import run_demo

    killed = demo_run(**KILLED, result=True)
    resumed = run_demo(killed.config.out_dir, **{**KILLED, "kill_rank": None, "kill_step": None, "resume_from": 4})
    assert resumed.raised is None and resumed.alarms == () and resumed.checkpoints == (6, 8)
    trace = Trace.open(resumed.config.trace_dir)
    assert [(a.attempt, a.start_step) for a in trace.manifest.attempts] == [(0, 0), (1, 4)]
    window = next(trace.step_windows())
    assert window.present.all() and window.steps.tolist() == list(range(8))
    assert (window.attempt[:4] == 0).all() and (window.attempt[4:] == 1).all()
    assert window.superseded[4].all() and not window.superseded[5:].any()
    assert len(set(resumed.final_weights_digests)) == 1
