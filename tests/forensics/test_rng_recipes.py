"""A training step that draws from the global RNG (dropout, augmentation) is replayable only if the
recipe seeds the draws itself. The README's job with ``nn.Dropout`` added, as a user would write it:
before, the replay drew other masks than training and ``certify`` blamed a healthy rank
("corruption at step 0, run the DCGM diagnostic on rank 1's GPU"). Now the replay sees that the
step depends on the RNG state it cannot know, judges nothing, and says why (no suspect; only
checkpoint 0, which no step precedes, is certified).
The same job seeding dropout from the microbatch ID is certified clean, draws and all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cli.installed import run_installed
from tests.recorder.test_readme_job import WORLD, _launch, readme_job

pytestmark = pytest.mark.slow

DROPOUT = "nn.Tanh(), nn.Dropout(0.2), nn.Linear"
ROOT = Path(__file__).resolve().parents[2]


def _with_dropout(seeded: bool) -> str:
    script = readme_job()
    assert "nn.Tanh(), nn.Linear" in script
    script = script.replace("nn.Tanh(), nn.Linear", DROPOUT)
    if seeded:  # the microbatch ID travels with the batch, and the loss seeds the draws from it
        old_fetch = "        return x.to(device), x[:, :4].argmax(dim=1).to(device)"
        old_loss = "        x, y = batch\n        return nn.functional.cross_entropy(model(x), y)"
        assert old_fetch in script and old_loss in script
        script = script.replace(
            old_fetch, "        return x.to(device), x[:, :4].argmax(dim=1).to(device), int(microbatch_id)"
        )
        script = script.replace(
            old_loss,
            "        x, y, microbatch_id = batch\n        torch.manual_seed(1_000_003 + microbatch_id)\n"
            "        return nn.functional.cross_entropy(model(x), y)",
        )
    return script


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "seeded-per-microbatch"])
def test_a_step_that_depends_on_the_global_rng_is_never_judged(tmp_path, seeded):
    ranks = _launch(tmp_path, _with_dropout(seeded))
    assert [r.returncode for r in ranks] == [0] * WORLD, [r.stderr for r in ranks]
    # said while training, once, on rank 0 (recorder/rng_watch.py): not left to the analysis
    said = ["drew from the global RNG without seeding it" in r.stderr for r in ranks]
    assert said == ([False] * WORLD if seeded else [True] + [False] * (WORLD - 1)), [r.stderr for r in ranks]
    # the job's recipe module, and this tree's sdc_forensics before any installed one
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    certified = run_installed(["certify", "runs/job42/trace", "--json"], tmp_path, cwd=tmp_path, env=env)
    doc = json.loads(certified.stdout)
    statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
    if seeded:
        assert certified.returncode == 0, certified.stderr
        assert set(statuses.values()) == {"clean"} and doc["resume_step"] == 20
        return
    # nothing wrong found and only checkpoint 0 is certain: inconclusive, so exit 4, not 0 (issue 33: `certify && resume`
    # would have thrown the run away), and the last line says so
    assert certified.returncode == 4 and doc["verdict"] == "inconclusive" and doc["exit_code"] == 4, certified.stderr
    assert (
        statuses[0] == "clean" and {statuses[s] for s in (5, 10, 15, 20)} == {"unverified"} and doc["resume_step"] == 0
    )
    assert "no resume point named (exit 4)" in " ".join(certified.stderr.split())
    assert "draws from the global RNG" in certified.stderr and "seed them in the recipe" in certified.stderr
    bisected = run_installed(["bisect", "runs/job42/trace", "--json"], tmp_path, cwd=tmp_path, env=env)
    found = json.loads(bisected.stdout)
    assert found["verdict"] != "corruption" and found["suspects"] == []  # no healthy rank blamed
    # the follower is certify too: replaying every interval judged nothing, so it must not exit 0 either
    followed = run_installed(
        [
            "certify",
            "runs/job42/trace",
            "--follow",
            "--json",
            "--ledger",
            str(tmp_path / "ledger.jsonl"),
            "--idle-timeout",
            "1",
            "--poll",
            "0.2",
        ],
        tmp_path,
        cwd=tmp_path,
        env={**env, "SDC_FORENSICS_NO_LEDGER": ""},
    )  # its own ledger file, the others' untouched
    doc = json.loads(followed.stdout)
    assert followed.returncode == 4 and doc["follow"]["exit_code"] == 4 and doc["exit_code"] == 4, followed.stderr
    assert doc["follow"]["stopped_by"] == "idle" and doc["resume_step"] == 0
