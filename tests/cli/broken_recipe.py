"""A recipe whose ``load_checkpoint`` fails as a real one does when its model does not fit the
checkpoint (a job that compiled a submodule saves ``_orig_mod.`` keys): the demo's recipe with
``load_state_dict`` raising torch's own ``RuntimeError``. ``tests/cli/test_recipe_failure.py``
checks that the CLI says so in one line with exit 3, never a traceback or exit 1 (corruption)."""

from __future__ import annotations

import dataclasses

from sdc_forensics.demo.recipe import DemoRecipe


@dataclasses.dataclass(kw_only=True)
class BrokenRecipe(DemoRecipe):
    def load_checkpoint(self, path, model, optimizer, scheduler) -> None:
        state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
        model.load_state_dict(state)  # torch raises: missing and unexpected keys


recipe = BrokenRecipe()
