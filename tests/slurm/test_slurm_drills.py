"""Issue 39: the Slurm scripts and commands of docs/distributed.md ("Against a real Slurm"), run as
written against a real Slurm started by the session (``tests/slurm/conftest.py``).

* the replay fan-out (``srun`` starts 2 ``bisect`` processes) prints the single-process document;
* a training job whose online check fires exits 18, its wrapper runs the report's drain command,
  and ``scontrol show node`` reads DRAIN with the reason the tool wrote;
* the incident end to end: certify on the other node, the report's resume command (it excludes
  the drained node) resumes from the certified checkpoint, the final weights are a clean run's;
* ``certify --follow`` as a job beside the training job.

Scripts come out of the doc's text (the block whose second line is ``# tests/slurm: NAME``); the
commands run here are checked to appear verbatim in it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed.launch import ROOT, free_port, strip_timing

pytestmark = [pytest.mark.slurm, pytest.mark.heavy]

DOC = ROOT / "docs" / "distributed.md"
STEPS, EVERY = 8, 2
FAULT = "weights:step=5:rank=2:bit=30"  # the replicas' vote before checkpoint 6 fires: every rank exits 18
JOB_TIMEOUT_S = 240
#: The commands of the incident drill, as the doc shows them.
CERTIFY = (
    'sbatch --wait --exclude="$NODE" --ntasks=1 --output=sdc-certify-%j.log --wrap \'python -m sdc_forensics certify '
    '"$RUN/trace" --certificate-out "$RUN/resume.json"\''
)
REPLAY_SUBMIT = "sbatch --wait sdc-replay.sbatch"
TRAIN_SUBMIT = "sbatch --wait sdc-train.sbatch"


def doc_script(name: str) -> str:
    """The doc's script ``name``: the bash block whose second line is ``# tests/slurm: NAME``."""
    for block in re.findall(r"```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S):
        lines = block.splitlines()
        if len(lines) > 1 and lines[1].strip() == f"# tests/slurm: {name}":
            return block
    raise AssertionError(f"docs/distributed.md has no script {name}")


def assert_in_doc(command: str) -> None:
    assert command in DOC.read_text(encoding="utf-8"), (
        f"docs/distributed.md does not show the command the test ran: {command}"
    )


def _job_id(stdout: str) -> str:
    found = re.search(r"Submitted batch job (\d+)", stdout)
    assert found, stdout
    return found.group(1)


def _env(run: Path | None = None, **extra: str) -> dict[str, str]:
    env = {"PYTHONPATH": str(ROOT), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **extra}
    if run is not None:
        env["RUN"] = str(run)
    return env


def _ranks_nodes(log: Path) -> dict[int, str]:
    """``{rank: node}`` from the training tasks' own lines (Slurm's placement, not the trace's)."""
    return {
        int(r): n for r, n in re.findall(r"train_task: rank (\d+) of \d+ on node (\S+?)(?:,|\s|$)", log.read_text())
    }


def _final_weights(run: Path) -> set[str]:
    return {json.loads(p.read_text())["final_weights_digest"] for p in sorted((run / "demo").glob("rank-*.json"))}


def _model_tensors(path: Path):
    import torch

    return torch.load(path, weights_only=True, map_location="cpu")["model"]


def test_replay_fan_out_under_srun_prints_the_single_process_document(slurm, demo_run, tmp_path):
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    trace = demo_run("grad:step=4:rank=1:bit=30", steps=6, checkpoint_every=3) / "trace"
    (tmp_path / "sdc-replay.sbatch").write_text(doc_script("sdc-replay.sbatch"))
    assert_in_doc(REPLAY_SUBMIT)
    done = slurm.run(REPLAY_SUBMIT, cwd=tmp_path, env=_env(TRACE=str(trace)), timeout_s=JOB_TIMEOUT_S)
    job = _job_id(done.stdout)
    log = (tmp_path / f"sdc-replay-{job}.log").read_text()
    single = CliRunner().invoke(cli, ["bisect", str(trace), "--json"])
    assert single.exit_code == 1, single.output  # corruption: the fault is found
    # sbatch --wait exits with the job's code: srun's, the highest of its tasks', bisect's own
    assert done.returncode == single.exit_code, (done.stdout, done.stderr, log[-3000:])
    assert slurm.wait_job(job, 30) == ("FAILED", 1)
    assert log.count("note: replaying across 2 processes (gloo)") == 1, log[-3000:]
    document = json.loads((tmp_path / f"verdict-{job}.json").read_text())
    assert strip_timing(document) == strip_timing(json.loads(single.stdout))
    assert document["first_divergent_step"] == 4 and [s["rank"] for s in document["suspects"]] == [1]


@pytest.fixture(scope="module")
def clean_run(slurm_cluster, tmp_path_factory):
    """A clean training job and ``certify --follow`` as a job beside it: ``(run dir, training log, follower job, follower log)``."""
    slurm_cluster.resume_nodes()
    work = tmp_path_factory.mktemp("slurm-clean")
    run = work / "run"
    (work / "sdc-train.sbatch").write_text(doc_script("sdc-train.sbatch"))
    (work / "sdc-follow.sbatch").write_text(doc_script("sdc-follow.sbatch"))
    base = slurm_cluster.env(**_env(run, TRAIN_ARGS="", UNTIL_STEP=str(STEPS)))
    base.pop("SDC_FORENSICS_NO_LEDGER", None)  # the follower records what it examined in the trace's ledger

    def submit(script: str) -> str:
        out = subprocess.run(["sbatch", script], cwd=work, env=base, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return _job_id(out.stdout)

    train, follow = submit("sdc-train.sbatch"), submit("sdc-follow.sbatch")
    assert slurm_cluster.wait_job(train, JOB_TIMEOUT_S) == ("COMPLETED", 0), (
        work / f"sdc-train-{train}.log"
    ).read_text()[-3000:]
    follower = slurm_cluster.wait_job(follow, JOB_TIMEOUT_S)
    return run, work / f"sdc-train-{train}.log", follower, work / f"sdc-follow-{follow}.log"


def test_certify_follow_as_a_job_beside_training_certifies_every_interval(clean_run):
    run, _, follower, follow_log = clean_run
    assert_in_doc("sbatch sdc-train.sbatch; sbatch sdc-follow.sbatch")
    text = follow_log.read_text()
    assert follower == ("COMPLETED", 0), text[-3000:]
    ledger = [json.loads(line) for line in (run / "trace" / "ledger.jsonl").read_text().splitlines() if line.strip()]
    intervals = sorted((r["start_step"], r["stop_step"], r["comparison"], r["outcome"]) for r in ledger)
    assert intervals == [(s, s + EVERY, "exact", "clean") for s in range(0, STEPS, EVERY)], text[-3000:]
    assert f"follower stopped (until-step): {STEPS // EVERY} interval(s) replayed" in text, text[-3000:]


def test_an_alarm_exits_18_drains_the_node_and_the_resume_from_the_certified_checkpoint_ends_as_a_clean_run(
    slurm, clean_run, tmp_path
):
    started = time.monotonic()
    clean, clean_log, _, _ = clean_run
    run = tmp_path / "run"
    (tmp_path / "sdc-train.sbatch").write_text(doc_script("sdc-train.sbatch"))
    assert_in_doc(TRAIN_SUBMIT)
    assert_in_doc(f'TRAIN_ARGS="--inject {FAULT}" {TRAIN_SUBMIT}')

    # 1. training with a fault: every rank exits 18, the job does, its wrapper drains rank 2's node
    done = slurm.run(TRAIN_SUBMIT, cwd=tmp_path, env=_env(run, TRAIN_ARGS=f"--inject {FAULT}"), timeout_s=JOB_TIMEOUT_S)
    job = _job_id(done.stdout)
    log_path = tmp_path / f"sdc-train-{job}.log"
    log = log_path.read_text()
    assert done.returncode == 18, log[-3000:]
    assert slurm.wait_job(job, 30) == ("FAILED", 18)
    assert log.count("training stopped by an online check (exit 18)") == 4, log[-3000:]
    placed = _ranks_nodes(log_path)
    assert sorted(placed) == [0, 1, 2, 3], log[-3000:]
    suspect = placed[2]
    report = json.loads((run / f"report-{job}.json").read_text())
    drain = [c for a in report["report"]["actions"] if a["platform"] == "slurm" for c in a["commands"]]
    reason_written = f"sdc-forensics: SDC at step 5, rank 2, cpu (local rank {_local_rank(placed, 2)}) job {job}"
    assert drain == [f"scontrol update nodename={suspect} state=drain reason='{reason_written}'"], report["report"][
        "actions"
    ]
    state, reason = slurm.show_node(suspect)
    assert "DRAIN" in state.split("+"), (state, log[-3000:])
    assert reason == reason_written
    others = [n for n in slurm.nodes if n != suspect]
    for name in others:
        assert "DRAIN" not in slurm.show_node(name)[0]

    if not others:
        # one node: the report's resume command has nowhere to go, and Slurm says so at once
        refused = slurm.run(f"sbatch --exclude={suspect} sdc-train.sbatch", cwd=tmp_path, env=_env(run), timeout_s=60)
        assert refused.returncode == 1 and "Requested node configuration is not available" in refused.stderr, refused
        return

    # 2. certify, as a job on the other node
    assert_in_doc(CERTIFY)
    certify = slurm.run(CERTIFY, cwd=tmp_path, env=_env(run, NODE=suspect), timeout_s=JOB_TIMEOUT_S)
    certify_job = _job_id(certify.stdout)
    certify_log = (tmp_path / f"sdc-certify-{certify_job}.log").read_text()
    assert certify.returncode == 0, certify_log[
        -3000:
    ]  # a resume point is certified (the corruption after it is in the log)
    certificate = json.loads((run / "resume.json").read_text())
    assert certificate["first_divergent_step"] == 5 and certificate["resume_step"] == 4, certificate

    # 3. the report's resume command, executed: job.sbatch is the training script, RESUME_CERT the certificate
    resume_commands = [
        c
        for a in report["report"]["actions"]
        if a["platform"] == "resume"
        for c in a["commands"]
        if c.startswith("sbatch")
    ]
    assert resume_commands == [
        f"sbatch --exclude={suspect} job.sbatch   # your job script, once a resume point is settled"
    ], report
    assert_in_doc('RESUME_CERT="$RUN/resume.json" sbatch --exclude=NODE job.sbatch')
    shutil.copy(tmp_path / "sdc-train.sbatch", tmp_path / "job.sbatch")
    resumed = slurm.run(
        resume_commands[0],
        cwd=tmp_path,
        env=_env(run, RESUME_CERT=str(run / "resume.json"), TRAIN_ARGS=""),
        timeout_s=60,
    )
    resume_job = _job_id(resumed.stdout)
    resume_log_path = tmp_path / f"sdc-train-{resume_job}.log"
    assert slurm.wait_job(resume_job, JOB_TIMEOUT_S) == ("COMPLETED", 0), resume_log_path.read_text()[-3000:]
    resume_log = resume_log_path.read_text()
    assert set(_ranks_nodes(resume_log_path).values()) == set(others), resume_log[-3000:]
    assert resume_log.count("resuming from checkpoint 4") == 4, resume_log[-3000:]

    # 4. the final weights are a clean run's, and the clean run went through the same checkpoint 4
    import torch

    clean_4, resumed_4 = (
        _model_tensors(clean / "checkpoints" / Path(certificate["resume_path"]).name),
        _model_tensors(Path(certificate["resume_path"])),
    )
    assert clean_4.keys() == resumed_4.keys() and all(torch.equal(clean_4[k], resumed_4[k]) for k in clean_4)
    assert len(_final_weights(run)) == 1 and _final_weights(run) == _final_weights(clean), (
        _final_weights(run),
        _final_weights(clean),
    )
    print(f"\nslurm incident drill (train with a fault, drain, certify, resume): {time.monotonic() - started:.1f} s")


def _local_rank(placed: dict[int, str], rank: int) -> int:
    """Slurm's ``SLURM_LOCALID`` of ``rank``: its index among the ranks on its node, in rank order."""
    return sorted(r for r, n in placed.items() if n == placed[rank]).index(rank)
