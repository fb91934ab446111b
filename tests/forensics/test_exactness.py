"""Exactness is shown at every step or not claimed (issue 33).

Clean demo runs replayed with a recipe that rebuilds the update wrong (a hand-set learning rate
1 % off, or clipping forgotten: ``tests/forensics/wrong_recipes.py``): every local and reduced
gradient still reproduces bit for bit, but the weights after each window's update do not. No
checkpoint after 0 may be certified, nothing may say "bit for bit", and the answer names the
update and the recipe; with the right recipe the same runs certify every checkpoint.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.decide.decision import Status, Verdict
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.replay.options import BisectOptions
from tests.forensics import wrong_recipes

pytestmark = pytest.mark.slow

STEPS = 6
MLP = "sdc_forensics.demo.recipe:recipe"
CONVNET = "sdc_forensics.demo.convnet:recipe"
JOBS = {  # the job trained, its settings, and the recipe that rebuilds its update wrong
    "lr_off": (MLP, None, "tests.forensics.wrong_recipes:lr_off"),
    "no_clip": (CONVNET, {"clip_norm": wrong_recipes.CLIP_NORM}, "tests.forensics.wrong_recipes:no_clip"),
}


def _run(demo_run, job: str, every: int):
    trained, args, _ = JOBS[job]
    return demo_run((), steps=STEPS, checkpoint_every=every, world_size=2, recipe=trained, recipe_args=args)


@pytest.mark.parametrize("every", [1, 5])
@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_recipe_that_rebuilds_the_update_wrong_certifies_nothing_after_checkpoint_0(demo_run, job, every):
    out = _run(demo_run, job, every)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", recipe=JOBS[job][2]))
    assert result.verdict is Verdict.INCONCLUSIVE and result.suspects == () and result.first_divergent_step is None
    statuses = {c.step: c.status for c in result.checkpoints}
    assert statuses[0] is Status.CLEAN
    assert all(s is Status.UNVERIFIED for n, s in statuses.items() if n > 0), statuses
    # every window's first step: the gradients reproduced, its update did not
    windows = sorted(n for n in statuses if n < STEPS)
    off = sorted(e.step for e in result.evidence if e.location.value == "optimizer_update" and not e.ranks)
    assert off == windows
    assert any(
        "update" in line and "recipe" in line and "learning rate" in line and "clipping" in line
        for line in result.settle
    )
    for c in result.checkpoints:
        if c.step > 0:
            assert not any("bit for bit" in r for r in c.reasons) and any("update" in r for r in c.reasons), c.reasons


@pytest.mark.parametrize("job", sorted(JOBS))
def test_the_answer_on_the_command_line_names_the_update_and_the_recipe(demo_run, job):
    out = _run(demo_run, job, 1)
    done = CliRunner().invoke(cli, ["bisect", str(out / "trace"), "--recipe", JOBS[job][2]])
    assert done.exit_code == 4, done.output  # inconclusive: no verdict on any rank
    text = " ".join(done.output.split())
    assert (
        "bit for bit" not in text
    )  # no step is said to be exact, no checkpoint clean but 0 (which has no step before it)
    assert "does not reproduce the update" in text and "recipe" in text
    assert "CORRUPTION" not in text
    # the update rows name the recipe as the suspect, not "strong" evidence (of corruption)
    rows = [line for line in done.output.splitlines() if "replay_mismatch" in line and "optimizer_update" in line]
    assert rows and all("recipe?" in row and "strong" not in row for row in rows), done.output
    # certify's rule: no resume point without a verdict (bisect named checkpoint 0 "Resume from")
    assert "Resume from: no point named: the analysis is inconclusive" in text


@pytest.mark.parametrize("every", [1, 5])
@pytest.mark.parametrize("job", sorted(JOBS))
def test_the_right_recipe_still_certifies_every_checkpoint(demo_run, job, every):
    out = _run(demo_run, job, every)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    assert result.verdict is Verdict.CLEAN, result.settle
    assert all(c.status is Status.CLEAN for c in result.checkpoints), [(c.step, c.reasons) for c in result.checkpoints]
    assert not any(e.location.value == "optimizer_update" for e in result.evidence)


def test_a_sharded_job_replayed_with_a_wrong_learning_rate_certifies_nothing_after_checkpoint_0(tmp_path):
    """The FSDP2 demo (4 gloo ranks, 4 steps, DCP checkpoints 0 and 2): the replay compares each rank's
    shard of the weights after the update (``replay.compare._expected_weights``); with the learning rate
    1 % off every shard differs: the same answer as DDP's. The right recipe certifies every checkpoint."""
    from sdc_forensics.demo import sharded

    sharded.run_demo(tmp_path, "fsdp", (), steps=4, checkpoint_every=2)
    options = dict(checkpoints_dir=tmp_path / "checkpoints")
    wrong = bisect(tmp_path / "trace", BisectOptions(recipe="tests.forensics.wrong_recipes:sharded_lr_off", **options))
    assert wrong.verdict is Verdict.INCONCLUSIVE and wrong.suspects == () and wrong.first_divergent_step is None
    assert {c.step: c.status for c in wrong.checkpoints} == {0: Status.CLEAN, 2: Status.UNVERIFIED}
    assert any("does not reproduce the update" in line for line in wrong.settle)
    right = bisect(tmp_path / "trace", BisectOptions(**options))
    assert right.verdict is Verdict.CLEAN and all(c.status is Status.CLEAN for c in right.checkpoints)


def test_a_learning_rate_set_by_hand_from_the_step_is_reproduced_when_the_recipe_takes_the_step(demo_run):
    """nanoGPT's ``param_group["lr"] = get_lr(it)``: a ``before_step`` that declares ``step`` is handed the
    optimizer step (``sdc_forensics.recipe``), so every checkpoint certifies; a recipe that counts steps
    itself from each window's start gets the window from checkpoint 0 right and sets step 0's rate at
    step 2, the first step of the window from checkpoint 2: checkpoint 4 is not certified."""
    out = demo_run((), steps=4, checkpoint_every=2, world_size=2, recipe="tests.forensics.wrong_recipes:hand_set_lr")
    options = dict(checkpoints_dir=out / "checkpoints")
    right = bisect(out / "trace", BisectOptions(**options))
    assert right.verdict is Verdict.CLEAN and all(c.status is Status.CLEAN for c in right.checkpoints), right.settle
    wrong = bisect(out / "trace", BisectOptions(recipe="tests.forensics.wrong_recipes:own_counter", **options))
    assert {c.step: c.status for c in wrong.checkpoints} == {0: Status.CLEAN, 2: Status.CLEAN, 4: Status.UNVERIFIED}
    assert wrong.verdict is Verdict.INCONCLUSIVE and wrong.suspects == ()
    assert sorted(e.step for e in wrong.evidence if e.location.value == "optimizer_update") == [2]


@pytest.mark.ledger  # the conftest turns the ledger off for the rest
def test_the_ledger_of_the_right_recipe_certifies_nothing_for_a_wrong_one(demo_run, tmp_path):
    """A new user certified a run with the right recipe, then with one whose learning rate was 1 % off:
    every step came from the ledger the first certify wrote, and the wrong recipe was certified."""
    import shutil

    out = _run(demo_run, "lr_off", 1)
    trace = shutil.copytree(out / "trace", tmp_path / "trace", ignore=shutil.ignore_patterns("ledger.jsonl"))
    checkpoints = ["--checkpoints", str(out / "checkpoints")]
    right = CliRunner().invoke(cli, ["certify", str(trace), *checkpoints])
    assert right.exit_code == 0, right.output
    wrong = CliRunner().invoke(cli, ["certify", str(trace), *checkpoints, "--recipe", JOBS["lr_off"][2]])
    assert wrong.exit_code == 4, wrong.output
    text = " ".join(wrong.output.split())
    assert f"was made with recipe {MLP}: not reused" in text and "does not reproduce the update" in text
    again = CliRunner().invoke(cli, ["certify", str(trace), *checkpoints])
    assert again.exit_code == 0, again.output
    assert "the ledger holds their exact clean replay" in again.output  # the right recipe's records still serve it


def test_a_recipe_edited_in_place_is_another_recipe_to_the_ledger(tmp_path, monkeypatch):
    from sdc_forensics.recipe import recipe_identity

    (tmp_path / "my_job_recipe.py").write_text("LR = 0.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = recipe_identity("my_job_recipe:Recipe", {"width": 8})
    assert before["source_sha256"] and before == recipe_identity("my_job_recipe:Recipe", {"width": 8})
    assert before != recipe_identity("my_job_recipe:Recipe", {"width": 16})
    (tmp_path / "my_job_recipe.py").write_text("LR = 0.101\n")
    assert recipe_identity("my_job_recipe:Recipe", {"width": 8})["source_sha256"] != before["source_sha256"]


def test_replay_with_a_wrong_recipe_says_inconclusive_not_diverges(demo_run):
    """``replay`` printed "diverges at step 0" (red) and exited 4 for an update no rank reproduces."""
    out = _run(demo_run, "lr_off", 1)
    done = CliRunner().invoke(
        cli, ["replay", str(out / "trace"), "--from", "0", "--to", "0", "--recipe", JOBS["lr_off"][2]]
    )
    assert done.exit_code == 4, done.output
    assert "does not reproduce step 0, inconclusive" in done.output and "diverges" not in done.output
