"""Record a Hugging Face ``Trainer`` job: two lines, and the unchanged CLI certifies it.

::

    from sdc_forensics.integrations import hf
    hf.record(trainer, "runs/job42/trace", dataset="mytrain:make_dataset")
    trainer.train()

:func:`record` adds an :class:`SdcCallback` to the trainer. When training begins (the DDP wrapper
is ``trainer.model_wrapped`` by then) it builds the :class:`~sdc_forensics.recorder.Recorder` on
that wrapper and the torch optimizer inside Accelerate's; saves checkpoint 0 as a Trainer
checkpoint folder (``checkpoint-0``) unless the run resumes; records every optimizer step
(``on_step_begin`` .. ``on_step_end``, gradient accumulation included) with the sampler's
indices as microbatch IDs (``_common``: they travel with each batch, so prefetching and data
workers do not matter), the input digest and the loss ``backward()`` saw; and notes every
``save_steps`` folder in ``on_save`` (read back from disk by the rank that wrote it).

The replay recipe, :class:`sdc_forensics.integrations.hf_replay.TrainerRecipe`, is generated from
what the job was configured with: the model's class and config, the optimizer as built, the LR
scheduler's type and steps, ``max_grad_norm``, the collator, and ``dataset``, a zero-argument
function (``module:name``) that returns the training dataset (or ``(dataset, collator)``).

What the adapter cannot replay exactly is refused when :func:`record` is called, with one line
(module docstring of ``hf_replay`` lists the numerics it reproduces).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcError, UsageError
from sdc_forensics.integrations import _common

ADAPTER = "sdc_forensics.integrations.hf"
RECIPE = "sdc_forensics.integrations.hf_replay:TrainerRecipe"
#: the batch key that carries the sampler's indices from the collator to the training step
INDEX_KEY = "sdc_forensics_sample_index"


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise UsageError("the Hugging Face adapter needs transformers: pip install 'sdc-forensics[hf]'") from None
    if not transformers.__version__.startswith("5."):
        raise UsageError(
            f"the Hugging Face adapter replays the Trainer of transformers 5 (the loss scaling and checkpoint layout "
            f"it reproduces); this is {transformers.__version__}: pip install 'sdc-forensics[hf]'"
        )
    return transformers


class _Indexed:
    """A dataset sample with the index the sampler drew for it (picklable: data workers send it)."""

    __slots__ = ("index", "item")

    def __init__(self, index: int, item: Any) -> None:
        self.index, self.item = index, item


class IndexedDataset(torch.utils.data.Dataset):
    """The training dataset, unchanged for ``dataset[i]``; ``__getitems__`` (what a DataLoader's
    fetcher calls for a batch) tags each sample with its index for :class:`IndexedCollate`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[_Indexed]:
        return [_Indexed(int(i), self.dataset[i]) for i in indices]


class IndexedCollate:
    """The Trainer's collator (column removal included), then the samples' indices as one more key."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, features: list) -> Any:
        if not features or not isinstance(features[0], _Indexed):
            return self.collate(features)
        batch = self.collate([f.item for f in features])
        if not isinstance(
            batch,
            Mapping,
            # a dict, a BatchEncoding (the stock collators'), any mapping of model inputs
        ):
            raise _common.refuse(
                f"the Trainer's collator returned a {type(batch).__name__}, not a mapping of model inputs "
                "(the Trainer calls model(**batch)); the HF adapter carries the sample indices in that mapping"
            )
        batch = dict(batch)
        batch[INDEX_KEY] = torch.tensor([f.index for f in features], dtype=torch.int64)
        return batch


def _refusals(trainer: Any, transformers: Any) -> list[str]:
    """Every setting of this Trainer that the adapter cannot record or replay exactly."""
    args = trainer.args
    out = []
    if getattr(trainer, "is_deepspeed_enabled", False):
        out.append("DeepSpeed owns the gradient reduction and the optimizer step; the recorder needs DDP's")
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        out.append(
            "FSDP shards parameters and gradients; the recorder records DDP (replicated) jobs, FSDP2 support is a later issue"
        )
    if args.world_size < 2:
        out.append(
            f"the job runs {args.world_size} process: the recorder records data-parallel (DDP) jobs; launch with "
            "torchrun --nproc-per-node N, N >= 2"
        )
    if getattr(args, "n_gpu", 1) > 1:
        out.append(
            "torch.nn.DataParallel (several GPUs in one process) is not DDP: launch one process per GPU with torchrun"
        )
    if args.fp16 or args.bf16:
        out.append(
            "mixed precision (fp16/bf16: autocast and a loss scaler) is not replayed by the HF adapter yet; train in float32"
        )
    if getattr(args, "torch_compile", False):
        out.append(
            "torch_compile changes the kernels the replay would have to reproduce; turn it off for a recorded run"
        )
    if getattr(args, "label_smoothing_factor", 0):
        out.append(
            "label_smoothing_factor: the Trainer computes that loss itself; the adapter replays the model's own loss"
        )
    if getattr(trainer, "compute_loss_func", None) is not None:
        out.append("compute_loss_func: a custom loss the replay recipe cannot call by reference")
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        out.append(
            "loss_is_scaled_for_ga is set by hand; the adapter replays the Trainer's own rule for scaling the loss"
        )
    if any(getattr(trainer, f"get_{kind}_size", lambda: 1)() != 1 for kind in ("tp", "cp", "sp")):
        out.append("tensor, context or sequence parallelism: the recorder records data-parallel (DDP) jobs")
    if trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        out.append(
            "sync_each_batch all-reduces every microbatch, so a step's local gradient is never whole in one bucket "
            "pass; the recorder fingerprints the accumulated gradient DDP sends once per step"
        )
    if getattr(args, "save_only_model", False):
        out.append("save_only_model: checkpoints without optimizer and scheduler cannot be replayed from")
    out += _common.compile_refusal(trainer.model)
    if not isinstance(trainer.model, transformers.PreTrainedModel):
        out.append(
            f"the model is a {type(trainer.model).__name__}, not a transformers PreTrainedModel: the recipe rebuilds "
            "the model from its class and config"
        )
    elif _common.reference(type(trainer.model)) is None:
        out.append(
            f"the model class {type(trainer.model).__qualname__} is not importable as module:name; define it at module level"
        )
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        out.append(
            "the training dataset is not map-style (an IterableDataset has no indices to record as microbatch IDs)"
        )
    if getattr(trainer, "lr_scheduler", None) is not None:
        out.append(
            "a scheduler passed in optimizers=(...) cannot be rebuilt by the recipe; let the Trainer create it (lr_scheduler_type)"
        )
    if args.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy"):
        out.append(f"lr_scheduler_type {args.lr_scheduler_type!r} steps on evaluation metrics the trace does not hold")
    return out


def record(
    trainer: Any, trace_dir: str | os.PathLike, *, dataset: str, options: Any = None, inject=()
) -> "SdcCallback":
    """Record ``trainer``'s training in ``trace_dir`` (call before ``trainer.train()``).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) of a DDP job, built with its train dataset.
        trace_dir: the trace directory (shared by all ranks).
        dataset: ``module:name`` of a zero-argument function that returns the same training
            dataset (or ``(dataset, collator)`` when the collator is an object, such as
            ``DataCollatorWithPadding(tokenizer)``): replay fetches samples from it by index.
        options: :class:`~sdc_forensics.recorder.RecorderOptions`; ``start_step`` (a resumed run) and
            ``checkpoint_every`` (``save_steps``) are set from the Trainer.
        inject: fault specs for drills and tests (``sdc_forensics.inject``).

    Returns:
        The :class:`SdcCallback` added to the trainer.

    Raises:
        UsageError: transformers is missing, ``dataset`` cannot be imported, or the Trainer uses a
            setting the adapter cannot record or replay exactly (one line naming it).
    """
    transformers = _import_transformers()
    from sdc_forensics.recipe import import_reference

    if not isinstance(trainer, transformers.Trainer):
        raise UsageError(f"hf.record needs a transformers.Trainer, got {type(trainer).__name__}")
    problems = _refusals(trainer, transformers)
    inject = tuple(inject or ())  # None: no faults, as everywhere else
    if any(str(spec).startswith("checkpoint-file:") for spec in inject):
        problems.append(
            "checkpoint-file injection flips a byte of one file; a Trainer checkpoint is a folder (damage a file "
            "of it by hand to drill verify-checkpoint)"
        )
    if problems:
        raise _common.refuse(f"sdc-forensics cannot record this Trainer exactly: {problems[0]} (docs/integrations.md)")
    try:
        made = import_reference(dataset, what="dataset function")
    except Exception as exc:  # noqa: BLE001 - RecipeError: say it as a usage error at record time
        raise _common.refuse(str(exc)) from None
    if not callable(made):
        raise _common.refuse(
            f"dataset {dataset} is not a function: name a zero-argument function that returns the training dataset"
        )
    if getattr(trainer.args, "save_total_limit", None):
        _common.warn_rotation(f"save_total_limit={trainer.args.save_total_limit}")
    callback = SdcCallback(trainer, trace_dir, dataset=dataset, options=options, inject=inject)
    trainer.train_dataset = IndexedDataset(trainer.train_dataset)
    original_loader = trainer.get_train_dataloader

    def get_train_dataloader():
        loader = original_loader()
        inner = getattr(
            loader,
            "base_dataloader",
            loader,
            # Accelerate's DataLoaderShard iterates the DataLoader it wraps
        )
        inner.collate_fn = IndexedCollate(inner.collate_fn)
        return loader

    trainer.get_train_dataloader = get_train_dataloader
    original_step = trainer.training_step

    def training_step(model, inputs, *args, **kwargs):
        return callback.training_step(original_step, model, inputs, *args, **kwargs)

    trainer.training_step = training_step
    original_train = trainer.train

    def train(resume_from_checkpoint=None, *args, **kwargs):
        # whether this run resumes (then it writes no checkpoint 0); the trace closed however train() ends
        callback.resuming = bool(resume_from_checkpoint)
        try:
            return original_train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as exc:
            callback.close(on_error=True, exc=exc)
            raise

    trainer.train = train
    original_save = trainer._save_checkpoint  # noqa: SLF001

    def save_checkpoint(model, trial, *args, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(trainer._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"  # noqa: SLF001
        _common.refuse_existing(folder, _rank0_says(_common.taken(folder)))
        return original_save(model, trial, *args, **kwargs)

    trainer._save_checkpoint = save_checkpoint  # noqa: SLF001 - every folder the Trainer saves, checked before it writes
    trainer.add_callback(callback)
    return callback


def _device_of_params(model: torch.nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _rank0_says(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a file check made where the Trainer writes)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    box = [flag]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _later_folders(args: Any, start: int, max_steps: int) -> list[Path]:
    """The ``checkpoint-N`` folders a run resumed at step ``start`` will save that exist already
    (``save_strategy="steps"``: every ``save_steps``, and the last step)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if (
        str(getattr(args.save_strategy, "value", args.save_strategy)) != "steps"
        or not args.save_steps
        or args.save_steps < 1
    ):
        return []
    every = int(args.save_steps)
    steps = {n for n in range(start + 1, max_steps + 1) if n % every == 0} | (
        {max_steps} if max_steps > start else set()
    )
    return [
        f for f in (Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{n}" for n in sorted(steps)) if _common.taken(f)
    ]


def _recipe_args(trainer: Any, dataset: str, optimizer: torch.optim.Optimizer, max_steps: int) -> dict[str, Any]:
    """What :class:`~sdc_forensics.integrations.hf_replay.TrainerRecipe` rebuilds the job from."""
    args, model = trainer.args, trainer.model
    columns = None
    if args.remove_unused_columns:
        trainer._set_signature_columns_if_needed()  # noqa: SLF001 - the columns the Trainer's collator keeps
        columns = sorted(trainer._signature_columns)  # noqa: SLF001
    return {
        "model_class": _common.reference(type(model)),
        "config": model.config.to_dict(),
        "dataset": dataset,
        "collator": _common.reference(trainer.data_collator),
        "columns": columns,
        "optimizer": _common.optimizer_spec(optimizer, model),
        "scheduler": {
            "type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "warmup_steps": int(args.get_warmup_steps(max_steps)),
            "training_steps": int(max_steps),
            "kwargs": dict(args.lr_scheduler_kwargs or {}),
        },
        "max_grad_norm": float(args.max_grad_norm or 0.0),
        # compute_loss multiplies an item-normalised loss by the processes that averaged the item count
        "items_multiplier": int(trainer.accelerator.num_processes // trainer.get_tp_size())
        if args.average_tokens_across_devices
        else 1,
    }


def _json_safe(value: Any) -> Any:
    """A config dict with what JSON cannot hold (a torch dtype) as strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class SdcCallback:
    """The ``TrainerCallback`` :func:`record` adds (see the module docstring); built by :func:`record`,
    which also wires the sample indices through the trainer's dataloader and training step."""

    def __init__(self, trainer: Any, trace_dir: str | os.PathLike, *, dataset: str, options: Any, inject) -> None:
        from sdc_forensics.recorder import RecorderOptions

        self.trainer = trainer
        self.trace_dir = Path(trace_dir)
        self.dataset = dataset
        self.options = options or RecorderOptions()
        self.inject = tuple(inject)
        self.rec = None
        # train(resume_from_checkpoint=...) was called with a checkpoint
        self.resuming = False
        # the StepRecording of the optimizer step in progress
        self._step = None
        # its first microbatch was seen (the step header is written)
        self._step_started = False
        self._step_number = 0
        # the rank-step's RNG seed, and the next microbatch's number
        self._seed, self._microbatch = None, 0

    # ---- TrainerCallback protocol (duck-typed: every event the handler may call) ----
    def __getattr__(self, name: str):
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, **kwargs):
        from sdc_forensics.recorder import Recorder

        trainer = self.trainer
        # the Trainer has loaded its state: the attempt starts at state.global_step
        if self.resuming:
            later = _later_folders(args, int(state.global_step), int(state.max_steps))
            if _rank0_says(bool(later)):
                raise _common.refuse(
                    f"the run resumes at step {state.global_step} into {args.output_dir}, which holds {later[0].name if later else 'a later checkpoint'} "
                    "of an earlier attempt, and the Trainer would write over it: set output_dir to a new folder "
                    "(resume_from_checkpoint= still names the old checkpoint)"
                )
        ddp = trainer.model_wrapped
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise _common.refuse(
                f"the Trainer did not wrap the model in DistributedDataParallel (got {type(ddp).__name__}); "
                "the recorder records DDP jobs"
            )
        # inside Accelerate's wrapper
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        settings = _json_safe(_recipe_args(trainer, self.dataset, optimizer, state.max_steps))
        every = args.save_steps if str(getattr(args.save_strategy, "value", args.save_strategy)) == "steps" else None
        options = dataclasses.replace(
            self.options,
            start_step=int(state.global_step),
            checkpoint_every=int(every) if every and every >= 1 else self.options.checkpoint_every,
        )
        self.rec = Recorder(
            self.trace_dir,
            ddp,
            optimizer,
            recipe=RECIPE,
            recipe_args=settings,
            options=options,
            inject=self.inject,
            framework=_common.framework_info("transformers", ADAPTER),
        )
        if (
            not self.resuming and state.global_step == 0
            # replay starts from a checkpoint: checkpoint 0 is the initial state
        ):
            trainer._save_checkpoint(ddp, trial=None)  # noqa: SLF001 - the Trainer's own folder layout, checkpoint-0
            self.on_save(args, state, control)

    def training_step(self, original, model, inputs, *args, **kwargs):
        """The Trainer's ``training_step`` for one microbatch, with its indices, input and loss recorded."""
        if self._step is None or INDEX_KEY not in inputs:
            raise UsageError(
                "a training batch reached training_step outside a recorded step or without its sample indices; "
                "the HF adapter needs the Trainer's own train dataloader (get_train_dataloader not overridden)"
            )
        inputs = dict(inputs)
        indices = inputs.pop(INDEX_KEY).tolist()
        if not self._step_started:
            self._step_started = True
            items = args[0] if args else kwargs.get("num_items_in_batch")
            # the loss is normalised by the item count
            if self.trainer.model_accepts_loss_kwargs and items is not None:
                count = float(items)
                if count != int(count):
                    raise SdcError(
                        f"num_items_in_batch = {count} is not a whole count; the adapter replays whole counts"
                    )
                header = _common.step_header(int(count), items=True)
            # Trainer.training_step divides by the step's accumulation count
            else:
                header = _common.step_header(self.trainer.current_gradient_accumulation_steps)
            seed = _common.step_seed(self.rec.options.seed, self._step_number, dist.get_rank())
            self._step.add_microbatch_ids([header, _common.rng_header(seed)])
            self._seed, self._microbatch = seed, 0
        self._step.add_microbatch_ids(_common.batch_ids(indices))
        self._step.input(inputs)
        # the forward's draws (dropout) from a seed the trace holds: the recipe draws the same masks
        with _common.seeded(self._seed, self._microbatch, _device_of_params(model)):
            loss = original(model, inputs, *args, **kwargs)
        self._microbatch += 1
        self._step.loss(loss)
        return loss

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = self.rec.begin_step(state.global_step)
        self._step_number = int(state.global_step)
        self._step_started = False

    def on_step_end(self, args, state, control, **kwargs):
        self.rec.end_step()
        self._step = None

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        # every rank's files (rng_state_R.pth) are in the folder before it is read back
        dist.barrier()
        _common.note_folder(self.rec, state.global_step, folder, self.trainer.model, is_writer=args.should_save)

    def on_train_end(self, args, state, control, **kwargs):
        if self.rec is not None:
            self.rec.close()
            dist.barrier()
            self.rec = None

    def close(self, *, on_error: bool = True, exc: BaseException | None = None) -> None:
        """Close the trace if training left without ``on_train_end`` (an exception ``exc``, an
        alarm, KeyboardInterrupt): the END record says how it ended, and no collective is waited on."""
        rec, self.rec, self._step = self.rec, None, None
        if on_error:
            _common.close_on_error(rec, exc)
        elif rec is not None:
            rec.close(on_error=False)
