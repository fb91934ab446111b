"""A small conv net recipe whose last-bit differences grow: the tolerant-replay test bed.

Three ``Conv2d -> GroupNorm -> ReLU`` blocks (max-pool after the second), average pooling
to 2x2 and a linear head, trained with SGD (momentum 0.9, weight decay), gradient clipping by
norm (``before_step``) and a ``StepLR`` schedule (``after_step``). Unlike the demo MLP, its
gradients are not bitwise the same at another intra-op thread count: oneDNN's convolution
backward and GroupNorm's reductions split their sums by thread, and ReLU kinks and GroupNorm's
division let those last-bit differences grow step by step. Measured on x86_64 with torch 2.13
(``tests/demo/test_convnet.py`` checks it and prints the count): rank 1's step-0 gradient at 1
vs 2 threads differs in 298 of its 7,434 elements (relative difference <= 2e-7); at 1 vs 1
thread it is bitwise the same.

Microbatch ``i`` is a batch of random 3x16x16 images from a generator seeded with ``i`` (the
same bytes in any process); labels come from a fixed random linear "teacher" on each quadrant's
mean colour, so the task is learnable. Microbatch IDs: as the demo,
``(step * world_size + rank) * microbatches_per_step + m``.

Referenced as ``sdc_forensics.demo.convnet:recipe`` (``sdc-forensics demo --recipe``);
``sdc_forensics.demo.convnet:seeded.sN`` is the same job with seeds moved by ``N``, so that a
campaign (``benchmarks/tolerant_campaign.py``) trains different clean runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from sdc_forensics.demo.recipe import ClassifierJob

#: The reference the recorder writes into the manifest for this recipe.
REFERENCE = "sdc_forensics.demo.convnet:recipe"


@dataclasses.dataclass(kw_only=True)
class ConvNetRecipe(ClassifierJob):
    """The conv net job; the defaults keep a 4-rank, 40-step CPU run to a few seconds of compute."""

    channels: tuple[int, int, int] = (8, 16, 32)
    groups: int = 4
    image_size: int = 16
    classes: int = 10
    microbatch_size: int = 8
    microbatches_per_step: int = 2
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    clip_norm: float = 1.0
    lr_step_size: int = 15
    lr_gamma: float = 0.5
    data_seed: int = 4321
    model_seed: int = 0

    def build(self, device="cpu"):
        """Model, SGD with momentum and a StepLR scheduler, deterministically initialised."""
        c1, c2, c3 = self.channels
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.model_seed)
        model = nn.Sequential(
            nn.Conv2d(3, c1, 3, padding=1),
            self.norm(c1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            self.norm(c2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1),
            self.norm(c3),
            nn.ReLU(),
            # a plain 2 x 2 average pool: AdaptiveAvgPool2d's CUDA backward has no deterministic
            # kernel, so replayable() training refused it on the first H200 run
            nn.AvgPool2d(self.image_size // 4),
            nn.Flatten(),
            nn.Linear(4 * c3, self.classes),
        ).to(device)
        torch.random.set_rng_state(gen_state)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.lr_step_size, gamma=self.lr_gamma)
        return model, optimizer, scheduler

    def norm(self, channels: int) -> nn.Module:
        """The normalisation layer after each convolution: ``GroupNorm`` (no buffers)."""
        return nn.GroupNorm(self.groups, channels)

    def before_step(self, model, optimizer) -> None:
        """Clip the averaged gradient to ``clip_norm`` (between the all-reduce and the update)."""
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_norm)

    def after_step(self, model, optimizer, scheduler) -> None:
        """Advance the learning-rate schedule by one step."""
        scheduler.step()

    def _teacher(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.data_seed)
        return torch.randn(3 * 2 * 2, self.classes, generator=gen, dtype=torch.float64)

    def fetch_microbatch(self, microbatch_id: int, device="cpu"):
        """``(images, labels)`` of microbatch ``microbatch_id``: images ``(B, 3, H, W)``, labels ``(B,)``."""
        gen = torch.Generator().manual_seed(self.data_seed * 1_000_003 + int(microbatch_id))
        images = torch.randn(self.microbatch_size, 3, self.image_size, self.image_size, generator=gen)
        # the teacher sees each quadrant's mean colour; float64 and a small elementwise sum, so the
        # labels do not depend on the thread count or a BLAS kernel
        # (B, 12)
        features = nn.functional.avg_pool2d(images.double(), self.image_size // 2).flatten(1)
        # (B, 12, C) -> (B,)
        labels = (features.unsqueeze(2) * self._teacher()).sum(dim=1).argmax(dim=1)
        return images.to(device), labels.to(device)

    def save_checkpoint(self, path, model, optimizer, scheduler, step: int) -> None:
        """``torch.save`` of ``{"model", "optimizer", "scheduler", "step"}``."""
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
        }
        torch.save(state, Path(path))

    def load_checkpoint(self, path, model, optimizer, scheduler) -> None:
        """Load model, optimizer and scheduler state without executing pickles."""
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])


class _Seeded:
    """``seeded.s<N>``: the recipe with its model and data seeds moved by ``N`` (``s0`` is ``recipe``).

    A reference such as ``sdc_forensics.demo.convnet:seeded.s17`` names a variant of the job
    that the recorder writes into the manifest and replay imports again, so a campaign can train
    many different clean runs of the same recipe without writing a module per run.
    """

    def __getattr__(self, name: str) -> ConvNetRecipe:
        if name.startswith("s") and name[1:].isdigit():
            offset = int(name[1:])
            return ConvNetRecipe(
                model_seed=ConvNetRecipe.model_seed + offset, data_seed=ConvNetRecipe.data_seed + offset
            )
        raise AttributeError(f"seeded.{name}: use seeded.s<N> with N a non-negative integer")


#: The instance referenced as ``sdc_forensics.demo.convnet:recipe``.
recipe = ConvNetRecipe()
#: Seeded variants, referenced as ``sdc_forensics.demo.convnet:seeded.s<N>``.
seeded = _Seeded()


def variant_reference(offset: int) -> str:
    """The reference of seeded variant ``offset`` (0 is :data:`recipe` itself, by value)."""
    return REFERENCE if offset == 0 else f"sdc_forensics.demo.convnet:seeded.s{int(offset)}"
