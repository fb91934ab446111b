"""``sdc-forensics report`` as an on-call engineer runs it: the installed command, stderr to a file,
on real gloo demo incidents (a local gradient flip, a checkpoint file damaged on disk) and a clean
run; the HTML opened in headless chromium; the reproduce command of a report rerun as written."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.installed import run_installed
from tests.factories import Fault, tree_sha256
from tests.present.browser import find_chromium, open_page
from tests.schema_check import assert_valid

STEPS, EVERY = 6, 3  # the runs of tests/forensics/test_bisect_demo.py and test_tolerant.py: made once per session
GRAD = "grad:step=4:rank=2:bit=30"
STORAGE = "checkpoint-file:step=3:rank=0:bit=30"
CHROMIUM = find_chromium()


def _report(trace: Path, out: Path, tmp_path: Path, *extra: str):
    return run_installed(["report", str(trace), "-o", str(out), *extra], tmp_path)


@pytest.mark.slow
def test_grad_incident_html_shows_step_rank_host_and_resume_point_in_a_browser(demo_run, tmp_path):
    out_dir = demo_run(GRAD, steps=STEPS, checkpoint_every=EVERY)
    before = tree_sha256(out_dir)
    out = tmp_path / "review.html"
    ran = _report(out_dir / "trace", out, tmp_path)
    assert ran.returncode == 1, ran.stderr
    assert ran.stderr_lines[-1] == f"post-incident review (html) written to {out}"
    assert tree_sha256(out_dir) == before  # the trace and checkpoints are never touched
    page = out.read_text()
    # the demo's ranks compute on the CPU: the host check stands in for DCGM, which tests GPUs only
    assert "stress-ng" in page and "dcgmi diag" not in page
    assert "Keep checkpoints off the replaced node".lower() in page.lower()
    if CHROMIUM is None:
        pytest.skip("no chromium/chromium-browser/google-chrome on PATH: the browser half of this test cannot run")
    shown = open_page(out, CHROMIUM)
    assert shown.errors == [] and shown.svg_count >= 1
    assert all(url.startswith(("file:", "data:")) for url in shown.requests), shown.requests
    text = shown.text
    assert "First divergent step\n4" in text
    assert "rank 2" in text and f"host {socket.gethostname()}" in text
    assert f"checkpoint 3 {out_dir / 'checkpoints' / 'step-00000003.pt'}" in text
    assert re.search(r"Step 4 ran between \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z and ", text)


@pytest.mark.slow
def test_the_reproduce_commands_of_a_report_rerun_as_written(demo_run, tmp_path):
    out_dir = demo_run(GRAD, steps=STEPS, checkpoint_every=EVERY)
    out = tmp_path / "review.md"
    assert _report(out_dir / "trace", out, tmp_path, "--threads", "1").returncode == 1
    block = out.read_text().split("## Reproduce this analysis", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    commands = block.splitlines()
    assert commands[1].endswith(f"--threads 1 --format md -o {out} --force")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    first = out.stat().st_ino
    for command in commands:  # from another directory: the paths are absolute
        with open(tmp_path / "rerun.log", "w") as log:
            done = subprocess.run(
                command, shell=True, cwd="/", env=env, stdout=subprocess.DEVNULL, stderr=log, timeout=300
            )
        assert done.returncode == 1, (command, (tmp_path / "rerun.log").read_text())
    assert out.stat().st_ino != first and out.read_text().startswith(
        "# Post-incident review"
    )  # rewritten (a renamed new file), not refused


@pytest.mark.slow
def test_storage_incident_points_at_the_disk_never_the_gpu(demo_run, tmp_path):
    out_dir = demo_run(STORAGE, steps=STEPS, checkpoint_every=EVERY)
    out = tmp_path / "review.json"
    ran = _report(out_dir / "trace", out, tmp_path)
    assert ran.returncode == 1, ran.stderr
    doc = assert_valid(out.read_text(), "report")
    [node] = doc["report"]["nodes"]
    assert node["location"] == "storage" and node["implicates"] == "disk" and node["dcgm_level"] is None
    platforms = [a["platform"] for a in doc["report"]["actions"]]
    assert "dcgm" not in platforms and "hyperpod" not in platforms and "kubernetes" not in platforms
    storage = next(a for a in doc["report"]["actions"] if a["platform"] == "storage")
    assert "The GPU is not implicated" in " ".join(storage["why"])
    assert doc["report"]["checkpoint_locality"] == "node_local"  # the demo wrote under the temporary directory
    resume = next(a for a in doc["report"]["actions"] if a["platform"] == "resume")
    step = doc["report"]["resume"]["step"]
    assert f"rsync -a {socket.gethostname()}:{out_dir / 'checkpoints' / f'step-{step:08d}.pt'} SHARED_DIR/" in " ".join(
        resume["commands"]
    )
    assert "keep checkpoints off the replaced node" in " ".join(resume["why"])
    slurm = next(a for a in doc["report"]["actions"] if a["platform"] == "slurm")
    assert "checkpoint file damaged at rest" in slurm["commands"][0] and "GPU" not in slurm["commands"][0]


@pytest.mark.slow
def test_clean_demo_has_no_node_action(demo_run, tmp_path):
    out_dir = demo_run("none", steps=STEPS, checkpoint_every=EVERY)
    out = tmp_path / "review.md"
    ran = _report(out_dir / "trace", out, tmp_path)
    assert ran.returncode == 0, ran.stderr
    text = out.read_text()
    assert "### No node action" in text and "scontrol" not in text and "kubectl" not in text and "dcgmi" not in text
    assert "**Lost:** Nothing lost" in text


def test_installed_report_refuses_an_existing_output_in_one_line(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=10, fault=Fault(kind="nonfinite", step=4, rank=1))
    out = tmp_path / "review.html"
    out.write_text("my notes")
    ran = _report(trace, out, tmp_path, "--trace-only")
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr_lines == [f"error: -o {out} exists: choose another path, or pass --force to overwrite it"]
    assert out.read_text() == "my notes"
    ran = _report(trace, out, tmp_path, "--trace-only", "--force")
    assert ran.returncode == 1 and out.read_text().startswith("<!DOCTYPE html>")
    assert ran.stderr_lines == [f"post-incident review (html) written to {out}"]


def test_installed_report_json_on_stdout_matches_the_schema(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=10, fault=Fault(kind="weights", step=4, rank=1))
    ran = run_installed(["report", str(trace), "--trace-only", "--format", "json"], tmp_path)
    assert ran.returncode == 1 and ran.stderr_lines == []
    doc = assert_valid(ran.stdout, "report")
    assert doc["report"]["nodes"][0]["rank"] == 1


@pytest.mark.slow
def test_reproduce_commands_put_the_jobs_recipe_on_pythonpath(sim, tmp_path, monkeypatch):
    """A recipe from the job's own code (not installed): the commands say where it was imported
    from, and rerun from / with no PYTHONPATH of the caller's."""
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli
    from tests.factories import SimFault

    code = tmp_path / "code"
    (code / "jobcode").mkdir(parents=True)
    (code / "jobcode" / "__init__.py").write_text("")
    (code / "jobcode" / "train.py").write_text("from sdc_forensics.demo.recipe import recipe  # the job's recipe\n")
    monkeypatch.syspath_prepend(str(code))
    run = sim(SimFault(where="grad", step=5, rank=2, bit=30), steps=8, checkpoint_every=4)
    out = tmp_path / "review.md"
    result = CliRunner().invoke(cli, ["report", str(run / "trace"), "--recipe", "jobcode.train:recipe", "-o", str(out)])
    assert result.exit_code == 1, result.output
    text = out.read_text()
    assert f"it was imported from {code}." in text
    commands = text.split("## Reproduce this analysis", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert all(c.startswith(f"PYTHONPATH={code}${{PYTHONPATH:+:$PYTHONPATH}} sdc-forensics ") for c in commands)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for command in commands:
        with open(tmp_path / "rerun.log", "w") as log:
            done = subprocess.run(
                command, shell=True, cwd="/", env=env, stdout=subprocess.DEVNULL, stderr=log, timeout=300
            )
        assert done.returncode == 1, (command, (tmp_path / "rerun.log").read_text())


def test_installed_report_into_a_closed_pipe_is_quiet(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=10, fault=Fault(kind="nonfinite", step=4, rank=1))
    log = tmp_path / "stderr.log"
    from tests.cli.installed import command

    done = subprocess.run(
        f"{command()} report {trace} --trace-only --format html 2>{log} | head -c 10",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        executable="/bin/bash",
    )
    assert done.stdout == "<!DOCTYPE " and log.read_text() == ""
    status = subprocess.run(
        f"set -o pipefail; {command()} report {trace} --trace-only --format html 2>/dev/null | head -c 10 >/dev/null",
        shell=True,
        timeout=120,
        executable="/bin/bash",
    )
    assert status.returncode == 1  # the verdict's code, not a broken pipe's
