"""The installed ``sdc-forensics`` as a batch job runs it: stderr to a file (COLUMNS=80), stdout
to a pipe that may close early. Output must be whole lines, no reprs, no tracebacks; usage errors
one line, exit 2, before any work, nothing written (issue 10, items 2 and 4)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from tests.cli.installed import command, run_installed
from tests.factories import Fault, SimFault, tree_sha256

ANSI = re.compile(r"\x1b\[")
COMMANDS = ("inspect", "demo", "bisect", "replay", "verify-checkpoint", "certify", "report", "export")


@pytest.fixture
def faulty_run(sim, tmp_path):
    """The sim run of tests/cli/test_bisect.py (grad fault at step 4, rank 3), reached through a
    path far longer than 80 columns."""
    run = sim(SimFault(where="grad", step=4, rank=3, bit=11), steps=5, checkpoint_every=4)
    long = tmp_path / ("a-directory-name-long-enough-to-overflow-any-80-column-table-" * 2).rstrip("-")
    long.symlink_to(run, target_is_directory=True)
    return long


def _closed_stdout(args: list[str], tmp_path) -> tuple[int, str]:
    """Run the installed command with stdout a pipe whose reader is already gone; stderr to a file."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE, as after `| head -1` exits
    log = tmp_path / "closed-stdout-stderr.log"
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    with open(log, "w", encoding="utf-8") as errf:
        proc = subprocess.run([command(), *args], stdout=write_end, stderr=errf, env=env, timeout=300)
    os.close(write_end)
    return proc.returncode, log.read_text(encoding="utf-8")


def test_stderr_to_a_file_keeps_paths_digests_and_kinds_on_one_line(faulty_run, tmp_path):
    checkpoints = faulty_run / "checkpoints"
    ran = run_installed(["bisect", str(faulty_run / "trace"), "--checkpoints", str(checkpoints), "--json"], tmp_path)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    [mismatch] = [e for e in doc["evidence"] if e["kind"] == "replay_mismatch"][:1]
    lines = ran.stderr.splitlines()
    assert any("replay_mismatch" in line for line in lines)  # not 'replay_mism' / 'atch'
    for digest in (mismatch["expected"], mismatch["found"]):  # 16-hex digests, whole
        assert any(digest in line for line in lines), (digest, ran.stderr)
    resume = str(checkpoints / "step-00000004.pt")
    assert len(resume) > 120
    assert any(resume in line for line in lines), ran.stderr  # the resume path, whole: not cut to 'a-dir...'
    assert "…" not in ran.stderr and "..." not in ran.stderr.replace("0..3", "").replace("4..4", "").replace("0..4", "")
    assert not ANSI.search(ran.stderr)
    assert max(len(line) for line in lines) > 80  # really unwrapped, not just short


def test_certify_table_and_verify_table_are_not_cut(faulty_run, tmp_path):
    trace, checkpoints = faulty_run / "trace", faulty_run / "checkpoints"
    ran = run_installed(["certify", str(trace), "--checkpoints", str(checkpoints)], tmp_path)
    assert ran.returncode == 0, ran.stderr  # checkpoint 4 is clean: resume there
    assert any(f"resume from step 4: {checkpoints / 'step-00000004.pt'}" in line for line in ran.stderr.splitlines()), (
        ran.stderr
    )
    reason = "every step 0..3 replayed bit for bit"
    assert any(reason in line for line in ran.stderr.splitlines())
    verify = run_installed(["verify-checkpoint", str(checkpoints / "step-00000004.pt")], tmp_path)
    assert verify.returncode == 0, verify.stderr
    assert any(
        str(checkpoints / "step-00000004.pt") in line and "VERIFIED" in line for line in verify.stderr.splitlines()
    )
    assert not ANSI.search(ran.stderr + verify.stderr)


def test_no_python_reprs_in_human_output(make_trace, faulty_run, tmp_path):
    hinted = run_installed(
        ["bisect", str(make_trace(fault=Fault(kind="outlier", step=3, rank=2))), "--trace-only"], tmp_path
    )
    assert hinted.returncode == 4
    assert "step 3 rank 2" in hinted.stderr and "(2,)" not in hinted.stderr
    inspected = run_installed(["inspect", str(faulty_run / "trace")], tmp_path)
    assert inspected.returncode == 0
    assert "determinism num_threads=" in inspected.stderr  # key=value, not {'num_threads': 2}
    for ran in (hinted, inspected):
        assert "{'" not in ran.stderr and not re.search(r"\(\d+,\)", ran.stderr)


@pytest.mark.parametrize("name", ("", *COMMANDS))
def test_help_has_no_markup(name, tmp_path):
    ran = run_installed([name, "--help"] if name else ["--help"], tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "``" not in ran.stdout and "::" not in ran.stdout and "`" not in ran.stdout, ran.stdout


def test_export_into_a_closed_pipe_is_quiet(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=600, bulk=True)  # ~0.5 MB of CSV: far beyond a pipe's buffer
    code, stderr = _closed_stdout(["export", str(trace)], tmp_path)
    assert code == 0, stderr
    assert stderr == "", stderr  # no traceback, no "Exception ignored ... BrokenPipeError"
    shell = subprocess.run(
        ["sh", "-c", f'"{command()}" export "{trace}" 2>"{tmp_path / "sh.log"}" | head -1'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shell.stdout.startswith("step,rank,attempt,")
    assert (tmp_path / "sh.log").read_text() == ""


def test_bisect_json_into_a_closed_pipe_keeps_its_exit_code(make_trace, tmp_path):
    trace = make_trace(fault=Fault(kind="nonfinite", step=6, rank=1))
    code, stderr = _closed_stdout(["bisect", str(trace), "--trace-only", "--json"], tmp_path)
    assert code == 1, stderr  # corruption's code, not click's 1-for-EPIPE nor 0
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "BrokenPipe" not in stderr
    assert "CORRUPTION" in stderr  # people still get the summary
    clean = make_trace()
    code, stderr = _closed_stdout(["bisect", str(clean), "--json"], tmp_path)
    assert code == 4 and "Traceback" not in stderr and "Exception ignored" not in stderr


def _one_error_line(ran) -> str:
    lines = ran.stderr_lines
    assert len(lines) == 1 and lines[0].startswith("error: "), ran.stderr
    assert ran.stdout == ""
    return lines[0]


def test_export_refuses_an_existing_file_unless_forced(make_trace, tmp_path):
    trace = make_trace(steps=5)
    out = tmp_path / "out"
    out.mkdir()
    target = out / "steps.csv"
    target.write_text("mine\n")
    ran = run_installed(["export", str(trace), "-o", str(target)], tmp_path)
    assert ran.returncode == 2
    assert "exists" in _one_error_line(ran) and "--force" in ran.stderr
    assert target.read_text() == "mine\n"
    forced = run_installed(["export", str(trace), "-o", str(target), "--force"], tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert target.read_text().startswith("step,rank,attempt,") and len(target.read_text().splitlines()) == 1 + 5 * 4
    fresh = run_installed(["export", str(trace), "-o", str(out / "new.csv")], tmp_path)
    assert fresh.returncode == 0 and (out / "new.csv").read_text() == target.read_text()
    # a failed export (the trace cannot be read) leaves the file untouched and no temporary file
    failed = run_installed(["export", str(tmp_path / "no-trace"), "-o", str(target), "--force"], tmp_path)
    assert failed.returncode == 3
    _one_error_line(failed)
    assert sorted(p.name for p in out.iterdir()) == ["new.csv", "steps.csv"]
    assert target.read_text() == (out / "new.csv").read_text()
    nowhere = run_installed(["export", str(trace), "-o", str(tmp_path / "missing-folder" / "x.csv")], tmp_path)
    assert nowhere.returncode == 2 and "does not exist" in _one_error_line(nowhere)


def test_certify_refuses_an_existing_certificate_before_any_work(make_run, tmp_path):
    run = make_run(steps=2)
    cert = tmp_path / "cert.json"
    cert.write_text("{}\n")
    before = tree_sha256(run.checkpoints_dir)
    ran = run_installed(["certify", str(run.trace_dir), "--certificate-out", str(cert)], tmp_path)
    assert ran.returncode == 2
    assert "--certificate-out" in _one_error_line(ran)  # alone: no table, no analysis
    assert cert.read_text() == "{}\n" and tree_sha256(run.checkpoints_dir) == before
    forced = run_installed(
        ["certify", str(run.trace_dir), "--certificate-out", str(cert), "--force", "--json"], tmp_path
    )
    assert forced.returncode == 4, forced.stderr  # written; no recipe, so inconclusive: 4
    assert json.loads(cert.read_text())["format"] == "sdc-forensics-certificate"
    assert json.loads(forced.stdout)["certificate"] == str(cert)


def test_replay_window_outside_the_trace_is_refused_before_any_work(faulty_run, tmp_path):
    trace, checkpoints = faulty_run / "trace", faulty_run / "checkpoints"  # steps 0..4, checkpoints 0 and 4
    for window, word in (
        (["--from", "0", "--to", "500"], "--to 500"),
        (["--from", "4", "--to", "5"], "--to 5"),
        (["--from", "8", "--to", "9"], "--to 9"),
    ):
        ran = run_installed(["replay", str(trace), *window, "--checkpoints", str(checkpoints)], tmp_path)
        assert ran.returncode == 2, ran.stderr
        line = _one_error_line(ran)
        assert word in line and "outside the trace's steps 0..4" in line
    device = run_installed(
        ["replay", str(trace), "--from", "0", "--to", "1", "--device", "tpu", "--checkpoints", str(checkpoints)],
        tmp_path,
    )
    assert device.returncode == 2 and "'tpu' is not a torch device" in _one_error_line(device)


def test_click_usage_errors_are_one_line(make_trace, tmp_path):
    trace = str(make_trace(steps=3))
    for args, word in (
        (["replay", trace, "--to", "2"], "--from"),
        (["bisect"], "TRACE_DIR"),
        (["inspect", trace, "--frm"], "--frm"),
        (["bisect", trace, "--checkpoints", str(tmp_path / "none")], "--checkpoints"),
    ):
        ran = run_installed(args, tmp_path)
        assert ran.returncode == 2, ran.stderr
        assert word in _one_error_line(ran)


def test_inspect_names_the_step_rank_and_check_of_each_alarm(demo_run, tmp_path):
    """The 3-rank weights fault of tests/cli/test_certify_demo.py (same run, cached): rank 1's
    replica differs from the majority after step 3, and the weights check fires on each later step."""
    out = demo_run(
        ("weights:step=3:rank=1:bit=20", "checkpoint-file:step=2:rank=0:bit=3"),
        steps=6,
        checkpoint_every=2,
        world_size=3,
    )
    ran = run_installed(["inspect", str(out / "trace"), "--json"], tmp_path)
    assert ran.returncode == 0, ran.stderr
    alarms = json.loads(ran.stdout)["alarms"]
    assert alarms and alarms[0]["step"] == 3 and alarms[0]["rank"] == 1 and alarms[0]["check"] == "weights"
    assert all(a["recorded_by"] == [0, 1, 2] for a in alarms)  # every rank's copy, counted once
    assert "strict majority" in alarms[0]["detail"]
    rows = [line.split() for line in ran.stderr.splitlines() if line.startswith("3 ")]
    assert ["3", "1", "weights"] in [row[:3] for row in rows], ran.stderr


def test_certify_exit_codes_answer_where_to_resume(make_run, make_trace, tmp_path):
    run = make_run(steps=6, diverge=(3, 1))
    resume = run_installed(["certify", str(run.trace_dir), "--json"], tmp_path)
    doc = json.loads(resume.stdout)
    assert resume.returncode == 0 and doc["resume_step"] == 0 and doc["verdict"] == "corruption"
    assert {c["status"] for c in doc["checkpoints"]} >= {"clean", "tainted"}  # tainted ones still listed
    assert "resume from step 0" in resume.stderr and "not clean, listed above" in resume.stderr
    moved = tmp_path / "moved"
    shutil.copytree(run.checkpoints_dir, moved)
    (moved / run.checkpoints[0].name).unlink()  # no checkpoint 0 to resume from: only tainted ones found
    none = run_installed(["certify", str(run.trace_dir), "--checkpoints", str(moved), "--json"], tmp_path)
    assert none.returncode == 1, none.stderr
    assert json.loads(none.stdout)["resume_step"] is None
    quiet = make_run(steps=2)
    shutil.rmtree(quiet.checkpoints_dir)  # nothing wrong, nothing read: unverified
    unverified = run_installed(["certify", str(quiet.trace_dir), "--json"], tmp_path)
    assert unverified.returncode == 4, unverified.stderr
    assert {c["status"] for c in json.loads(unverified.stdout)["checkpoints"]} == {"unverified"}
    bad = run_installed(["certify", str(make_trace(fault=Fault(kind="nonfinite", step=3, rank=1)))], tmp_path)
    assert bad.returncode == 1  # no notes, corruption found
    assert run_installed(["certify", str(make_trace())], tmp_path).returncode == 4  # no notes, nothing found


def test_output_appearing_during_the_analysis_is_not_overwritten(tmp_path):
    """The existence check runs before a possibly long analysis; the write itself never replaces
    a file that appeared meanwhile (without --force), and leaves no temporary file."""
    from sdc_forensics.errors import UsageError
    from sdc_forensics.newfile import write_new_file

    target = tmp_path / "review.html"

    def appears_meanwhile(handle):
        target.write_text("someone else's")  # created while we were writing
        handle.write("ours")

    with pytest.raises(UsageError, match="exists"):
        write_new_file(target, False, appears_meanwhile)
    assert target.read_text() == "someone else's" and sorted(p.name for p in tmp_path.iterdir()) == ["review.html"]
    write_new_file(target, True, lambda handle: handle.write("ours"))
    assert target.read_text() == "ours"
