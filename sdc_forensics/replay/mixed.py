"""The replay of a sharded job's mixed precision (``MixedPrecisionPolicy(param_dtype=...)``).

FSDP2 casts each parameter shard to ``param_dtype`` before its all-gather, so the forward and
backward run on low-precision copies of the whole parameters; each ``fully_shard`` module casts
its floating-point forward inputs to ``param_dtype`` (``cast_forward_inputs``) in a pre-forward
hook that runs before any other, and its outputs to ``output_dtype`` after the forward. The
gradients come out in ``param_dtype``; FSDP2 casts them to ``reduce_dtype`` and reduces.

:func:`computing_as_recorded` does the same to the recipe's (unsharded) model for the length of
one rank's step: the parameters' data become ``param.to(param_dtype)`` (a cast element by element,
so equal to casting every shard and gathering them), and the recorded modules get the recorded
casts as hooks in FSDP2's order. On leaving, the parameters get their own data back and the
gradients are dropped (the caller has taken them): the optimizer updates the parameters in their
own dtype, as FSDP2's sharded optimizer does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from sdc_forensics.errors import RecipeError
from sdc_forensics.trace.mesh import ShardMesh


def _cast(dtype: torch.dtype, x: Any) -> Any:
    """FSDP2's ``_cast_fp_tensor``: floating-point tensors to ``dtype``, anything else as is."""
    if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
        return x.to(dtype)
    return x


def _apply(fn, value: Any) -> Any:
    """``fn`` on every tensor inside ``value`` (FSDP2 casts through ``torch.distributed.utils._apply_to_tensors``)."""
    try:
        from torch.distributed.utils import _apply_to_tensors
    except ImportError:  # pragma: no cover - a torch that moved it: the same walk through pytrees
        from torch.utils._pytree import tree_map

        return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, value)
    return _apply_to_tensors(fn, value)


@contextlib.contextmanager
def computing_as_recorded(model: torch.nn.Module, mesh: ShardMesh | None) -> Iterator[None]:
    """Within: ``model`` computes as the recorded ``fully_shard`` job did (see the module)."""
    if mesh is None or not (mesh.param_dtype or mesh.casts):
        yield
        return
    modules = dict(model.named_modules())
    missing = [name for name, _, _ in mesh.casts if name not in modules]
    if missing:
        raise RecipeError(
            f"the trace's job cast the forward of module {missing[0]!r} (its MixedPrecisionPolicy), which the "
            "recipe's model does not have: the recipe builds another model than the job trained"
        )
    handles = []
    for name, inputs, outputs in mesh.casts:
        module = modules[name]
        if inputs:
            cast = functools.partial(_cast, getattr(torch, inputs))
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, args, kwargs, cast=cast: (_apply(cast, args), _apply(cast, kwargs)),
                    prepend=True,
                    with_kwargs=True,
                )
            )
        if outputs:
            cast = functools.partial(_cast, getattr(torch, outputs))
            handles.append(module.register_forward_hook(lambda _m, _args, output, cast=cast: _apply(cast, output)))
    own: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    if mesh.param_dtype:
        low = getattr(torch, mesh.param_dtype)
        with torch.no_grad():
            for param in model.parameters():
                if param.is_floating_point():
                    own.append((param, param.data))
                    param.data = param.data.to(low)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for param, data in own:
            param.grad = None
            param.data = data
