"""Canonical flattening and digests of model and optimizer state.

The recorder digests what it saves, ``verify-checkpoint`` digests what it reads back, and
replay digests the weights it computes. The keys are :func:`flatten_state`'s and the weights
digest is always ``combine_digests`` of the parameters' digests in ``named_parameters()`` order:
these functions compute it from tensors; ``checkpoint/verify.py`` applies the same rule to the
per-tensor digests it has already measured (so nothing is digested twice).

* :func:`flatten_state` turns nested dicts/lists/tuples of tensors (a ``torch.save`` payload,
  an optimizer ``state_dict``) into ``{"a.b.0.c": tensor}`` with dotted keys.
* :func:`weights_digest` is the replica weights digest: the exact digests of the parameters in
  ``model.named_parameters()`` order, combined with ``combine_digests``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint.core import combine_digests, digests
from sdc_forensics.trace.checkpoints import hex64


def flatten_state(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside ``obj`` under a dotted key (dict keys and list indices joined by '.').

    Two paths that join to one key (``{"a.b": x, "a": {"b": y}}``) keep both tensors: the later one
    is ``a.b#2``. Before, the later overwrote the earlier, and a NaN tensor under the earlier path
    was never read (a trial user's crafted file verified)."""
    out: dict[str, torch.Tensor] = {}
    _flatten_into(out, obj, prefix)
    return out


def _flatten_into(out: dict[str, torch.Tensor], obj: Any, prefix: str) -> None:
    if isinstance(obj, torch.Tensor):
        key, n = prefix, 1
        while key in out:
            n += 1
            key = f"{prefix}#{n}"
        out[key] = obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _flatten_into(out, value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _flatten_into(out, value, f"{prefix}.{index}" if prefix else str(index))


def tensor_digests(obj: Any, seed: int = C.DEFAULT_SEED) -> list[int]:
    """Exact digests of every tensor inside ``obj`` (a microbatch), in :func:`flatten_state` order.

    A step's input digest is ``combine_digests`` of these over its microbatches, in order.
    """
    return digests(flatten_state(obj).values(), seed)


def state_digests(obj: Any, seed: int = C.DEFAULT_SEED) -> dict[str, str]:
    """``{key: hex digest}`` of every tensor in a (nested) state."""
    flat = flatten_state(obj)
    return {key: hex64(d) for key, d in zip(flat, digests(flat.values(), seed))}


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]], seed: int = C.DEFAULT_SEED) -> int:
    """Combined digest of parameters given as ``(name, tensor)`` pairs in model order."""
    return combine_digests(digests([t for _, t in named_tensors], seed))


def weights_digest_from_state(
    tensors: Mapping[str, torch.Tensor], param_names: Iterable[str], seed: int = C.DEFAULT_SEED
) -> int:
    """The replica weights digest recomputed from a checkpoint's tensors, by parameter name."""
    return combine_digests(digests([tensors[name] for name in param_names], seed))
