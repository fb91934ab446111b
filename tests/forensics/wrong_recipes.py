"""Recipes that rebuild the demo jobs wrong in the update only (the local gradients still reproduce).

* ``lr_off``: the demo MLP (AdamW), whose learning rate the loop sets by hand before each update
  (``param_group["lr"] = ...``, as nanoGPT does), 1 % off: ``1.01e-2`` for ``1e-2``. The
  checkpoint's optimizer state holds the right rate; the hand-set one replaces it at every step.
* ``sharded_lr_off``: the FSDP2 demo's recipe (SGD, lr 0.05) with a hand-set learning rate 1 % off.
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


lr_off = LrOff()
sharded_lr_off = ShardedLrOff()
no_clip = NoClip()
