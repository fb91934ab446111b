"""The demo recipe: a small MLP classifier on synthetic data, microbatches fetched by ID.

It is the first user of the recipe protocol (``sdc_forensics/recipe.py``) and a template for
yours. Microbatch ``i`` is generated from a generator seeded with ``i``, so any process on any
machine fetches the same bytes; labels come from a fixed random "teacher" so the task is
learnable and the loss falls.

Microbatch IDs of the demo job: ``(step * world_size + rank) * microbatches_per_step + m``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn


class ClassifierJob:
    """What the demo jobs share: a classification loss over ``(inputs, labels)`` microbatches
    accumulated ``microbatches_per_step`` at a time, and the IDs each rank consumes."""

    microbatches_per_step: int

    def loss(self, model, microbatch):
        """Cross-entropy, divided by the number of microbatches accumulated per step."""
        inputs, labels = microbatch
        return nn.functional.cross_entropy(model(inputs), labels) / self.microbatches_per_step

    def microbatch_ids(self, step: int, rank: int, world_size: int) -> list[int]:
        """The IDs rank ``rank`` consumes at ``step``."""
        base = (step * world_size + rank) * self.microbatches_per_step
        return list(range(base, base + self.microbatches_per_step))


@dataclasses.dataclass(kw_only=True)
class DemoRecipe(ClassifierJob):
    """The demo job's recipe; the defaults are what ``sdc-forensics demo`` trains."""

    in_features: int = 64
    hidden: int = 128
    classes: int = 10
    microbatch_size: int = 16
    microbatches_per_step: int = 2
    lr: float = 1e-2
    data_seed: int = 1234
    model_seed: int = 0

    def build(self, device="cpu"):
        """Model, AdamW optimizer and no scheduler, deterministically initialised."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.model_seed)
        model = nn.Sequential(
            nn.Linear(self.in_features, self.hidden),
            nn.GELU(),
            nn.Linear(self.hidden, self.hidden),
            nn.GELU(),
            nn.Linear(self.hidden, self.classes),
        ).to(device)
        torch.random.set_rng_state(gen_state)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)
        return model, optimizer, None

    def _teacher(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.data_seed)
        return torch.randn(self.in_features, self.classes, generator=gen)

    def fetch_microbatch(self, microbatch_id: int, device="cpu"):
        """``(inputs, labels)`` of microbatch ``microbatch_id``."""
        gen = torch.Generator().manual_seed(self.data_seed * 1_000_003 + int(microbatch_id))
        inputs = torch.randn(self.microbatch_size, self.in_features, generator=gen)
        labels = (inputs @ self._teacher()).argmax(dim=1)
        return inputs.to(device), labels.to(device)

    def save_checkpoint(self, path, model, optimizer, scheduler, step: int) -> None:
        """``torch.save`` of ``{"model", "optimizer", "step"}``."""
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, Path(path))

    def load_checkpoint(self, path, model, optimizer, scheduler) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`, without executing pickles."""
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


#: The instance the demo records in its manifest as ``sdc_forensics.demo.recipe:recipe``.
recipe = DemoRecipe()
