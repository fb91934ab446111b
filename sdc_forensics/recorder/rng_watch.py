"""Say while training, not at analysis, that a step draws from the unseeded global RNG.

A replay recomputes each rank's microbatches from the checkpoint's weights; dropout masks or a
random augmentation drawn from the global RNG came from states the trace does not hold, so no
replayed step can be compared (the replay finds it and certifies nothing, docs/recipes.md). A
week-long run recorded that way is recorded for nothing: the recorder looks at the first steps
of each attempt and says so once, on rank 0, with the fix.

The test, per watched step: the global RNG state (CPU, and the step's GPU) changed between the
start of the step and the optimizer step, while its seed (``torch.initial_seed``) did not. A
recipe that seeds its draws from the microbatch ID (``torch.manual_seed(K + id)``) reseeds inside
the step, which changes the seed: that is replayable and not reported.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

#: Steps of each attempt watched (the first ones: a loop's RNG use does not change later).
WATCHED_STEPS = 3

MESSAGE = (
    "sdc-forensics: step {step} drew from the global RNG without seeding it (dropout, or a random augmentation): "
    "a replay cannot reproduce those draws, so no checkpoint of this run can be certified; seed the draws from the "
    "microbatch ID in training and in the recipe (torch.manual_seed(K + microbatch_id) before each microbatch's forward, "
    "docs/recipes.md), or turn dropout off (p=0 / model.eval() for the layers that draw)"
)


def _snapshot(device: torch.device) -> tuple:
    states = [torch.random.get_rng_state(), torch.initial_seed()]
    if device.type == "cuda" and torch.cuda.is_initialized():
        states += [torch.cuda.get_rng_state(device), torch.cuda.initial_seed()]
    return tuple(states)


class RngWatch:
    """Watches the first :data:`WATCHED_STEPS` steps; :attr:`drawn` is the first step seen drawing."""

    def __init__(self, rank: int, device: torch.device, steps: int = WATCHED_STEPS) -> None:
        self.rank = rank
        self.device = device
        self.left = steps
        self.drawn: int | None = None
        self._entry: tuple | None = None
        self._step: int | None = None

    def begin(self, step: int) -> None:
        """At the start of a step (before its first forward)."""
        if self.left > 0 and self.drawn is None:
            self._entry, self._step = _snapshot(self.device), step

    def check(self, *_: object) -> None:
        """Before the optimizer step (an optimizer step pre-hook: takes and ignores its arguments)."""
        if self._entry is None:
            return
        entry, self._entry = self._entry, None
        self.left -= 1
        now = _snapshot(self.device)
        seeds_same = all(a == b for a, b in zip(entry[1::2], now[1::2]))
        state_changed = any(not torch.equal(a, b) for a, b in zip(entry[0::2], now[0::2]))
        if seeds_same and state_changed:
            self.drawn = self._step
            if self.rank == 0:
                log.warning(MESSAGE.format(step=self._step))
