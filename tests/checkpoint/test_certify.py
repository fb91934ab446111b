"""Certification statuses, the resume point, the certify command and certificates."""

from __future__ import annotations

import dataclasses
import json

from click.testing import CliRunner

from sdc_forensics.checkpoint.certificate import read_certificate
from sdc_forensics.checkpoint.certify import Status, certify_checkpoints, last_clean
from sdc_forensics.cli.main import cli
from sdc_forensics.trace.checkpoints import read_checkpoint_notes
from tests.checkpoint.conftest import flip_byte, tree_sha256, zip_member_offset


def _statuses(run, **kwargs):
    kwargs.setdefault("first_divergent_step", run.first_divergent_step)
    return {s.step: s for s in certify_checkpoints(read_checkpoint_notes(run.trace_dir), **kwargs)}


def test_no_divergence_every_checkpoint_clean(make_run):
    run = make_run(steps=4)
    statuses = _statuses(run)
    assert {n: s.status for n, s in statuses.items()} == {0: Status.CLEAN_TRACE_CONSISTENT, 2: Status.CLEAN_TRACE_CONSISTENT, 4: Status.CLEAN_TRACE_CONSISTENT}
    assert last_clean(list(statuses.values())).step == 4


def test_checkpoints_after_the_first_divergent_step_are_tainted(make_run):
    run = make_run(steps=8, diverge=(3, 1))  # θ_4 on rank 1 is wrong; rank 0 (healthy) saves
    statuses = _statuses(run, replay_verified_steps={2})
    assert statuses[0].status == Status.CLEAN_TRACE_CONSISTENT
    assert statuses[2].status == Status.CLEAN_REPLAY_VERIFIED
    for step in (4, 6, 8):
        assert statuses[step].status == Status.TAINTED, statuses[step]
        assert "first divergent step 3" in statuses[step].reasons[0]
    assert last_clean(list(statuses.values())).step == 2


def test_checkpoint_at_the_first_divergent_step_is_clean(make_run):
    """N <= s*: θ_{s*} is still clean (checkpoint 4 with s* = 4)."""
    run = make_run(steps=6, diverge=(4, 2))
    assert _statuses(run)[4].status == Status.CLEAN_TRACE_CONSISTENT
    assert _statuses(run)[6].status == Status.TAINTED


def test_checkpoint_saved_from_the_diverged_replica_is_not_certified(make_run):
    """A weights injection on rank 1 at step 3, checkpoints saved by rank 1: never clean, even if
    the divergence were not known (content is not the majority's)."""
    run = make_run(steps=6, diverge=(3, 1), save_from=1)
    statuses = _statuses(run)
    assert statuses[4].status == Status.CORRUPT
    assert any("diverged replica" in r for r in statuses[4].reasons)
    unknown = _statuses(run, first_divergent_step=None)
    assert unknown[4].status == Status.CORRUPT and unknown[6].status == Status.CORRUPT
    assert last_clean(list(unknown.values())).step == 2


def test_content_not_matching_majority_is_corrupt_even_if_note_blesses_it(make_run):
    run = make_run(steps=6, diverge=(3, 1), save_from=1, blessed=True)
    notes = [dataclasses.replace(n, diverged_ranks=()) for n in read_checkpoint_notes(run.trace_dir)]  # recorder missed it
    statuses = {s.step: s for s in certify_checkpoints(notes, first_divergent_step=None)}
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
    notes = read_checkpoint_notes(run.trace_dir)
    statuses = {s.step: s for s in certify_checkpoints(notes, first_divergent_step=None)}
    assert statuses[2].status == Status.UNVERIFIED and "not found" in statuses[2].reasons[0]
    blank = [dataclasses.replace(n, weights_digest="") for n in notes]
    assert certify_checkpoints(blank, first_divergent_step=None)[0].status == Status.UNVERIFIED
    assert certify_checkpoints(notes, first_divergent_step=None, trace_consistent=False)[0].status == Status.UNVERIFIED


def test_checkpoints_found_in_another_directory(make_run, tmp_path):
    run = make_run(steps=2)
    moved = tmp_path / "moved"
    run.checkpoints_dir.rename(moved)
    statuses = certify_checkpoints(read_checkpoint_notes(run.trace_dir), checkpoints=moved, first_divergent_step=None)
    assert [s.status for s in statuses] == [Status.CLEAN_TRACE_CONSISTENT] * 2


def test_certify_command_and_certificate_round_trip(make_run, tmp_path):
    run = make_run(steps=6, diverge=(3, 1))
    before = tree_sha256(run.checkpoints_dir)
    cert_path = tmp_path / "cert.json"
    result = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--json", "--certificate-out", str(cert_path)])
    assert result.exit_code == 1, result.output  # some checkpoints are tainted
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1 and doc["first_divergent_step"] == 3 and doc["resume_step"] == 2
    assert [c["status"] for c in doc["checkpoints"]] == ["clean-trace-consistent", "clean-trace-consistent", "tainted", "tainted"]
    assert tree_sha256(run.checkpoints_dir) == before
    cert = read_certificate(cert_path)
    assert cert.resume_step == 2 and cert.first_divergent_step == 3
    clean = run.checkpoints[2]
    ok = CliRunner().invoke(cli, ["verify-checkpoint", str(clean), "--certificate", str(cert_path)])
    assert ok.exit_code == 0, ok.output
    tainted = CliRunner().invoke(cli, ["verify-checkpoint", str(run.checkpoints[4]), "--certificate", str(cert_path)])
    assert tainted.exit_code == 1 and "certified tainted" in tainted.output
    start, size = zip_member_offset(clean, "/data/2")
    flip_byte(clean, start + size // 3)
    changed = CliRunner().invoke(cli, ["verify-checkpoint", str(clean), "--certificate", str(cert_path), "--json"])
    assert changed.exit_code == 1
    assert json.loads(changed.stdout)["certificate"]["findings"][0]["kind"] == "file-checksum-mismatch"


def test_certify_all_clean_exits_0_and_bad_trace_exits_3(make_run, tmp_path):
    run = make_run(steps=2)
    assert CliRunner().invoke(cli, ["certify", str(run.trace_dir)]).exit_code == 0
    bad = CliRunner().invoke(cli, ["certify", str(tmp_path / "nowhere")])
    assert bad.exit_code == 3 and "Traceback" not in bad.output


def test_verify_with_trace_infers_the_step_and_reports_taint(make_run):
    run = make_run(steps=6, diverge=(3, 1))
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(run.checkpoints[6]), "--trace", str(run.trace_dir), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["certification"]["status"] == "tainted" and doc["report"]["step"] == 6
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(run.checkpoints[2]), "--trace", str(run.trace_dir), "--step", "2"])
    assert result.exit_code == 0, result.output
    wrong = CliRunner().invoke(cli, ["verify-checkpoint", str(run.checkpoints[2]), "--trace", str(run.trace_dir), "--step", "5"])
    assert wrong.exit_code == 1 and "no checkpoint note for step 5" in wrong.output


def test_certify_command_with_moved_checkpoints(make_run, tmp_path):
    run = make_run(steps=2)
    moved = tmp_path / "elsewhere"
    run.checkpoints_dir.rename(moved)
    lost = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--json"])
    assert lost.exit_code == 1
    assert {c["status"] for c in json.loads(lost.stdout)["checkpoints"]} == {"unverified"}
    found = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--checkpoints", str(moved)])
    assert found.exit_code == 0, found.output
    assert CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--checkpoints", str(tmp_path / "none")]).exit_code == 2


def test_certify_lists_checkpoint_files_without_a_note(make_run):
    run = make_run(steps=2)
    stray = run.checkpoints_dir / "manual-save.pt"
    stray.write_bytes(run.checkpoints[2].read_bytes())
    result = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["unnoted"] == [str(stray)]
    assert "has no checkpoint note in the trace" in " ".join(result.stderr.split())
