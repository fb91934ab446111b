"""``sdc-forensics certify`` and ``verify-checkpoint --trace/--certificate`` through click's CliRunner
on hand-made runs: exit codes, JSON, certificates, moved and unnoted checkpoints."""

from __future__ import annotations

import json

from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.decide.certificate import read_certificate
from tests.factories import flip_byte, tree_sha256, zip_member_offset


def test_certify_command_and_certificate_round_trip(make_run, tmp_path):
    run = make_run(steps=6, diverge=(3, 1))
    before = tree_sha256(run.checkpoints_dir)
    cert_path = tmp_path / "cert.json"
    result = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--json", "--certificate-out", str(cert_path)])
    assert result.exit_code == 0, result.output  # checkpoint 0 is a resume point, though later ones are tainted
    doc = json.loads(result.stdout)
    # no recipe in this trace: nothing replayed, so only checkpoint 0 (no step before it) is clean
    assert doc["schema_version"] == 1 and doc["first_divergent_step"] == 3 and doc["resume_step"] == 0
    assert [c["status"] for c in doc["checkpoints"]] == ["clean", "unverified", "tainted", "tainted"]
    assert tree_sha256(run.checkpoints_dir) == before
    cert = read_certificate(cert_path)
    assert cert.resume_step == 0 and cert.first_divergent_step == 3
    clean = run.checkpoints[0]
    ok = CliRunner().invoke(cli, ["verify-checkpoint", str(clean), "--certificate", str(cert_path)])
    assert ok.exit_code == 0, ok.output
    tainted = CliRunner().invoke(cli, ["verify-checkpoint", str(run.checkpoints[4]), "--certificate", str(cert_path)])
    assert tainted.exit_code == 1 and "certified tainted" in tainted.output
    start, size = zip_member_offset(clean, "/data/1")
    flip_byte(clean, start + size // 3)
    changed = CliRunner().invoke(cli, ["verify-checkpoint", str(clean), "--certificate", str(cert_path), "--json"])
    assert changed.exit_code == 1
    assert json.loads(changed.stdout)["certificate"]["findings"][0]["kind"] == "file-checksum-mismatch"


def test_certify_unreplayed_names_no_resume_point_and_bad_trace_exits_3(make_run, tmp_path):
    run = make_run(steps=2)
    result = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--json"])
    # checkpoint 2 stays unverified (steps 0..1 not replayed: no recipe); checkpoint 0 has no step before it,
    # but the analysis is inconclusive: exit 4, not 0 (issue 33: `certify && resume` would throw the run away)
    assert result.exit_code == 4, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "inconclusive" and doc["exit_code"] == 4
    assert doc["resume_step"] == 0 and [c["status"] for c in doc["checkpoints"]] == ["clean", "unverified"]
    assert "no resume point named (exit 4): the analysis is inconclusive" in " ".join(result.stderr.split())
    bad = CliRunner().invoke(cli, ["certify", str(tmp_path / "nowhere")])
    assert bad.exit_code == 3 and "Traceback" not in bad.output


def test_verify_with_trace_infers_the_step_and_reports_taint(make_run):
    run = make_run(steps=6, diverge=(3, 1))
    result = CliRunner().invoke(
        cli, ["verify-checkpoint", str(run.checkpoints[6]), "--trace", str(run.trace_dir), "--json"]
    )
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["certification"]["status"] == "tainted" and doc["report"]["step"] == 6
    result = CliRunner().invoke(
        cli, ["verify-checkpoint", str(run.checkpoints[2]), "--trace", str(run.trace_dir), "--step", "2"]
    )
    assert result.exit_code == 4, result.output  # consistent, but never certified without a replay of steps 0..1
    assert "NOT CERTIFIED" in result.output
    zero = CliRunner().invoke(cli, ["verify-checkpoint", str(run.checkpoints[0]), "--trace", str(run.trace_dir)])
    assert zero.exit_code == 0 and "CERTIFIED CLEAN" in zero.output
    wrong = CliRunner().invoke(
        cli, ["verify-checkpoint", str(run.checkpoints[2]), "--trace", str(run.trace_dir), "--step", "5"]
    )
    assert wrong.exit_code == 4 and "no checkpoint note for step 5" in " ".join(wrong.output.split())


def test_certify_command_with_moved_checkpoints(make_run, tmp_path):
    run = make_run(steps=2)
    moved = tmp_path / "elsewhere"
    run.checkpoints_dir.rename(moved)
    lost = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--json"])
    assert lost.exit_code == 4
    assert {c["status"] for c in json.loads(lost.stdout)["checkpoints"]} == {"unverified"}
    found = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--checkpoints", str(moved), "--json"])
    assert found.exit_code == 4, found.output  # found and read, but nothing replayable (no recipe): inconclusive
    assert json.loads(found.stdout)["checkpoints"][0]["status"] == "clean"  # checkpoint 0: read, nothing before it
    assert (
        CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--checkpoints", str(tmp_path / "none")]).exit_code == 2
    )


def test_certify_lists_checkpoint_files_without_a_note(make_run):
    run = make_run(steps=2)
    stray = run.checkpoints_dir / "manual-save.pt"
    stray.write_bytes(run.checkpoints[2].read_bytes())
    result = CliRunner().invoke(cli, ["certify", str(run.trace_dir), "--json"])
    assert result.exit_code == 4  # no recipe: inconclusive; the stray file is listed, not certified
    assert json.loads(result.stdout)["unnoted"] == [str(stray)]
    assert "has no checkpoint note in the trace" in " ".join(result.stderr.split())


def test_verify_with_trace_and_an_unnoted_step_still_reports_a_damaged_file(make_run):
    """No note for --step 5, and the file is damaged: 1 (not certifiable), never 4 ("nothing wrong")."""
    run = make_run(steps=4)
    start, size = zip_member_offset(run.checkpoints[2], "/data/1")
    flip_byte(run.checkpoints[2], start + size - 1, 0x40)
    result = CliRunner().invoke(
        cli, ["verify-checkpoint", str(run.checkpoints[2]), "--trace", str(run.trace_dir), "--step", "5"]
    )
    assert result.exit_code == 1, result.output
    assert "NOT CERTIFIABLE" in result.output


def test_verify_with_trace_when_the_step_cannot_be_told_is_a_usage_error(make_run, tmp_path):
    import torch

    run = make_run(steps=2)
    stray = tmp_path / "renamed.pt"
    torch.save({"w": torch.ones(2)}, stray)  # no note names it, no 'step' in it
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(stray), "--trace", str(run.trace_dir)])
    assert result.exit_code == 2 and "pass --step N" in result.output and "Traceback" not in result.output


def test_certify_without_checkpoint_notes_follows_the_verdict(make_trace):
    from tests.factories import Fault

    bad = CliRunner().invoke(cli, ["certify", str(make_trace(fault=Fault(kind="nonfinite", step=3, rank=1))), "--json"])
    assert bad.exit_code == 1 and json.loads(bad.stdout)["verdict"] == "corruption"
    quiet = CliRunner().invoke(cli, ["certify", str(make_trace()), "--json"])
    assert quiet.exit_code == 4  # nothing to certify, and nothing could be replayed
