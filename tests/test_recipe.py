"""Recipes with job settings (``recipe_args``): validation, how each kind of attribute takes them,
the manifest field (optional, old manifests unchanged), and old references still working."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from sdc_forensics.demo.recipe import DemoRecipe, recipe as demo_recipe
from sdc_forensics.errors import RecipeError, TraceError, UsageError
from sdc_forensics.recipe import check_recipe_args, load_recipe, load_trace_recipe
from sdc_forensics.trace.manifest import FingerprintSettings, Manifest, parse_manifest, read_manifest, write_manifest


def test_old_references_work_as_before():
    assert load_recipe("sdc_forensics.demo.recipe:recipe") is demo_recipe  # an instance, as is
    built = load_recipe("sdc_forensics.demo.recipe:DemoRecipe")  # a class, called with no arguments
    assert isinstance(built, DemoRecipe) and built == DemoRecipe()


def test_a_class_or_factory_is_called_with_the_args_and_a_dataclass_instance_is_copied():
    from_class = load_recipe("sdc_forensics.demo.recipe:DemoRecipe", args={"hidden": 96, "model_seed": 3})
    assert (from_class.hidden, from_class.model_seed) == (96, 3)
    assert from_class.build("cpu")[0][0].weight.shape == (96, 64)
    copied = load_recipe("sdc_forensics.demo.recipe:recipe", args={"hidden": 32})
    assert (
        copied.hidden == 32 and copied is not demo_recipe and demo_recipe.hidden == 128
    )  # the module's object is untouched
    assert load_recipe("sdc_forensics.demo.recipe:recipe", args={}) == demo_recipe


def test_args_a_recipe_does_not_take_are_a_recipe_error_naming_them():
    with pytest.raises(RecipeError, match=r"DemoRecipe\(depth=3\) failed: .*depth"):
        load_recipe("sdc_forensics.demo.recipe:DemoRecipe", args={"depth": 3})
    with pytest.raises(RecipeError, match="does not take the job's recipe_args"):
        load_recipe("sdc_forensics.demo.recipe:recipe", args={"depth": 3})


class _Plain:
    def build(self, device): ...
    def load_checkpoint(self, path, model, optimizer, scheduler): ...
    def fetch_microbatch(self, microbatch_id, device): ...
    def loss(self, model, microbatch): ...


plain = _Plain()


def test_a_plain_instance_cannot_take_args_and_says_what_to_reference():
    assert load_recipe("tests.test_recipe:plain") is plain
    with pytest.raises(
        RecipeError, match="is an instance, so it cannot take the job's recipe_args .*class or a factory"
    ):
        load_recipe("tests.test_recipe:plain", args={"width": 2})


@pytest.mark.parametrize(
    "args, message",
    [
        ([("width", 3)], "must be a dict"),
        ({"not-an-identifier": 1}, "is not a Python identifier"),
        ({1: 2}, "is not a Python identifier"),
        ({"channels": (8, 16)}, r"recipe_args\['channels'\] = \(8, 16\) does not come back unchanged from JSON"),
        ({"lr": math.nan}, "does not come back unchanged"),
        ({"path": object()}, "does not come back unchanged"),
        ({"nested": {1: "a"}}, "does not come back unchanged"),
        ({"blob": "x" * 70_000}, "more than 65536"),
    ],
)
def test_recipe_args_must_be_json_settings(args, message):
    with pytest.raises(UsageError, match=message):
        check_recipe_args(args)


def test_recipe_args_that_are_json_pass_unchanged():
    args = {"width": 256, "seed": 3, "lr": 0.1, "name": "run-7", "layers": [1, 2], "opts": {"a": None, "b": True}}
    assert check_recipe_args(args) == args


def _manifest(**kw) -> Manifest:
    return Manifest(
        format_version=1,
        world_size=2,
        fingerprint=FingerprintSettings(seed=1, sketch_k=8),
        recipe="sdc_forensics.demo.recipe:DemoRecipe",
        **kw,
    )


def test_manifest_round_trip_and_old_manifests_unchanged(tmp_path):
    write_manifest(tmp_path, _manifest())
    assert "recipe_args" not in json.loads((tmp_path / "manifest.json").read_text())  # written only when set
    assert read_manifest(tmp_path).recipe_args is None
    write_manifest(tmp_path, _manifest(recipe_args={"hidden": 48}))
    manifest = read_manifest(tmp_path)
    assert manifest.recipe_args == {"hidden": 48}
    assert load_trace_recipe(manifest).hidden == 48
    assert (
        load_trace_recipe(manifest, override="sdc_forensics.demo.recipe:recipe").hidden == 48
    )  # --recipe keeps the settings
    assert load_trace_recipe(dataclasses.replace(manifest, recipe_args=None)).hidden == 128
    with pytest.raises(RecipeError, match="names no replay recipe"):
        load_trace_recipe(dataclasses.replace(manifest, recipe=None))


@pytest.mark.parametrize(
    "value, ok",
    [
        (None, True),
        ({}, True),
        ({"a": [1, {"b": 2}]}, True),
        ([1], False),
        ("w=3", False),
        ({"not ident": 1}, False),
        (3, False),
    ],
)
def test_manifest_recipe_args_are_checked_as_hostile_input(value, ok):
    doc = _manifest().to_json()
    doc["recipe_args"] = value
    if ok:
        assert parse_manifest(doc).recipe_args == value
    else:
        with pytest.raises(TraceError, match="recipe_args"):
            parse_manifest(doc)


def test_hooks_that_declare_step_are_handed_it_and_the_others_are_called_as_before():
    from sdc_forensics.recipe import after_step, before_step

    calls = []

    class WithStep:
        def before_step(self, model, optimizer, step):
            calls.append(("before", step))

        def after_step(self, model, optimizer, scheduler, step=None):
            calls.append(("after", step))

    class Plain:
        def before_step(self, model, optimizer):
            calls.append(("before", "plain"))

    before_step(WithStep(), None, None, step=7)
    after_step(WithStep(), None, None, None, step=7)
    before_step(Plain(), None, None, step=7)
    after_step(Plain(), None, None, None, step=7)  # no hook, no scheduler: nothing
    assert calls == [("before", 7), ("after", 7), ("before", "plain")]


def make_recipe(hidden: int = 8):
    """A job's own recipe factory."""
    return _Plain()


@pytest.mark.parametrize(
    ("reference", "args", "said"),
    [
        ("os:system", {"command": "touch {marker}"}, "names Python's standard library"),  # a trial user's trace
        ("subprocess:run", {"args": ["touch", "{marker}"]}, "names Python's standard library"),
        ("builtins:exec", {"source": "open('{marker}', 'w')"}, "names Python's standard library"),
        ("torch:save", {"obj": 1, "f": "{marker}"}, "a function of the library"),
        ("torch.nn:Linear", {"in_features": 1, "out_features": 1}, "lacks build"),
    ],
)
def test_a_trace_naming_a_function_that_is_no_recipe_never_has_it_called(tmp_path, reference, args, said):
    """The manifest names the recipe and its arguments; a crafted one ran ``os.system`` with them before the
    protocol was checked (exit 3, "lacks build", the command already run)."""
    marker = tmp_path / "ran"
    args = json.loads(json.dumps(args).replace("{marker}", str(marker)))
    with pytest.raises(RecipeError, match=said):
        load_recipe(reference, args=args)
    assert not marker.exists()


def test_a_factory_of_the_jobs_own_code_is_still_called():
    assert isinstance(load_recipe("tests.test_recipe:make_recipe", args={"hidden": 4}), _Plain)


def test_references_in_the_recipe_args_must_be_the_classes_they_stand_for():
    import torch

    from sdc_forensics.integrations._common import build_optimizer

    spec = {"class": "torch.nn:Linear", "defaults": {}, "groups": []}
    with pytest.raises(RecipeError, match="not a torch.optim.optimizer.Optimizer class"):
        build_optimizer(spec, torch.nn.Linear(2, 2))


def test_a_recipe_whose_optimizer_groups_do_not_fit_the_checkpoint_is_told_to_check_its_groups(tmp_path):
    """A trial user's recipe decayed every parameter where the job kept norms and biases out:
    torch's own load_state_dict error was followed by 'check its model against the checkpoint's keys'."""
    import torch

    from sdc_forensics.replay.replayer import _recipe_call

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    job = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    recipe = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        RecipeError, match="parameter groups.* check its optimizer's parameter groups against the job's"
    ):
        _recipe_call("load_checkpoint(ckpt.pt)", recipe.load_state_dict, job.state_dict())
    with pytest.raises(RecipeError, match="check its model against the checkpoint's keys"):
        _recipe_call("load_checkpoint(ckpt.pt)", model.load_state_dict, {"nope": torch.zeros(1)})
