"""Issue 25, "a new user's first hour": what the installed command prints and exits with when a
user follows the README with a job of their own. Each test is one item of the issue.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

from tests.cli.installed import command, run_installed
from tests.factories import Fault, SimFault, flip_byte, zip_member_offset


def _closed_stderr(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """Run the installed command with stderr a pipe whose reader is gone (``2>&1 | head -1``
    after head exited); stdout captured."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    try:
        return subprocess.run(
            [command(), *args], stdout=subprocess.PIPE, stderr=write_end, env=env, text=True, timeout=300, cwd=tmp_path
        )
    finally:
        os.close(write_end)


def test_exit_status_does_not_depend_on_stderr_being_a_closed_pipe(sim, tmp_path):
    run = sim(SimFault(where="grad", step=4, rank=3, bit=11), steps=5, checkpoint_every=4)
    trace, checkpoint = str(run / "trace"), str(run / "checkpoints" / "step-00000004.pt")
    for args in (
        ["inspect", trace],
        ["verify-checkpoint", checkpoint],
        ["bisect", trace, "--trace-only"],
        ["bisect", trace, "--checkpoints", str(run / "checkpoints")],
    ):
        unpiped = run_installed(args, tmp_path)
        piped = _closed_stderr(args, tmp_path)
        assert piped.returncode == unpiped.returncode, (args, unpiped.stderr)
    assert run_installed(["inspect", trace], tmp_path).returncode == 0
    assert run_installed(["bisect", trace, "--checkpoints", str(run / "checkpoints")], tmp_path).returncode == 1
    # the shell pipeline of the issue, as a user types it
    bash = subprocess.run(
        ["bash", "-c", f'"{command()}" verify-checkpoint "{checkpoint}" 2>&1 | head -1; exit ${{PIPESTATUS[0]}}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bash.returncode == 0, bash.stdout + bash.stderr


def test_a_statistical_hint_is_weak_in_json_text_markdown_and_html(make_trace, tmp_path):
    trace = str(make_trace(fault=Fault(kind="outlier", step=3, rank=2)))
    ran = run_installed(["bisect", trace, "--trace-only", "--json"], tmp_path)
    assert ran.returncode == 4, ran.stderr
    [hint] = json.loads(ran.stdout)["hints"]
    assert (hint["kind"], hint["strength"]) == ("outlier", "weak")
    for suffix in ("md", "html"):
        out = tmp_path / f"review.{suffix}"
        assert run_installed(["report", trace, "--trace-only", "-o", str(out)], tmp_path).returncode == 4
        row = [
            line for line in out.read_text().replace("<tr>", "\n<tr>").splitlines() if "outlier across ranks" in line
        ]
        assert row and all(("| weak |" if suffix == "md" else "<td>weak</td>") in r for r in row), row


def test_trace_only_checkpoint_table_names_every_file(make_run, tmp_path):
    run = make_run(steps=4)
    ran = run_installed(["bisect", str(run.trace_dir), "--trace-only", "--json"], tmp_path)
    doc = json.loads(ran.stdout)
    assert {c["step"]: c["path"] for c in doc["checkpoints"]} == {n: str(p) for n, p in run.checkpoints.items()}
    rows = [
        line.split()
        for line in ran.stderr.splitlines()
        if line.split()[:2] in (["0", "unverified"], ["2", "unverified"])
    ]
    assert len(rows) == 2 and all(row[-1].endswith(".pt") for row in rows), ran.stderr


def test_inspect_does_not_call_a_corrupt_checkpoint_blessed(make_run, tmp_path):
    run = make_run(steps=2)
    start, size = zip_member_offset(run.checkpoints[2], "/data/1")
    flip_byte(run.checkpoints[2], start + size - 1, 0x40)  # storage damage after the save: bisect calls it corrupt
    bisect = run_installed(["bisect", str(run.trace_dir), "--json"], tmp_path)
    assert {c["step"]: c["status"] for c in json.loads(bisect.stdout)["checkpoints"]}[2] == "corrupt", bisect.stderr
    inspected = run_installed(["inspect", str(run.trace_dir)], tmp_path)
    assert inspected.returncode == 0
    assert "blessed" not in inspected.stderr and "yes" not in inspected.stderr
    assert "saved from" in inspected.stderr and "statuses: sdc-forensics certify" in inspected.stderr


def test_a_trace_missing_a_rank_file_reads_no_empty_ranges(sim, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sim(steps=8, checkpoint_every=4), run)
    (run / "trace" / "rank-00002.attempt-000.sdct").unlink()
    ran = run_installed(["bisect", str(run / "trace"), "--checkpoints", str(run / "checkpoints"), "--json"], tmp_path)
    assert ran.returncode == 4, ran.stderr
    backwards = [m for m in re.findall(r"(\d+)\.\.(-?\d+)", ran.stderr) if int(m[1]) < int(m[0])]
    assert not backwards, backwards  # no "0..-1", "4..3": a range never ends before it starts
    assert "..-1" not in ran.stderr and "4..3" not in ran.stderr
    assert "--max-replay-steps" not in ran.stderr and "nothing replayable from checkpoints 0, 4" in ran.stderr
    assert "--max-replay-steps" not in " ".join(json.loads(ran.stdout)["settle"])
    limited = run_installed(
        ["bisect", str(run / "trace"), "--checkpoints", str(run / "checkpoints"), "--max-replay-steps", "1"], tmp_path
    )
    assert "--max-replay-steps" in limited.stderr  # the one case it names the flag: when it was passed


def test_units_and_plurals_read_right():
    import torch

    from sdc_forensics.replay.env import describe_device
    from sdc_forensics.present.text import count_text, rate_text

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert describe_device(torch.device("cpu")).endswith(", 1 thread)")
        torch.set_num_threads(2)
        assert describe_device(torch.device("cpu")).endswith(", 2 threads)")
        # a replay whose steps ran with the counts they recorded (a trial user's ranks at 1 and 2 threads) says so
        assert describe_device(torch.device("cpu"), {2, 1}).endswith(", 1 and 2 threads, as the steps recorded)")
        assert describe_device(torch.device("cpu"), {1}).endswith(", 1 thread)")
    finally:
        torch.set_num_threads(before)
    assert (count_text(1, "byte"), count_text(3, "byte")) == ("1 byte", "3 bytes")
    assert rate_text(2_500_000_000, 1.0) == "2.5 GB/s" and rate_text(37_000_000, 1.0) == "37 MB/s"
    assert rate_text(1_200, 1.0) == "1.2 kB/s" and rate_text(5, 1.0) == "5 B/s" and rate_text(5, 0.0) == "-"


def test_verify_checkpoint_small_file_never_reads_0_gb_s(make_run, tmp_path):
    run = make_run(steps=2)
    ran = run_installed(["verify-checkpoint", str(run.checkpoints[0])], tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "0.00 GB/s" not in ran.stderr and re.search(r"\d+(\.\d)? [kMG]?B/s", ran.stderr), ran.stderr


def test_verify_checkpoint_with_a_certificate_says_so_and_shows_why_it_fails(make_run, tmp_path):
    run = make_run(steps=2)
    cert = tmp_path / "resume.json"
    # no recipe: inconclusive, so exit 4 (no resume point named), but checkpoint 0 is certified clean in the file
    assert run_installed(["certify", str(run.trace_dir), "--certificate-out", str(cert)], tmp_path).returncode == 4
    ok = run_installed(["verify-checkpoint", str(run.checkpoints[0]), "--certificate", str(cert)], tmp_path)
    assert ok.returncode == 0, ok.stderr
    [line] = [line for line in ok.stderr_lines if line.startswith("VERIFIED")]
    assert f"every file matches {cert}, which certified it clean" in line and "pass --trace" not in line
    bare = run_installed(["verify-checkpoint", str(run.checkpoints[0])], tmp_path)
    assert "certif" not in [line for line in bare.stderr_lines if line.startswith("VERIFIED")][0].replace(
        "certify it", ""
    )
    start, size = zip_member_offset(run.checkpoints[0], "/data/1")
    flip_byte(run.checkpoints[0], start + size // 3)
    bad = run_installed(["verify-checkpoint", str(run.checkpoints[0]), "--certificate", str(cert)], tmp_path)
    assert bad.returncode == 1, bad.stderr
    [head] = [line for line in bad.stderr_lines if line.startswith("NOT CERTIFIABLE")]
    assert ": certificate: " in head, bad.stderr  # the certificate's reason first, not behind "(+1 more)"
    assert "more)" not in bad.stderr and any(line.startswith("  also: ") for line in bad.stderr.splitlines())


def test_bisect_advises_audits_only_as_far_as_the_job_could_run_them(make_trace, tmp_path):
    trace = make_trace(ranks=2, fault=Fault(kind="weights", step=3, rank=1))  # both ranks on host node0: one node
    ran = run_installed(["bisect", str(trace), "--trace-only", "--json"], tmp_path)
    settle = json.loads(ran.stdout)["settle"]
    [audits] = [line for line in settle if line.startswith("audits cannot settle it in this job")]
    assert "every rank is on one node, so audits never run" in audits and audits in ran.stderr


def test_the_trace_path_a_user_mistypes_is_exit_3_with_the_fix(make_trace, tmp_path):
    job = tmp_path / "job"
    trace = make_trace(path=job / "trace", steps=3)
    for args in (["bisect", "--trace-only"], ["inspect"], ["certify"], ["export"]):
        above = run_installed([args[0], str(job), *args[1:]], tmp_path)
        assert above.returncode == 3 and f"but {trace} has one: pass it" in above.stderr, above.stderr
        as_file = run_installed([args[0], str(trace / "manifest.json"), *args[1:]], tmp_path)
        assert (
            as_file.returncode == 3
            and f"is a file, not a trace directory; pass the directory that holds it: {trace}" in as_file.stderr
        )
        missing = run_installed([args[0], str(tmp_path / "nowhere"), *args[1:]], tmp_path)
        assert missing.returncode == 3 and "does not exist" in missing.stderr
        for ran in (above, as_file, missing):
            assert len(ran.stderr_lines) == 1 and ran.stderr.startswith("error: ")


def test_a_mistyped_command_gets_a_suggestion(tmp_path):
    ran = run_installed(["bisec", "x"], tmp_path)
    assert ran.returncode == 2
    assert ran.stderr_lines == ["error: No such command 'bisec'. Did you mean 'bisect'? (see sdc-forensics --help)"]
    far = run_installed(["zzz"], tmp_path)
    assert far.returncode == 2 and "Did you mean" not in far.stderr


def test_the_alarm_line_names_the_next_command_once():
    import io
    import types
    from contextlib import redirect_stderr

    import pytest

    from sdc_forensics.recorder import ALARM_EXIT_CODE, exit_on_alarm
    from sdc_forensics.recorder.checks import Finding, alarm_of
    from sdc_forensics.trace.format import Flag
    from sdc_forensics.trace.manifest import RankIdentity

    ident = RankIdentity(rank=2, host="node7", gpu_uuid="GPU-1234")
    fake = types.SimpleNamespace(identities=[ident] * 4, world_size=4, trace_dir="runs/job42/trace")
    finding = Finding(
        check="weights", step=2, rank=2, detail="rank(s) 2 differ from the strict majority", flag=Flag.WEIGHTS_DIVERGED
    )
    alarm = alarm_of(finding, fake.identities, fake.trace_dir)
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as stopped, exit_on_alarm():
        raise alarm
    assert stopped.value.code == ALARM_EXIT_CODE
    line = err.getvalue().strip()
    assert line.startswith(
        f"sdc-forensics: training stopped by an online check (exit {ALARM_EXIT_CODE}): weights check fired at step 2"
    )
    assert line.endswith("next, run: sdc-forensics bisect runs/job42/trace") and line.count("sdc-forensics bisect") == 1
    assert "`" not in line and "…" not in line


def test_the_readme_says_where_scheduler_step_goes_and_what_torchrun_prints():
    """Two of the issue's smaller items are documentation: where ``scheduler.step()`` belongs
    relative to ``rec.step``, and torchrun's ChildFailedError traceback on a non-zero verdict."""
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
    job = readme[readme.index("**5. Record your own job.**") : readme.index("**6. Spread the replay")]
    block = job[job.index("with rec.step(step") : job.index("if (step + 1) % every == 0")]
    assert block.index("optimizer.step()") < block.index("scheduler.step()")  # inside the block, after the optimizer
    assert "save(0)" in job and job.index("save(0)") < job.index("for step in range(")
    assert "`ChildFailedError` traceback" in readme and "not a crash of sdc-forensics" in readme
