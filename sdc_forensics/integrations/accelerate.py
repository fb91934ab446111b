"""Record an ``accelerate`` training loop: one call after ``prepare``, and the unchanged CLI certifies it.

::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    from sdc_forensics.integrations import accelerate as sdc
    sdc.record(accelerator, "runs/job42/trace", model=model, model_fn="mytrain:build_model", loss_fn="mytrain:loss",
               dataset="mytrain:make_dataset", scheduler_fn="mytrain:make_scheduler", max_grad_norm=1.0)

:func:`record` builds the :class:`~sdc_forensics.recorder.Recorder` on the prepared DDP model and
the torch optimizer inside Accelerate's, then follows the loop through Accelerate's own calls:

* ``accelerator.backward(loss)``: the first one of an accumulation cycle begins the optimizer
  step; each one records its microbatch (the sample indices of the batch the prepared loader
  handed out last, its input digest) and the loss as backward sees it (divided by
  ``gradient_accumulation_steps``, as Accelerate divides it);
* the optimizer step (Accelerate's wrapper steps the torch optimizer only when gradients sync)
  ends the recorded step;
* ``accelerator.save_state(dir)``: the folder (``model.safetensors``, ``optimizer.bin``,
  ``scheduler.bin``, ``random_states_R.pkl``) is noted as checkpoint ``N`` = optimizer steps
  completed, read back by the main process. Save once before the loop: checkpoint 0;
* ``accelerator.clip_grad_norm_``: checked against the ``max_grad_norm`` the recipe replays;
* ``accelerator.load_state(dir)`` before the first step: the recorder (made at the first backward
  or ``save_state``) starts the resumed attempt at the step the trace noted for ``dir``.

No ``save_state`` writes into a folder that holds files (refused in one line).

The sample indices come from the prepared loader's dataset (``__getitems__``, what a DataLoader
fetches a batch with) and travel with each batch through the collator and any data workers; the
loader hands the batch out without them (``_common`` has the ID layout). The generated recipe
(:class:`AccelerateRecipe`) rebuilds the model with ``model_fn()`` (weights from the checkpoint),
the optimizer as the job built it, the scheduler with ``scheduler_fn(optimizer)`` stepped as
Accelerate steps it (``num_processes`` times per optimizer step unless ``split_batches``), and the
loss with ``loss_fn(model, batch)``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from sdc_forensics.errors import RecipeError, SdcError, UsageError
from sdc_forensics.integrations import _common
from sdc_forensics.integrations.hf import INDEX_KEY, _Indexed

ADAPTER = "sdc_forensics.integrations.accelerate"
RECIPE = "sdc_forensics.integrations.accelerate:AccelerateRecipe"


class _TagItems:
    """A dataset's ``__getitems__`` that tags each sample with its index (picklable for data workers)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> list[_Indexed]:
        return [_Indexed(int(i), self.dataset[i]) for i in indices]


class _TagBatch:
    """The loader's collator, then ``{"batch": batch, INDEX_KEY: indices}`` (a batch may be any
    nesting: a tuple, a list, a dict); :class:`_Untag` takes it apart again before the loop sees it."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, features: list) -> Any:
        if not features or not isinstance(features[0], _Indexed):
            return self.collate(features)
        return {"batch": self.collate([f.item for f in features]), INDEX_KEY: torch.tensor([f.index for f in features])}


class _Untag:
    """Stands in for the prepared loader's DataLoader: iterates it, takes the indices off each
    batch into ``seen`` (oldest first) and hands the batch on without them; everything else is the DataLoader's."""

    def __init__(self, loader: Any, seen: list) -> None:
        self.__dict__["_loader"], self.__dict__["_seen"] = loader, seen

    def __iter__(self):
        for batch in self._loader:
            if not isinstance(batch, dict) or INDEX_KEY not in batch:
                raise SdcError(
                    "a batch came out of the recorded loader without its sample indices; the loader's dataset "
                    "or collator was replaced after sdc_forensics.integrations.accelerate.record"
                )
            indices, batch = batch[INDEX_KEY].tolist(), batch["batch"]
            self._seen.append((indices, batch))
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._loader, name, value)


def _refusals(accelerator: Any) -> list[str]:
    from accelerate.utils import DistributedType

    out = []
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        out.append(f"{kind.value} owns the gradient reduction and the optimizer step; the recorder needs DDP's")
    elif kind in (DistributedType.FSDP,):
        out.append(
            "FSDP shards parameters and gradients; the recorder records DDP (replicated) jobs, FSDP2 support is a later issue"
        )
    if accelerator.num_processes < 2:
        out.append(
            f"the job runs {accelerator.num_processes} process: the recorder records data-parallel (DDP) jobs; "
            "launch with accelerate launch / torchrun, 2 or more processes"
        )
    dynamo = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None)
    if dynamo is not None and str(getattr(dynamo, "value", dynamo)).upper() != "NO":
        out.append(
            f"dynamo_backend={str(getattr(dynamo, 'value', dynamo)).lower()} compiles the model in prepare(): the replay runs "
            "eager kernels and cannot reproduce compiled ones; record without a dynamo backend"
        )
    if accelerator.mixed_precision != "no":
        out.append(
            f"mixed precision ({accelerator.mixed_precision}: autocast and a loss scaler) is not replayed by the adapter yet"
        )
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        out.append(
            "sync_each_batch all-reduces every microbatch; the recorder fingerprints the accumulated gradient DDP "
            "sends once per step"
        )
    models, optimizers, loaders = accelerator._models, accelerator._optimizers, accelerator._dataloaders  # noqa: SLF001
    if len(models) != 1 or len(optimizers) != 1:
        out.append(
            f"prepare() was given {len(models)} model(s) and {len(optimizers)} optimizer(s); the adapter records one of each"
        )
    if len(loaders) != 1:
        out.append(
            f"prepare() was given {len(loaders)} dataloaders; the adapter needs exactly the training one (prepare the "
            "evaluation loader after record(), or pass it through prepare separately later)"
        )
    elif isinstance(loaders[0].dataset, torch.utils.data.IterableDataset):
        out.append(
            "the training dataset is not map-style (an IterableDataset has no indices to record as microbatch IDs)"
        )
    for model in models:
        out += _common.compile_refusal(model)
    for scheduler in accelerator._schedulers:  # noqa: SLF001
        inner = getattr(scheduler, "scheduler", scheduler)
        if hasattr(inner, "total_steps"):
            out.append(
                f"{type(inner).__name__} counts steps through Accelerate's accumulation bookkeeping; the adapter does not replay it"
            )
    return out


def record(
    accelerator: Any,
    trace_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    model_fn: str,
    loss_fn: str,
    dataset: str,
    scheduler_fn: str | None = None,
    max_grad_norm: float = 0.0,
    options: Any = None,
    inject=(),
) -> "AccelerateRecording":
    """Record the loop of ``accelerator`` (call after ``prepare``, before the first step).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared one model, one optimizer and the training dataloader.
        trace_dir: the trace directory (shared by all ranks).
        model: the model ``prepare`` returned (Accelerate keeps only the bare module; the recorder
            needs its DistributedDataParallel wrapper).
        model_fn: ``module:name`` of a zero-argument function that builds the (bare) model.
        loss_fn: ``module:name`` of ``loss(model, batch)``, the loss the loop passes to ``accelerator.backward``.
        dataset: ``module:name`` of a zero-argument function returning the training dataset (or
            ``(dataset, collator)`` when the loader's collator is not importable by name).
        scheduler_fn: ``module:name`` of ``make(optimizer)`` -> the LR scheduler, when the loop has one.
        max_grad_norm: the ``max_norm`` the loop passes to ``accelerator.clip_grad_norm_`` (0: no clipping).
        options: :class:`~sdc_forensics.recorder.RecorderOptions`.
        inject: fault specs for drills and tests (``sdc_forensics.inject``; ``input`` is not supported here).

    Returns:
        The :class:`AccelerateRecording`; ``close()`` it when training ends (or use it in ``with``).

    Raises:
        UsageError: a reference does not import, or a setting the adapter cannot replay (one line).
    """
    from sdc_forensics.recipe import import_reference
    from sdc_forensics.recorder import Recorder, RecorderOptions

    problems = _refusals(accelerator)
    if problems:
        raise _common.refuse(
            f"sdc-forensics cannot record this Accelerate job exactly: {problems[0]} (docs/integrations.md)"
        )
    inject = tuple(inject or ())  # None: no faults, as everywhere else
    if any(str(s).startswith("input:") for s in inject):
        raise _common.refuse(
            "the accelerate adapter does not inject input faults (the batch reaches the model before it is recorded)"
        )
    if any(str(s).startswith("checkpoint-file:") for s in inject):
        raise _common.refuse(
            "checkpoint-file injection flips a byte of one file; a save_state checkpoint is a folder (damage a "
            "file of it by hand to drill verify-checkpoint)"
        )
    for what, ref in (
        ("model function", model_fn),
        ("loss function", loss_fn),
        ("dataset function", dataset),
        ("scheduler function", scheduler_fn),
    ):
        if ref is not None:
            try:
                import_reference(ref, what=what)
            except RecipeError as exc:
                raise _common.refuse(str(exc)) from None
    _common.warn_unreplayable(accelerator._models[0])  # noqa: SLF001
    limit = getattr(getattr(accelerator, "project_configuration", None), "total_limit", None)
    if limit:
        _common.warn_rotation(f"ProjectConfiguration(total_limit={limit})")
    ddp = model
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) or ddp.module is not accelerator._models[0]:  # noqa: SLF001
        raise _common.refuse(
            "pass model= the model accelerator.prepare() returned (its DistributedDataParallel wrapper)"
        )
    optimizer = getattr(accelerator._optimizers[0], "optimizer", accelerator._optimizers[0])  # noqa: SLF001
    module = getattr(ddp, "module", ddp)
    loader = accelerator._dataloaders[0]  # noqa: SLF001
    schedulers = accelerator._schedulers  # noqa: SLF001
    if scheduler_fn is None and schedulers:
        raise _common.refuse(
            "the loop has an LR scheduler: name the function that builds it, scheduler_fn='module:make(optimizer)'"
        )
    base = getattr(loader, "base_dataloader", loader)
    settings = {
        "model_fn": model_fn,
        "loss_fn": loss_fn,
        "dataset": dataset,
        "scheduler_fn": scheduler_fn,
        "collator": _common.reference(base.collate_fn),
        "optimizer": _common.optimizer_spec(optimizer, module),
        "scheduler_steps": 1
        if accelerator.split_batches or not accelerator.step_scheduler_with_optimizer
        else accelerator.num_processes,
        "max_grad_norm": float(max_grad_norm),
    }
    options = options or RecorderOptions()

    def make_recorder(start_step: int):
        return Recorder(
            trace_dir,
            ddp,
            optimizer,
            recipe=RECIPE,
            recipe_args=settings,
            inject=tuple(inject),
            options=dataclasses.replace(options, start_step=start_step),
            framework=_common.framework_info("accelerate", ADAPTER),
        )

    return AccelerateRecording(
        accelerator,
        make_recorder,
        loader,
        optimizer,
        module,
        float(max_grad_norm),
        trace_dir=Path(trace_dir),
        start_step=options.start_step,
    )


class AccelerateRecording:
    """What :func:`record` returns: the recorder and the wiring into the accelerator (module docstring)."""

    def __init__(
        self,
        accelerator: Any,
        make_recorder: Any,
        loader: Any,
        optimizer: torch.optim.Optimizer,
        module: torch.nn.Module,
        max_grad_norm: float,
        *,
        trace_dir: Path,
        start_step: int = 0,
    ) -> None:
        self.accelerator, self.module, self.max_grad_norm = accelerator, module, max_grad_norm
        # made at the first backward or save_state: after an accelerator.load_state(dir) said where the run resumes
        self.rec = None
        self._make_recorder, self._optimizer, self._trace_dir, self._handle = make_recorder, optimizer, trace_dir, None
        # optimizer steps done: the next step's number, a checkpoint's step
        self.completed = start_step
        # (indices, batch) handed out by the loader, not yet backpropagated
        self._seen: list = []
        self._step = None
        self.track(loader)
        self._originals = {
            name: getattr(accelerator, name) for name in ("backward", "save_state", "clip_grad_norm_", "load_state")
        }
        accelerator.backward = self._backward
        accelerator.save_state = self._save_state
        accelerator.clip_grad_norm_ = self._clip_grad_norm
        accelerator.load_state = self._load_state

    def _open(self) -> Any:
        """The recorder, made once, its attempt starting at :attr:`completed`."""
        if self.rec is None:
            self.rec = self._make_recorder(self.completed)
            self._handle = self._optimizer.register_step_post_hook(
                self._after_update
                # after the recorder's own post-hook
            )
        return self.rec

    def _load_state(self, input_dir: str | None = None, *args, **kwargs):
        """``accelerator.load_state``: a resumed run's attempt starts at the step the trace noted for that folder."""
        if self.rec is not None:
            raise _common.refuse(
                "accelerator.load_state after the recorded training began: load the state before the first "
                "step, so the resumed attempt starts at its step"
            )
        out = self._originals["load_state"](input_dir, *args, **kwargs)
        if input_dir is None:
            raise _common.refuse(
                "accelerator.load_state() without a folder: name the folder, so the adapter finds its noted step"
            )
        from sdc_forensics.trace.checkpoints import read_checkpoint_notes

        try:
            notes = read_checkpoint_notes(self._trace_dir) if (self._trace_dir / "checkpoints").is_dir() else []
        except SdcError:
            notes = []
        found = Path(input_dir).resolve()
        steps = sorted({n.step for n in notes if Path(n.path).resolve() == found})
        if len(steps) != 1:
            raise _common.refuse(
                f"the trace {self._trace_dir} notes no checkpoint at {input_dir}, so the adapter cannot tell "
                "which step the run resumes at: resume from a save_state folder this trace recorded"
            )
        self.completed = steps[0]
        return out

    def track(self, loader: Any) -> Any:
        """Record the sample indices of a loader Accelerate prepared (the one ``record`` found, or the
        one ``accelerator.skip_first_batches`` returns on resume); returns it."""
        base = getattr(loader, "base_dataloader", None)
        if base is None:
            raise UsageError(
                "record the loader accelerator.prepare() returned (a DataLoaderShard), not a plain DataLoader"
            )
        if not isinstance(base, _Untag):
            dataset = base.dataset
            # what the DataLoader's fetcher calls for a batch
            dataset.__getitems__ = _TagItems(dataset)
            base.collate_fn = _TagBatch(base.collate_fn)
            loader.base_dataloader = _Untag(base, self._seen)
        return loader

    def _backward(self, loss, **kwargs):
        if not self._seen:
            raise SdcError(
                "accelerator.backward was called with no batch from the recorded loader; the adapter records "
                "microbatches that come from the prepared training loader"
            )
        # the prepared loader looks one batch ahead; more means batches were skipped or dropped
        if len(self._seen) > 2:
            raise SdcError(
                f"{len(self._seen) - 1} batches came out of the loader since the last backward; the adapter pairs "
                "each backward with the batch the loader handed out before it"
            )
        indices, batch = self._seen.pop(0)
        if self._step is None:
            self._step = self._open().begin_step(self.completed)
            self._step.add_microbatch_ids([_common.step_header(self.accelerator.gradient_accumulation_steps)])
        self._step.add_microbatch_ids(_common.batch_ids(indices))
        self._step.input(batch)
        self._step.loss(
            loss.detach() / self.accelerator.gradient_accumulation_steps
            # what Accelerate's backward divides
        )
        return self._originals["backward"](loss, **kwargs)

    def _after_update(self, optimizer, args, kwargs) -> None:
        # an update whose microbatches the adapter never saw: refuse rather than leave a hole
        if self._step is None:
            raise SdcError(
                "the optimizer stepped with no accelerator.backward since the last step: call accelerator.backward(loss), "
                "not loss.backward(), so that the adapter records the step's microbatches"
            )
        self.rec.end_step()
        self._step = None
        self.completed += 1

    def _clip_grad_norm(self, parameters, max_norm, norm_type=2):
        if float(max_norm) != self.max_grad_norm or norm_type != 2:
            raise UsageError(
                f"accelerator.clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) is not what the recipe "
                f"replays (max_grad_norm={self.max_grad_norm}, norm 2): pass record(..., max_grad_norm={max_norm})"
            )
        return self._originals["clip_grad_norm_"](parameters, max_norm, norm_type)

    def _save_state(self, output_dir: str | None = None, *args, **kwargs):
        if self._step is not None:
            raise UsageError(
                "accelerator.save_state in the middle of an accumulation cycle: save after the optimizer step"
            )
        if output_dir is not None:
            _common.refuse_existing(output_dir, self._main_says(_common.taken(output_dir)))
        self._open()
        where = self._originals["save_state"](output_dir, *args, **kwargs)
        folder = Path(where if where is not None else output_dir)
        # every rank's random_states_R.pkl is written before the folder is read back
        self.accelerator.wait_for_everyone()
        _common.note_folder(self.rec, self.completed, folder, self.module, is_writer=self.accelerator.is_main_process)
        return where

    def _main_says(self, flag: bool) -> bool:
        """The main process's ``flag`` on every process (a file check made where Accelerate writes)."""
        from accelerate.utils import broadcast_object_list

        return bool(broadcast_object_list([flag], from_process=0)[0])

    def close(self) -> None:
        """End the trace (the END record) and give the accelerator its own methods back."""
        self._restore()
        if self.rec is not None:
            self.rec.close()
        self.accelerator.wait_for_everyone()

    def _restore(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for name, original in self._originals.items():
            setattr(self.accelerator, name, original)

    def __enter__(self) -> "AccelerateRecording":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        # an exception, an alarm, KeyboardInterrupt: the END record says so; no collective waited on
        else:
            self._restore()
            rec, self.rec, self._step = self.rec, None, None
            _common.close_on_error(rec, exc[1])


@dataclasses.dataclass(kw_only=True)
class AccelerateRecipe:
    """Rebuilds a recorded Accelerate job (fields: what :func:`record` wrote as ``recipe_args``)."""

    model_fn: str
    loss_fn: str
    dataset: str
    optimizer: dict
    scheduler_fn: str | None = None
    collator: str | None = None
    scheduler_steps: int = 1
    max_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        from sdc_forensics.recipe import import_reference

        self._loss = import_reference(self.loss_fn, what="loss function")
        self._batches: _common.SampleBatches | None = None

    def build(self, device: Any = "cpu"):
        from sdc_forensics.recipe import import_reference

        rng = torch.random.get_rng_state()
        model = import_reference(self.model_fn, what="model function")().to(device)
        torch.random.set_rng_state(rng)
        model.train()
        optimizer = _common.build_optimizer(self.optimizer, model)
        scheduler = (
            import_reference(self.scheduler_fn, what="scheduler function")(optimizer) if self.scheduler_fn else None
        )
        return model, optimizer, scheduler

    def load_checkpoint(self, path: str, model, optimizer, scheduler) -> None:
        from safetensors.torch import load_file

        folder = Path(path)
        if not (folder / "model.safetensors").is_file():
            raise RecipeError(f"{folder} holds no model.safetensors: not an accelerator.save_state folder")
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
        device = next(model.parameters()).device
        optimizer.load_state_dict(torch.load(folder / "optimizer.bin", map_location=device, weights_only=True))
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(folder / "scheduler.bin", map_location="cpu", weights_only=True))

    def fetch_microbatch(self, microbatch_id: int, device: Any = "cpu"):
        if self._batches is None:
            self._batches = _common.dataset_batches(self.dataset, self.collator)
        return self._batches.fetch(microbatch_id, device)

    def loss(self, model, microbatch):
        if _common.is_placeholder(microbatch):
            return _common.zero_loss()
        loss = self._loss(model, microbatch)
        divisor = self._batches.divisor if self._batches is not None else 0
        return loss / divisor if divisor else loss

    def before_step(self, model, optimizer) -> None:
        if self.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)

    def after_step(self, model, optimizer, scheduler) -> None:
        for _ in range(self.scheduler_steps if scheduler is not None else 0):
            scheduler.step()
