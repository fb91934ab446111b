"""The replay recipe of a Hugging Face ``Trainer`` job, generated from what the job was configured with.

``hf.record`` writes its settings into the manifest (``recipe_args``); replay calls
``TrainerRecipe(**recipe_args)``. It reproduces, on the replay device, what the Trainer
(transformers 5, float32, no DeepSpeed/FSDP) computes for one optimizer step:

* the model: its class rebuilt from its config, the weights from the checkpoint folder's
  ``model.safetensors`` (or its shards);
* each microbatch: the dataset function's samples at the recorded indices, column removal as the
  Trainer's collator did it (``remove_unused_columns``), then the Trainer's collator;
* the loss: the model's own (``outputs["loss"]``, else ``outputs[0]``), divided by the step's
  gradient accumulation count as ``Trainer.training_step`` does (the count is in the step header:
  an epoch's last step may accumulate fewer microbatches); or, for a model whose forward takes
  ``**kwargs`` (``model_accepts_loss_kwargs``, most language models), given the step's
  ``num_items_in_batch`` (in the step header: the label count over the window and all ranks, as a
  float tensor as the Trainer makes it) and multiplied by the processes that averaged it
  (``average_tokens_across_devices``), as ``Trainer.compute_loss`` does;
* ``clip_grad_norm_`` with ``max_grad_norm`` (Accelerate calls torch's), then the optimizer the
  job built (class, groups and options recorded from the live object, state from
  ``optimizer.pt``), then the LR scheduler (``transformers.get_scheduler`` with the recorded type
  and steps, state from ``scheduler.pt``). ``zero_grad`` is the replay's own (gradients start from
  none at every rank and step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sdc_forensics.errors import RecipeError
from sdc_forensics.integrations import _common


@dataclasses.dataclass(kw_only=True)
class TrainerRecipe:
    """Rebuilds a recorded Trainer job (fields: ``hf._recipe_args``)."""

    model_class: str
    config: dict
    dataset: str
    optimizer: dict
    scheduler: dict
    collator: str | None = None
    columns: list | None = None
    max_grad_norm: float = 0.0
    items_multiplier: int = 1

    def __post_init__(self) -> None:
        self._batches: _common.SampleBatches | None = None

    # ---- the protocol ----
    def build(self, device: Any = "cpu"):
        import transformers
        from sdc_forensics.recipe import import_reference

        cls = import_reference(self.model_class, what="model class", subclass_of=torch.nn.Module)
        config = cls.config_class.from_dict(dict(self.config))
        rng = torch.random.get_rng_state()
        model = cls(config).to(
            device
            # weights come from the checkpoint; initialisation must not move the caller's RNG
        )
        torch.random.set_rng_state(rng)
        model.train()
        optimizer = _common.build_optimizer(self.optimizer, model)
        s = self.scheduler
        scheduler = transformers.get_scheduler(
            s["type"],
            optimizer=optimizer,
            num_warmup_steps=s["warmup_steps"],
            num_training_steps=s["training_steps"],
            scheduler_specific_kwargs=s["kwargs"] or None,
        )
        return model, optimizer, scheduler

    def load_checkpoint(self, path: str, model, optimizer, scheduler) -> None:
        from safetensors.torch import load_file

        folder = Path(path)
        shards = sorted(folder.glob("model*.safetensors"))
        if not shards:
            raise RecipeError(f"{folder} holds no model.safetensors: not a Trainer checkpoint folder")
        weights: dict[str, torch.Tensor] = {}
        for shard in shards:
            weights.update(load_file(str(shard)))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = (
            {k for k in missing if k in getattr(model, "_tied_weights_keys", None) or ()}
            if isinstance(getattr(model, "_tied_weights_keys", None), (list, tuple, set, dict))
            else set()
        )
        if unexpected or set(missing) - tied:
            raise RecipeError(
                f"{folder}: the weights do not fit the rebuilt model (missing {sorted(set(missing) - tied)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]})"
            )
        device = next(model.parameters()).device
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=device, weights_only=True))
        scheduler.load_state_dict(torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=True))

    def fetch_microbatch(self, microbatch_id: int, device: Any = "cpu"):
        return self._sample_batches().fetch(microbatch_id, device)

    def loss(self, model, microbatch):
        if _common.is_placeholder(microbatch):
            return _common.zero_loss()
        batches = self._sample_batches()
        # the forward's RNG as training seeded it (dropout)
        with batches.seeded(_device_of(microbatch)):
            # Trainer: num_items_in_batch = gathered int64 count / (tp * cp * sp), a float tensor
            if batches.items:
                count = torch.tensor(batches.divisor, dtype=torch.int64, device=_device_of(microbatch)) / 1
                outputs = model(**microbatch, num_items_in_batch=count)
            else:
                outputs = model(**microbatch)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if batches.items:
            return loss * self.items_multiplier if self.items_multiplier != 1 else loss
        return loss / batches.divisor if batches.divisor else loss

    def before_step(self, model, optimizer) -> None:
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)

    def after_step(self, model, optimizer, scheduler) -> None:
        scheduler.step()

    # ---- data ----
    def _sample_batches(self) -> _common.SampleBatches:
        if self._batches is None:
            from sdc_forensics.recipe import import_reference

            made = import_reference(self.dataset, what="dataset function")()
            dataset, collate = made if isinstance(made, tuple) else (made, None)
            if collate is None:
                if self.collator is None:
                    raise RecipeError(
                        f"the job's collator is an object the trace cannot name: have {self.dataset} return "
                        "(dataset, collator) (docs/integrations.md)"
                    )
                collate = import_reference(self.collator, what="collator")
            columns = set(self.columns) if self.columns is not None else None

            def sample(index: int):
                item = dataset[index]
                # the Trainer's RemoveColumnsCollator
                if columns is not None and isinstance(item, Mapping):
                    item = {k: v for k, v in item.items() if k in columns}
                return item

            self._batches = _common.SampleBatches(sample, collate)
        return self._batches


def _device_of(batch: Any) -> torch.device:
    for value in batch.values() if isinstance(batch, Mapping) else ():
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")
