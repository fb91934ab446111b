"""The ordered reduction's arithmetic: one definition for the recorder's comm hook and the replay.

Element ``i`` of the reduced gradient, on every rank, with ``x_r`` rank ``r``'s local bucket (its
microbatches' gradients summed) and ``W`` ranks::

    acc = x_0[i] * s                # s = 1/W rounded to the accumulation dtype
    acc = acc + x_1[i] * s          # ranks strictly left to right, one rounding per operation
    ...
    acc = acc + x_{W-1}[i] * s
    result[i] = acc                 # cast back once (round to nearest even) for float16/bfloat16

The accumulation dtype is float32 for float16/bfloat16 buckets and the bucket's own dtype
otherwise. Elementwise IEEE multiplications and additions, each a separate operation (no fused
multiply-add), give the same bits on any CPU or GPU, which is what makes a replay of a GPU job
exact without knowing its collective library (docs/bisect.md, "A reduction any replay
reproduces"). For float32 and float64 this is the order DDP's own scaling (``x * (1/W)`` on each
rank) followed by a left-to-right sum gives, the replay's ``sequential`` order.

``ordered_sum`` is the same without the scaling (a comm hook that scales first and then asks
for ``SUM``, as DDP's default does, gets the same bits as ``ordered_mean``).
"""

from __future__ import annotations

import torch

#: The reduction mechanisms a trace can record (``Attempt.determinism["reduction"]``): the
#: collective library's own order, or the ordered reduction.
NATIVE, ORDERED = "native", "ordered"
REDUCTIONS = (NATIVE, ORDERED)
_LOW_PRECISION = (torch.float16, torch.bfloat16)

#: torch's compressing DDP comm hooks (``ddp_comm_hooks.default_hooks``, by function name) and the
#: dtype their all-reduce adds in: the recorder derives the all-reduce tolerance from it, and the
#: replay reproduces the hook (cast, divide by ``W`` in that dtype, sum in it, cast back). The
#: ``*_wrapper_hook`` variants wrap another hook, whose sum the replay cannot know: tolerance only.
COMPRESSING_HOOKS = {
    "fp16_compress_hook": "float16",
    "fp16_compress_wrapper_hook": "float16",
    "bf16_compress_hook": "bfloat16",
    "bf16_compress_wrapper_hook": "bfloat16",
}
#: The compressing hooks whose whole arithmetic is known (``_compress_hook``): the replay reproduces them.
REPRODUCIBLE_COMPRESSION = {"fp16_compress_hook": torch.float16, "bf16_compress_hook": torch.bfloat16}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float16/bfloat16, else ``dtype``."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def ordered_mean(parts, out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_r parts[r] * (1/W)``, left to right in rank order (the module's definition).

    Args:
        parts: ``W`` tensors of one shape and dtype, rank ``r``'s contribution first... last.
        out: where to write the result (shape and dtype of the parts); None allocates.
    """
    return _ordered(list(parts), scaled=True, out=out)


def ordered_sum(parts, out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_r parts[r]``, left to right in rank order, in the accumulation dtype."""
    return _ordered(list(parts), scaled=False, out=out)


def _ordered(parts: list[torch.Tensor], *, scaled: bool, out: torch.Tensor | None) -> torch.Tensor:
    dtype = parts[0].dtype
    acc_dtype = accumulation_dtype(dtype)
    scale = torch.tensor(1.0 / len(parts), dtype=acc_dtype).item() if scaled else None
    acc = parts[0].to(acc_dtype, copy=True)
    if scaled:
        acc.mul_(scale)
    for part in parts[1:]:
        term = part.to(acc_dtype)
        acc.add_(torch.mul(term, scale) if scaled else term)
    if out is not None:
        return out.copy_(acc)
    return acc if acc_dtype == dtype else acc.to(dtype)
