"""Recipes that rebuild the demo jobs wrong in the update only (the local gradients still reproduce),
and a job whose learning rate is set by hand from the step number, with its right and wrong recipes.

* ``lr_off``: the demo MLP (AdamW), whose learning rate the loop sets by hand before each update
  (``param_group["lr"] = ...``, as nanoGPT does), 1 % off: ``1.01e-2`` for ``1e-2``. The
  checkpoint's optimizer state holds the right rate; the hand-set one replaces it at every step.
* ``sharded_lr_off``: the FSDP2 demo's recipe (SGD, lr 0.05) with a hand-set learning rate 1 % off.
* ``hand_set_lr``: the demo MLP trained with ``param_group["lr"] = get_lr(step)`` before every
  update (nanoGPT's loop); its recipe is itself: ``before_step`` declares ``step`` and is handed the
  optimizer step, in training (the demo's loop) and in replay alike. ``own_counter`` is the usual
  mistake: a recipe that counts its steps from 0, so every replay window after checkpoint 0 sets the
  rate of the wrong step.
* ``no_clip``: the conv net recipe (SGD, ``clip_grad_norm_``) that forgot its clipping. The job
  clips to ``clip_norm=0.05`` (``recipe_args``), far below the conv net's gradient norm, so
  clipping engages at every step and leaving it out changes every update.
"""

from __future__ import annotations

import dataclasses

from sdc_forensics.demo.convnet import ConvNetRecipe
from sdc_forensics.demo.recipe import DemoRecipe
from sdc_forensics.demo.sharded import ShardedRecipe

#: The conv net job's clipping threshold: below its gradient norm at every step of a short run.
CLIP_NORM = 0.05


@dataclasses.dataclass(kw_only=True)
class LrOff(DemoRecipe):
    """The demo recipe with a hand-set learning rate 1 % above the job's."""

    wrong_lr: float = 1.01e-2

    def before_step(self, model, optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self.wrong_lr


@dataclasses.dataclass(kw_only=True)
class NoClip(ConvNetRecipe):
    """The conv net recipe without its gradient clipping."""

    def before_step(self, model, optimizer) -> None:
        pass


@dataclasses.dataclass(kw_only=True)
class ShardedLrOff(ShardedRecipe):
    """The sharded demo's recipe with a hand-set learning rate 1 % above the job's 0.05."""

    def before_step(self, model, optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.0505


def get_lr(step: int) -> float:
    """A decaying learning rate, different at every step."""
    return 1e-2 / (1.0 + 0.5 * step)


@dataclasses.dataclass(kw_only=True)
class HandSetLr(DemoRecipe):
    """The demo recipe whose loop sets the learning rate by hand from the step number."""

    def before_step(self, model, optimizer, step) -> None:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step)


@dataclasses.dataclass(kw_only=True)
class OwnCounter(DemoRecipe):
    """The same schedule from a counter of its own, started at 0 by every replay window: wrong after checkpoint 0."""

    calls: int = 0

    def load_checkpoint(self, path, model, optimizer, scheduler) -> None:
        super().load_checkpoint(path, model, optimizer, scheduler)
        self.calls = 0

    def before_step(self, model, optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(self.calls)
        self.calls += 1


lr_off = LrOff()
hand_set_lr = HandSetLr()
own_counter = OwnCounter()
sharded_lr_off = ShardedLrOff()
no_clip = NoClip()
