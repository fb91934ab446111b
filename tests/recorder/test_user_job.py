"""Issue 10, item 5: the recorder in a training script that is not ours (``tests/recorder/userjob.py``),
3 real gloo processes launched as a launcher would (one ``python`` per rank, ``RANK``/``WORLD_SIZE``
in the environment), then the installed ``sdc-forensics`` with stderr to a file:

* job settings reach the recipe through the manifest (``recipe_args``): bisect replays exactly;
* the DDP wrapper's ``state_dict`` (``module.`` keys) is a valid ``state=``, and ``rec.checkpoint``
  returns the note;
* a comm hook already on the model: one clear line naming ``comm_hook=``, nothing on disk, and
  the next run is attempt 0;
* an alarm under policy ``raise`` ends every rank with ``ALARM_EXIT_CODE`` (18) and one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdc_forensics.recipe import load_recipe
from sdc_forensics.recorder import ALARM_EXIT_CODE
from sdc_forensics.trace.manifest import read_manifest
from tests.cli.installed import run_installed
from tests.factories import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
WORLD = 3


def _launch(tmp_path: Path, *args: str, timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """One process per rank, as torchrun or srun would start them; each rank's stderr to a file."""
    port = free_port()
    env = {
        **os.environ,
        "WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    procs, logs = [], []
    for rank in range(WORLD):
        log = open(tmp_path / f"rank{rank}-{port}.err", "w+", encoding="utf-8")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.recorder.userjob", *args],
                cwd=tmp_path,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        )
    out = []
    try:
        for rank, proc in enumerate(procs):
            proc.wait(timeout=timeout)
            logs[rank].seek(0)
            out.append(subprocess.CompletedProcess(proc.args, proc.returncode, "", logs[rank].read()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()
    return out


def _job_args(root: Path, *extra: str) -> list[str]:
    return ["--trace", str(root / "trace"), "--checkpoints", str(root / "ckpt"), *extra]


def test_recipe_args_reach_the_replay_and_the_ddp_state_dict_is_accepted(tmp_path):
    root = tmp_path / "job"
    ranks = _launch(
        tmp_path,
        *_job_args(root, "--width", "24", "--seed", "3", "--state", "ddp", "--inject", "grad:step=3:rank=1:bit=30"),
    )
    assert [r.returncode for r in ranks] == [0, 0, 0], ranks[0].stderr
    assert read_manifest(root / "trace").recipe_args == {"width": 24, "seed": 3}

    notes = json.loads(
        (root / "notes-rank2.json").read_text()
    )  # what rec.checkpoint returned, on a rank that did not save
    assert [n["step"] for n in notes] == [0, 2, 4, 6] and {n["type"] for n in notes} == {"CheckpointNote"}
    assert notes[0]["param_names"] == [
        "model.module.0.weight",
        "model.module.0.bias",
        "model.module.2.weight",
        "model.module.2.bias",
    ]
    assert notes[0]["path_from_trace"] == "../ckpt/step-00000000.pt"

    # the recipe needs its settings: without them it builds a model the checkpoints do not fit
    saved = torch.load(root / "ckpt" / "step-00000000.pt", weights_only=True)["model"]["module.0.weight"]
    assert tuple(saved.shape) == (24, 8)
    assert tuple(
        load_recipe("tests.recorder.userjob:make_recipe", args={"width": 24, "seed": 3}).build("cpu")[0][0].weight.shape
    ) == (24, 8)
    with pytest.raises(Exception, match="width"):
        load_recipe("tests.recorder.userjob:make_recipe")  # no settings: the factory cannot even be called

    env = {"PYTHONPATH": str(REPO)}
    ran = run_installed(["bisect", str(root / "trace"), "--json"], tmp_path, env=env)
    assert ran.returncode == 1, ran.stderr
    doc = json.loads(ran.stdout)
    assert doc["first_divergent_step"] == 3 and [s["rank"] for s in doc["suspects"]] == [1]
    assert {c["step"]: c["status"] for c in doc["checkpoints"]}[2] == "clean"
    assert doc["replayed"]["windows"] and {w["comparison"] for w in doc["replayed"]["windows"]} == {"exact"}
    ran = run_installed(["replay", str(root / "trace"), "--from", "2", "--to", "4", "--json"], tmp_path, env=env)
    assert ran.returncode == 1, ran.stderr  # replay, too, rebuilds the job with its recorded settings
    assert json.loads(ran.stdout)["first_divergent_step"] == 3


def test_a_model_with_a_comm_hook_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "job"
    ranks = _launch(tmp_path, *_job_args(root, "--width", "8", "--preregister-hook", "--steps", "2"))
    for r in ranks:
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert (
            "UsageError" in last
            and "already has a DDP comm hook (_allreduce_hook)" in last
            and "comm_hook=hook" in last
        )
        assert "can only be called once" not in r.stderr
    assert not (root / "trace").exists() and not (root / "ckpt").exists()  # no manifest, no rank file, no checkpoint

    again = _launch(tmp_path, *_job_args(root, "--width", "8", "--steps", "2"))
    assert [r.returncode for r in again] == [0, 0, 0], "\n".join(r.stderr[-2000:] for r in again)
    assert sorted(p.name for p in (root / "trace").glob("rank-*.sdct")) == [
        f"rank-{r:05d}.attempt-000.sdct" for r in range(WORLD)
    ]
    assert [a.attempt for a in read_manifest(root / "trace").attempts] == [0]


def test_an_alarm_under_policy_raise_exits_with_the_documented_code(tmp_path):
    root = tmp_path / "job"
    ranks = _launch(
        tmp_path, *_job_args(root, "--width", "8", "--policy", "raise", "--inject", "update:step=2:rank=2:bit=28")
    )
    assert ALARM_EXIT_CODE == 18
    assert [r.returncode for r in ranks] == [ALARM_EXIT_CODE] * WORLD, ranks[0].stderr
    for r in ranks:
        lines = [
            line for line in r.stderr.splitlines() if line.strip()
        ]  # the recorder's logged alarm, then the exit line
        assert "Traceback" not in r.stderr
        assert lines[-1].startswith(
            f"sdc-forensics: training stopped by an online check (exit {ALARM_EXIT_CODE}): weights check fired at step 2"
        )
        assert "rank(s) 2 differ" in lines[-1] and lines[-1].endswith(
            f"; next, run: sdc-forensics bisect {root / 'trace'}"
        )
        assert lines[-1].count("sdc-forensics bisect") == 1 and "`" not in lines[-1]  # issue 25: said once, no markup
    ran = run_installed(["inspect", str(root / "trace")], tmp_path)
    assert ran.returncode == 0 and "weights" in ran.stderr
