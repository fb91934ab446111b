"""The recipe protocol: how sdc-forensics rebuilds a training job to replay its steps.

A recipe is an object with the methods of :class:`Recipe`, referenced as ``module:attribute``
(the attribute is a recipe instance, or a class / factory returning one). The recorder writes
the reference into the trace manifest, so ``bisect`` finds it without flags; ``--recipe``
overrides it. A complete example is ``sdc_forensics/demo/recipe.py`` and ``docs/recipes.md``
walks through writing one.

**Job settings** (``Recorder(..., recipe_args={"width": 256, "seed": 3})``): a JSON object the
recorder validates and writes into the manifest, and that replay hands back to the recipe as
keyword arguments: the attribute is called with them (a class or a factory function), or, when
it is a dataclass instance, a copy with those fields replaced is used. Without ``recipe_args``
(older traces) the attribute is used as before: an instance as is, a class or factory called
with no arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sdc_forensics.errors import RecipeError

_REQUIRED = ("build", "load_checkpoint", "fetch_microbatch", "loss")
#: Largest ``recipe_args`` accepted, as compact JSON (they live in the manifest, read as hostile input).
MAX_RECIPE_ARGS_BYTES = 64 * 1024


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
      ``optimizer.step()``: gradient clipping, unscaling, a learning rate set by hand. Default: nothing.
    * ``after_step(model, optimizer, scheduler)`` (optional) runs after ``optimizer.step()``:
      ``scheduler.step()``. Default: ``scheduler.step()`` when a scheduler exists.
    * ``train_context()`` (optional) returns the context manager each microbatch's ``loss`` and
      its ``backward()`` run inside: torch's ``loss_parallel()`` where the job computes the cross
      entropy of vocabulary-sharded logits (torchtitan's default). Default: none.
    * Either hook that declares a ``step`` parameter (``before_step(self, model, optimizer, step)``)
      is handed the optimizer step it belongs to (step ``s`` reads theta_s): what a loop that sets
      ``param_group["lr"] = get_lr(it)`` by hand needs to set the same rate in replay.
    """

    def build(self, device: Any) -> tuple[Any, Any, Any]: ...

    def load_checkpoint(self, path: str, model: Any, optimizer: Any, scheduler: Any) -> None: ...

    def fetch_microbatch(self, microbatch_id: int, device: Any) -> Any: ...

    def loss(self, model: Any, microbatch: Any) -> Any: ...


def recipe_reference(obj: Any) -> str:
    """``module:attribute`` of a recipe object defined at module level (or its class)."""
    target = obj if isinstance(obj, type) else type(obj)
    return f"{target.__module__}:{target.__qualname__}"


def check_recipe_args(args: Any) -> dict[str, Any]:
    """Validate job settings for the recipe; returns them as a plain dict.

    They must be a dict with identifier keys (they become keyword arguments) whose values come
    back unchanged from JSON (dict, list, str, int, float, bool, None: a tuple would come back
    a list, a NaN not at all), at most :data:`MAX_RECIPE_ARGS_BYTES` encoded.

    Raises:
        UsageError: what is wrong, naming the key.
    """
    from sdc_forensics.errors import UsageError

    if not isinstance(args, dict):
        raise UsageError(f"recipe_args must be a dict of keyword arguments for the recipe, got {type(args).__name__}")
    for key, value in args.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise UsageError(
                f"recipe_args key {key!r} is not a Python identifier: the recipe receives recipe_args as keyword arguments"
            )
        try:
            same = json.loads(json.dumps(value, allow_nan=False)) == value and _json_types(value)
        except (TypeError, ValueError, RecursionError):
            same = False
        if not same:
            raise UsageError(
                f"recipe_args[{key!r}] = {value!r:.80} does not come back unchanged from JSON, which is how the manifest "
                "stores it: use dict, list, str, int, float (finite), bool or None (a list, not a tuple)"
            )
    size = len(json.dumps(args, separators=(",", ":")))
    if size > MAX_RECIPE_ARGS_BYTES:
        raise UsageError(
            f"recipe_args take {size} bytes as JSON, more than {MAX_RECIPE_ARGS_BYTES}: pass settings, not data "
            "(a path to a config file, for example)"
        )
    return dict(args)


def _json_types(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_types(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_types(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))


def import_reference(reference: str, what: str = "recipe", subclass_of: type | None = None) -> Any:
    """The object ``module:attribute`` names (``attribute`` may be dotted).

    References come from the trace's manifest, read as hostile: one into Python's standard library
    (``os:system``, ``shutil:rmtree``, ``builtins:exec``) is refused before anything is imported,
    since no job's recipe, model, optimizer, dataset or collator lives there and calling it could
    do anything; with ``subclass_of`` the object must be a class derived from it.

    Raises:
        RecipeError: the reference is malformed or into the standard library, the import fails, the
            attribute is missing, or it is not a ``subclass_of`` class.
    """
    module_name, sep, attribute = str(reference).partition(":")
    if not sep or not module_name or not attribute:
        raise RecipeError(
            f"{what} reference {reference!r} is not of the form module:attribute (e.g. mytrain.recipe:Recipe)"
        )
    if _in_stdlib(module_name):
        raise RecipeError(
            f"{what} reference {reference!r} names Python's standard library, where no job's {what} lives: refused, "
            "not imported (a crafted trace could run it); pass the job's own with --recipe"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module
        raise RecipeError(
            f"cannot import {what} module {module_name!r} ({exc}); put its folder on PYTHONPATH"
            + (", or name another with --recipe" if what == "recipe" else "")
        ) from None
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise RecipeError(f"{what} module {module_name!r} has no attribute {attribute!r}")
    if subclass_of is not None and not (isinstance(obj, type) and issubclass(obj, subclass_of)):
        raise RecipeError(
            f"{what} reference {reference!r} is not a {subclass_of.__module__}.{subclass_of.__qualname__} class: refused, "
            "not called"
        )
    return obj


#: Top-level names of Python's standard library.
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"builtins"}


def _in_stdlib(module_name: str) -> bool:
    """True when ``module_name``'s top-level package is the standard library's as this interpreter finds it
    (a job's own ``test.py`` or ``code.py`` found first on the path is not)."""
    top = module_name.partition(".")[0]
    if top not in _STDLIB:
        return False
    try:
        spec = importlib.util.find_spec(top)
    except Exception:  # noqa: BLE001 - not findable: the import says why
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    places = [spec.origin or "", *(spec.submodule_search_locations or ())]
    roots = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    for place in places:
        if not place or place in ("built-in", "frozen"):
            continue
        found = Path(place).resolve()
        if {"site-packages", "dist-packages"} & set(found.parts):
            continue
        if any(found.is_relative_to(root) for root in roots):
            return True
    return False


#: Libraries whose functions are never a job's recipe factory (their classes are not recipes either).
_LIBRARIES = frozenset(
    {
        "torch",
        "numpy",
        "safetensors",
        "click",
        "rich",
        "pytest",
        "transformers",
        "accelerate",
        "lightning",
        "pytorch_lightning",
        "deepspeed",
        "megatron",
        "torchtitan",
        "pip",
        "setuptools",
        "sdc_forensics",
    }
)


def recipe_identity(reference: str, args: dict[str, Any] | None = None) -> dict[str, str]:
    """What a ledger record keeps of the recipe its replay ran (``forensics/ledger_use.py``): the
    ``module:attribute`` reference, the job settings it was given, and the SHA-256 of its module's
    source file ("" when the module cannot be found without running it). A record made with
    another recipe, or with this one before its file was edited, certifies nothing for this one.
    """
    module_name = str(reference).partition(":")[0]
    digest = ""
    with contextlib.suppress(Exception):  # a module that cannot be found: the reference alone
        spec = importlib.util.find_spec(module_name)
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            digest = hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()
    shown = json.dumps(args or {}, sort_keys=True, default=str)
    return {"reference": str(reference), "args": shown, "source_sha256": digest}


def load_recipe(reference: str, search_path: str | Path | None = None, *, args: dict[str, Any] | None = None) -> Recipe:
    """Import ``module:attribute`` and return a recipe instance.

    Args:
        reference: ``package.module:attribute``.
        search_path: a directory to put on ``sys.path`` first (the job's source tree).
        args: job settings recorded with the trace (``Recorder(recipe_args=...)``): the attribute
            (a class or factory) is called with them as keyword arguments, or, a dataclass
            instance, copied with those fields replaced. None: the attribute as it is (an
            instance), or called with no arguments (a class or factory).

    Raises:
        RecipeError: the reference is malformed, the import fails, the recipe does not accept
            ``args``, or the object lacks methods.
    """
    if search_path is not None and str(search_path) not in sys.path:
        sys.path.insert(0, str(search_path))
    obj = import_reference(reference)
    is_instance = not isinstance(obj, type) and all(hasattr(obj, m) for m in _REQUIRED)
    shown = ", ".join(f"{k}={v!r}" for k, v in (args or {}).items())
    _check_callable_recipe(reference, obj, is_instance)
    if args is not None and is_instance:
        if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
            raise RecipeError(
                f"recipe {reference} is an instance, so it cannot take the job's recipe_args ({shown:.200}): reference "
                "its class or a factory function that accepts them (docs/recipes.md)"
            )
        try:
            obj = dataclasses.replace(obj, **args)
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"recipe {reference} does not take the job's recipe_args ({shown:.200}): {exc}") from None
    elif not is_instance and callable(obj):
        try:
            obj = obj(**(args or {}))
        except Exception as exc:  # noqa: BLE001
            raise RecipeError(f"recipe factory {reference}({shown:.200}) failed: {exc}") from None
    missing = [m for m in _REQUIRED if not callable(getattr(obj, m, None))]
    if missing:
        raise RecipeError(f"recipe {reference} lacks {', '.join(missing)}; see docs/recipes.md for the protocol")
    return obj


def _check_callable_recipe(reference: str, obj: Any, is_instance: bool) -> None:
    """Before a recipe named by a trace is called: a class must have the protocol's methods, and a factory
    must be a Python function of the job's own code (not a builtin, nor a library's function: ``os:system``
    with the manifest's ``recipe_args`` ran a shell command before the protocol was checked).

    Raises:
        RecipeError: one line naming what the reference is and why it is not called.
    """
    if is_instance:
        return
    if isinstance(obj, type):
        missing = [m for m in _REQUIRED if not callable(getattr(obj, m, None))]
        if missing:
            raise RecipeError(
                f"recipe class {reference} lacks {', '.join(missing)}: not instantiated; see docs/recipes.md for the protocol"
            )
        return
    if not inspect.isfunction(obj):
        raise RecipeError(
            f"recipe {reference} is neither a recipe, a recipe class nor a Python factory function "
            f"({type(obj).__name__}): not called; see docs/recipes.md"
        )
    if str(getattr(obj, "__module__", "")).partition(".")[0] in _LIBRARIES:
        raise RecipeError(
            f"recipe {reference} is a function of the library {obj.__module__}, not a job's recipe factory: not called; "
            "pass the job's own with --recipe"
        )


def load_trace_recipe(manifest: Any, override: str | None = None) -> Recipe:
    """The recipe that rebuilds a recorded job: ``override`` (``--recipe``) or the manifest's
    reference, given the job settings the manifest recorded (``recipe_args``).

    Args:
        manifest: the trace's :class:`~sdc_forensics.trace.manifest.Manifest`.
        override: ``module:attribute`` replacing the recorded reference (same settings).

    Raises:
        RecipeError: no recipe named, or :func:`load_recipe` fails.
    """
    reference = override or manifest.recipe
    if not reference:
        raise RecipeError("the trace names no replay recipe: pass --recipe MODULE:ATTR (docs/recipes.md)")
    return load_recipe(reference, args=manifest.recipe_args)


def loss_and_backward(recipe: Any, model: Any, microbatch: Any) -> Any:
    """One microbatch as the job ran it: the recipe's ``loss``, then its ``backward()``, both inside
    the recipe's optional ``train_context()`` (torch's ``loss_parallel()`` for a job whose logits stay
    vocabulary-sharded: its backward must run inside it too). Returns the loss."""
    import contextlib

    hook = getattr(recipe, "train_context", None)
    with hook() if hook is not None else contextlib.nullcontext():
        loss = recipe.loss(model, microbatch)
        loss.backward()
    return loss


def before_step(recipe: Any, model: Any, optimizer: Any, step: int | None = None) -> None:
    """Run the recipe's optional ``before_step`` hook (handed ``step`` when it declares that parameter)."""
    hook = getattr(recipe, "before_step", None)
    if hook is not None:
        hook(model, optimizer, **_step_argument(hook, step))


def after_step(recipe: Any, model: Any, optimizer: Any, scheduler: Any, step: int | None = None) -> None:
    """Run the recipe's optional ``after_step`` hook (handed ``step`` when it declares that parameter),
    else step the scheduler."""
    hook = getattr(recipe, "after_step", None)
    if hook is not None:
        hook(model, optimizer, scheduler, **_step_argument(hook, step))
    elif scheduler is not None:
        scheduler.step()


def _step_argument(hook: Any, step: int | None) -> dict[str, int]:
    """``{"step": step}`` when ``hook`` declares a ``step`` parameter, else nothing (hooks written
    before the step was handed keep working)."""
    import inspect

    if step is None:
        return {}
    try:
        params = inspect.signature(hook).parameters
    # a builtin or C callable without a signature: the plain call
    except (TypeError, ValueError):
        return {}
    return {"step": int(step)} if "step" in params else {}
