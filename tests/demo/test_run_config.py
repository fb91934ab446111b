"""DemoConfig's recipe and per-rank thread counts: validation, and the default ground truth unchanged."""

from __future__ import annotations

import pytest

from sdc_forensics.demo.run import RECIPE_REFERENCE, DemoConfig, DemoResult
from sdc_forensics.errors import RecipeError, UsageError
from sdc_forensics.inject import FaultSpec


def _result(config: DemoConfig) -> DemoResult:
    return DemoResult(
        config=config,
        fired=(),
        alarms=(),
        raised=None,
        checkpoints=(0,),
        final_weights_digests=(),
        killed_rank=None,
        wall_s=1.0,
    )


def test_default_run_document_is_unchanged(tmp_path):
    config = DemoConfig(out_dir=tmp_path)
    assert config.recipe == RECIPE_REFERENCE == "sdc_forensics.demo.recipe:recipe"
    assert [config.threads_of(r) for r in range(4)] == [1, 1, 1, 1]
    doc = _result(config).to_json()
    assert doc["recipe"] == RECIPE_REFERENCE and "threads" not in doc


def test_recipe_and_threads_are_recorded(tmp_path):
    config = DemoConfig(out_dir=tmp_path, recipe="sdc_forensics.demo.convnet:recipe", threads=[1, 2, 1, 2])
    assert config.threads == (1, 2, 1, 2) and config.threads_of(1) == 2
    doc = _result(config).to_json()
    assert (doc["recipe"], doc["threads"]) == ("sdc_forensics.demo.convnet:recipe", [1, 2, 1, 2])


@pytest.mark.parametrize("threads", [(1, 2), (1, 1, 0, 1)])
def test_bad_thread_counts_are_usage_errors(tmp_path, threads):
    with pytest.raises(UsageError, match="threads must give a count >= 1 for each of the 4 ranks"):
        DemoConfig(out_dir=tmp_path, threads=threads)


def test_recipe_problems_are_reported_before_anything_runs(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match="cannot import recipe module"):
        DemoConfig(out_dir=tmp_path, recipe="no_such_module_xyz:recipe")
    (tmp_path / "noids_recipe.py").write_text(
        "from sdc_forensics.demo.recipe import DemoRecipe\n"
        "class NoIds:\n"
        "    _r = DemoRecipe()\n"
        "    build, load_checkpoint, fetch_microbatch, loss = _r.build, _r.load_checkpoint, _r.fetch_microbatch, _r.loss\n"
        "recipe = NoIds()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match="no microbatch_ids"):
        DemoConfig(out_dir=tmp_path / "out", recipe="noids_recipe:recipe")


def test_recipe_args_are_checked_and_size_the_injection_checks(tmp_path):
    """Job settings change the model the demo trains, and the ranges its faults are checked against."""
    wide = DemoConfig(
        out_dir=tmp_path / "a",
        recipe="sdc_forensics.demo.recipe:DemoRecipe",
        recipe_args={"hidden": 8},
        injections=(FaultSpec(location="grad", step=3, rank=1, bit=30, element=64 * 8 + 8 + 8 * 8 + 8 + 8 * 10 + 9),),
    )
    assert wide.recipe_args == {"hidden": 8}  # the last element of a 64-8-8-10 MLP's gradient exists
    with pytest.raises(UsageError, match=r"beyond rank 1's local gradient \(682 elements: use element=0..681\)"):
        DemoConfig(
            out_dir=tmp_path / "b",
            recipe="sdc_forensics.demo.recipe:DemoRecipe",
            recipe_args={"hidden": 8},
            injections=(FaultSpec(location="grad", step=3, rank=1, bit=30, element=682),),
        )
    with pytest.raises(UsageError, match="does not come back unchanged from JSON"):
        DemoConfig(out_dir=tmp_path / "c", recipe="sdc_forensics.demo.recipe:DemoRecipe", recipe_args={"hidden": (8,)})
    assert not any(tmp_path.iterdir())  # nothing written by a configuration


def test_an_unknown_device_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="device must be cpu or cuda, got 'gpu'"):
        DemoConfig(out_dir=tmp_path, device="gpu")
