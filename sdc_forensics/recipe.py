"""The recipe protocol: how sdc-forensics rebuilds a training job to replay its steps.

A recipe is an object with the methods of :class:`Recipe`, referenced as ``module:attribute``
(the attribute is a recipe instance, or a class / zero-argument factory returning one). The
recorder writes the reference into the trace manifest, so ``bisect`` finds it without flags;
``--recipe`` overrides it. A complete example is ``sdc_forensics/demo/recipe.py`` and
``docs/recipes.md`` walks through writing one.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sdc_forensics.errors import RecipeError

_REQUIRED = ("build", "load_checkpoint", "fetch_microbatch", "loss")


@runtime_checkable
class Recipe(Protocol):
    """What replay needs to know about a training job.

    Semantics (must match the training loop exactly, or replay reports false mismatches):

    * ``build(device)`` returns ``(model, optimizer, scheduler_or_None)``, freshly initialised,
      on ``device``; ``model`` is the bare module (no DDP wrapper).
    * ``load_checkpoint(path, model, optimizer, scheduler)`` loads checkpoint ``path`` in place,
      read-only, without executing pickles (``torch.load(..., weights_only=True)``).
    * ``fetch_microbatch(microbatch_id, device)`` returns the microbatch with that ID, the same
      bytes the training job consumed.
    * ``loss(model, microbatch)`` returns the scalar whose ``backward()`` the training job called
      for that microbatch (already divided by the accumulation count, if the job does so).
    * ``before_step(model, optimizer)`` (optional) runs between the all-reduce and
      ``optimizer.step()``: gradient clipping, unscaling. Default: nothing.
    * ``after_step(model, optimizer, scheduler)`` (optional) runs after ``optimizer.step()``:
      ``scheduler.step()``. Default: ``scheduler.step()`` when a scheduler exists.
    """

    def build(self, device: Any) -> tuple[Any, Any, Any]: ...

    def load_checkpoint(self, path: str, model: Any, optimizer: Any, scheduler: Any) -> None: ...

    def fetch_microbatch(self, microbatch_id: int, device: Any) -> Any: ...

    def loss(self, model: Any, microbatch: Any) -> Any: ...


def recipe_reference(obj: Any) -> str:
    """``module:attribute`` of a recipe object defined at module level (or its class)."""
    target = obj if isinstance(obj, type) else type(obj)
    return f"{target.__module__}:{target.__qualname__}"


def load_recipe(reference: str, search_path: str | Path | None = None) -> Recipe:
    """Import ``module:attribute`` and return a recipe instance.

    Args:
        reference: ``package.module:attribute``.
        search_path: a directory to put on ``sys.path`` first (the job's source tree).

    Raises:
        RecipeError: the reference is malformed, the import fails, or the object lacks methods.
    """
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise RecipeError(f"recipe reference {reference!r} is not of the form module:attribute (e.g. mytrain.recipe:Recipe)")
    if search_path is not None and str(search_path) not in sys.path:
        sys.path.insert(0, str(search_path))
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's recipe
        raise RecipeError(f"cannot import recipe module {module_name!r} ({exc}); put it on PYTHONPATH or pass --recipe") from None
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise RecipeError(f"recipe module {module_name!r} has no attribute {attribute!r}")
    if isinstance(obj, type) or (callable(obj) and not all(hasattr(obj, m) for m in _REQUIRED)):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001
            raise RecipeError(f"recipe factory {reference} failed: {exc}") from None
    missing = [m for m in _REQUIRED if not callable(getattr(obj, m, None))]
    if missing:
        raise RecipeError(f"recipe {reference} lacks {', '.join(missing)}; see docs/recipes.md for the protocol")
    return obj


def before_step(recipe: Any, model: Any, optimizer: Any) -> None:
    """Run the recipe's optional ``before_step`` hook."""
    hook = getattr(recipe, "before_step", None)
    if hook is not None:
        hook(model, optimizer)


def after_step(recipe: Any, model: Any, optimizer: Any, scheduler: Any) -> None:
    """Run the recipe's optional ``after_step`` hook, else step the scheduler."""
    hook = getattr(recipe, "after_step", None)
    if hook is not None:
        hook(model, optimizer, scheduler)
    elif scheduler is not None:
        scheduler.step()
