"""What each fault location of a demo run indexes, checked before anything runs.

A fault spec names an element and a bit (``sdc_forensics.inject``); whether they exist depends
on the job: the gradient's and the parameters' sizes and dtypes, the inputs a rank consumes at
a step, the bytes of a checkpoint file. :func:`check_injections` builds the recipe's model in
the calling process (a few milliseconds for the demo recipes), fetches the step's microbatches
and sizes the checkpoint payload, so that ``sdc-forensics demo --inject`` refuses a bit beyond
the dtype's width or an element beyond the tensor with one line and exit 2, before a process is
started or a file written (it used to fail inside a worker, halfway through the run).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sdc_forensics.errors import UsageError
from sdc_forensics.inject import FaultSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A vector a location indexes: concatenated segments, each with its own element width.

    Attributes:
        what: the vector in words (``"rank 2's local gradient"``).
        segments: ``(numel, bits, dtype name)`` of each concatenated tensor, in index order.
        default_pool: without ``element=``, the element is chosen among the first this many
            (``input``: the first microbatch's); None: among all.
    """

    what: str
    segments: tuple[tuple[int, int, str], ...]
    # the default element is chosen among the first N (input: the first microbatch)
    default_pool: int | None = None

    @property
    def numel(self) -> int:
        return sum(n for n, _, _ in self.segments)

    def width_at(self, element: int) -> tuple[int, str]:
        """``(bits, dtype)`` of element ``element``."""
        start = 0
        for numel, bits, dtype in self.segments:
            if element < start + numel:
                return bits, dtype
            start += numel
        raise IndexError(element)


def check_spec(spec: FaultSpec, target: Target) -> None:
    """Raise :class:`UsageError` (one line: the spec and the valid range) unless ``spec`` fits ``target``."""
    numel = target.numel
    if numel == 0:
        raise UsageError(f"fault {spec}: {target.what} has no elements to corrupt")
    if spec.element is not None and spec.element >= numel:
        raise UsageError(
            f"fault {spec}: element {spec.element} is beyond {target.what} ({numel} elements: use element=0..{numel - 1})"
        )
    bits, dtype = target.width_at(
        spec.element if spec.element is not None else spec.choose_element(target.default_pool or numel)
    )
    if spec.bit >= bits:
        raise UsageError(
            f"fault {spec}: bit {spec.bit} does not exist in a {dtype} element of {target.what} (use bit=0..{bits - 1})"
        )


def _segments(tensors: Sequence[Any]) -> tuple[tuple[int, int, str], ...]:
    return tuple((t.numel(), 8 * t.element_size(), str(t.dtype).removeprefix("torch.")) for t in tensors)


# config: a demo.run.DemoConfig (run.py imports this module)
def check_injections(config, recipe: Any) -> None:
    """Check every fault of ``config`` against the job ``recipe`` builds; raises :class:`UsageError`.

    Steps and ranks are checked by :class:`~sdc_forensics.demo.run.DemoConfig` itself; this
    checks elements and bits (for ``checkpoint-file``: the byte offset against the file's size).
    """
    if not config.injections:
        return
    model, optimizer, scheduler = recipe.build("cpu")
    params = list(model.parameters())
    for spec in config.injections:
        if spec.location in ("grad", "allreduce", "allreduce-all"):
            who = (
                "the reduced gradient"
                if spec.location == "allreduce-all"
                else f"rank {spec.rank}'s " + ("local gradient" if spec.location == "grad" else "reduced gradient")
            )
            check_spec(spec, Target(what=who, segments=_segments([p for p in params if p.requires_grad])))
        elif spec.location in ("weights", "update"):
            check_spec(spec, Target(what=f"rank {spec.rank}'s parameters", segments=_segments(params)))
        elif spec.location == "input":
            ids = recipe.microbatch_ids(spec.step, spec.rank, config.world_size)
            from sdc_forensics.statedict import flatten_state

            floats = [
                t
                for i in ids
                for t in flatten_state(recipe.fetch_microbatch(i, "cpu")).values()
                if t.is_floating_point()
            ]
            first = (
                sum(
                    t.numel()
                    for t in flatten_state(recipe.fetch_microbatch(ids[0], "cpu")).values()
                    if t.is_floating_point()
                )
                if ids
                else 0
            )
            check_spec(
                spec,
                Target(
                    what=f"rank {spec.rank}'s inputs at step {spec.step}",
                    segments=_segments(floats),
                    default_pool=first,
                ),
            )
        elif spec.location == "checkpoint-file" and spec.element is not None:
            size = _checkpoint_size(model, optimizer, scheduler, params, spec.step)
            byte = spec.element + spec.bit // 8
            if byte >= size:
                raise UsageError(
                    f"fault {spec}: byte {byte} is beyond the end of checkpoint {spec.step}'s file ({size} bytes: "
                    f"use element=0..{size - 1 - spec.bit // 8})"
                )


def _checkpoint_size(model, optimizer, scheduler, params, step: int) -> int:
    """Bytes of the demo's ``torch.save`` payload of checkpoint ``step`` (after one update when ``step`` > 0)."""
    import torch

    if step > 0:
        for p in params:
            p.grad = torch.zeros_like(p)
        # creates the optimizer state a later checkpoint holds
        optimizer.step()
        if scheduler is not None:
            scheduler.last_epoch = step
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    # torch.save names the archive after the file
    with tempfile.TemporaryDirectory(prefix="sdc-demo-size-") as scratch:
        path = Path(scratch) / f"step-{step:08d}.pt"
        torch.save(state, path)
        return path.stat().st_size
