"""Record a PyTorch Lightning job (``DDPStrategy``): one callback, and the unchanged CLI certifies it.

::

    from sdc_forensics.integrations.lightning import SdcCallback
    trainer = L.Trainer(strategy="ddp", callbacks=[SdcCallback("runs/job42/trace", dataset="mytrain:make_dataset"), ...])

:class:`SdcCallback` checks and wires the job in ``on_fit_start`` (the strategy has wrapped the
LightningModule in DistributedDataParallel and built the optimizer by then) and builds the
:class:`~sdc_forensics.recorder.Recorder` in ``on_train_start``, after ``fit(ckpt_path=...)``
restored ``global_step`` (a resumed fit's attempt starts there); a fresh fit saves checkpoint 0
(``trainer.save_checkpoint``, a name no file has yet). It records every optimizer step: the first ``on_train_batch_start`` of an accumulation cycle begins it; each batch
adds its sample indices and input digest; ``on_before_backward`` gives the loss as backward sees
it (divided by ``accumulate_grad_batches``); the optimizer step ends it. Every checkpoint the job
saves through ``trainer.save_checkpoint`` (``ModelCheckpoint`` included) is noted as checkpoint
``N`` = ``trainer.global_step``, read back by global rank 0.

Lightning runs the forward and backward of the step that updates *inside* ``optimizer.step``
(a closure); the recorder's checks run in the optimizer's step hooks, after backward. So the
callback has the raw optimizer run the closure first and then take its hooked step, which is
what the closure-free ``step()`` would have done: the numerics are unchanged.

The generated recipe (:class:`LightningRecipe`) rebuilds the LightningModule from its class and
``hparams`` (``self.save_hyperparameters()``), takes the optimizer and scheduler from its own
``configure_optimizers()``, computes the loss with its ``training_step`` (``batch_idx`` 0) and
applies the batch transfer hooks, clips as the precision plugin clips (``gradient_clip_val``,
norm 2, over the optimizer's parameters in group order), and steps a ``"step"``-interval scheduler
once per optimizer step.

``ModelParallelStrategy`` (FSDP2 or HSDP applied in ``configure_model`` on the data-parallel mesh)
is recorded as a sharded job (``recorder/fsdp_layout.py``): its distributed checkpoints (DCP
directories every rank writes) are digested as if whole before the save, and the recipe loads them
into the unsharded module. Refused for it: tensor parallelism, ``accumulate_grad_batches`` above 1
(Lightning reduce-scatters every microbatch there), ``save_distributed_checkpoint=False``.

Refused with one line when the callback attaches: another strategy (DeepSpeed, FSDP1), mixed precision, manual
optimization, several optimizers, a scheduler on an ``"epoch"`` interval or a frequency above 1,
a comm hook given to ``DDPStrategy`` (pass it as ``SdcCallback(comm_hook=...)``), a module whose
constructor arguments ``hparams`` does not hold.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from sdc_forensics.errors import RecipeError, SdcError, UsageError
from sdc_forensics.integrations import _common
from sdc_forensics.integrations.accelerate import _TagBatch, _TagItems
from sdc_forensics.integrations.hf import INDEX_KEY

log = logging.getLogger(__name__)
ADAPTER = "sdc_forensics.integrations.lightning"
RECIPE = "sdc_forensics.integrations.lightning:LightningRecipe"

# a Callback subclass when Lightning is installed (the Trainer checks isinstance); plain otherwise
try:
    from lightning.pytorch.callbacks import Callback as _Base
except ImportError:  # pragma: no cover - the callback then refuses when it is built
    _Base = object


def _refusals(trainer: Any, pl_module: Any) -> list[str]:
    from lightning.pytorch.strategies import DDPStrategy

    strategy = trainer.strategy
    out = []
    if type(strategy).__name__ == "ModelParallelStrategy":
        out += _model_parallel_refusals(trainer, strategy)
    elif not isinstance(strategy, DDPStrategy):
        out.append(f"the strategy is {type(strategy).__name__}; the adapter records DDPStrategy (strategy='ddp') jobs")
    elif getattr(strategy, "_ddp_comm_hook", None) is not None:
        out.append(
            "DDPStrategy(ddp_comm_hook=...) registers a comm hook the recorder must wrap: pass it as "
            "SdcCallback(comm_hook=..., comm_state=...) instead"
        )
    if trainer.world_size < 2:
        out.append(
            f"the job runs {trainer.world_size} process: the recorder records data-parallel (DDP) jobs (devices >= 2)"
        )
    precision = str(trainer.precision)
    if precision not in ("32-true", "32"):
        out.append(
            f"precision {precision!r} (autocast, a loss scaler) is not replayed by the adapter yet; train with precision='32-true'"
        )
    if not pl_module.automatic_optimization:
        out.append("manual optimization: the adapter follows Lightning's automatic optimization loop")
    if len(trainer.optimizers) != 1:
        out.append(f"{len(trainer.optimizers)} optimizers; the adapter records one")
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau:
            out.append(
                "an LR scheduler that steps per epoch, every few steps or on a metric: the trace cannot tell the replay "
                "when it stepped; use interval='step', frequency=1"
            )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
        out.append(f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}; the recipe replays clipping by norm")
    out += _common.compile_refusal(pl_module)
    if _common.reference(_module_class(pl_module)) is None:
        out.append(
            f"the LightningModule class {_module_class(pl_module).__qualname__} is not importable as module:name; define it "
            "in a module"
        )
    return out


def _module_class(pl_module: Any) -> type:
    """The LightningModule's own class: ``fully_shard(module)`` swaps in a subclass made on the fly
    (``FSDP<Name>``, bases ``FSDPModule`` and the class), which no import can name."""
    cls = type(pl_module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return cls
    if issubclass(cls, FSDPModule):
        cls = next((c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule) and c is not object), cls)
    return cls


def _model_parallel_refusals(trainer: Any, strategy: Any) -> list[str]:
    """``ModelParallelStrategy`` is recorded as an FSDP2/HSDP job (``configure_model`` applies
    ``fully_shard`` on the data-parallel mesh) when nothing else shards the model."""
    out = []
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() != 1:
        out.append(
            f"ModelParallelStrategy with tensor parallelism (tensor_parallel_size={mesh['tensor_parallel'].size()}): "
            "the recorder records data parallelism (FSDP2, HSDP); use tensor_parallel_size=1"
        )
    if trainer.accumulate_grad_batches != 1:
        out.append(
            "ModelParallelStrategy reduce-scatters every microbatch of an accumulation (Lightning blocks no sync "
            "there), and the recorder records one reduce-scatter per step: use accumulate_grad_batches=1"
        )
    if not getattr(strategy, "_save_distributed_checkpoint", True):
        out.append(
            "ModelParallelStrategy(save_distributed_checkpoint=False) gathers the state on rank 0; the adapter "
            "notes distributed (DCP) checkpoints: keep save_distributed_checkpoint=True"
        )
    return out


class SdcCallback(_Base):
    """Record a Lightning ``DDPStrategy`` job (module docstring).

    Args:
        trace_dir: the trace directory (shared by all ranks).
        dataset: ``module:name`` of a zero-argument function returning the training dataset (or
            ``(dataset, collator)`` when the training DataLoader's collator is not importable by name).
        options: :class:`~sdc_forensics.recorder.RecorderOptions` (``start_step`` is the resumed step).
        comm_hook, comm_state: the job's own DDP comm hook (instead of ``DDPStrategy(ddp_comm_hook=)``).
        inject: fault specs for drills and tests (``sdc_forensics.inject``).

    Raises:
        UsageError: Lightning is missing (when built), or at ``on_fit_start`` a setting the adapter
            cannot record or replay (one line, on every rank, before anything is written).
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        *,
        dataset: str,
        options: Any = None,
        comm_hook=None,
        comm_state=None,
        inject=(),
    ) -> None:
        if _Base is object:
            raise UsageError("the Lightning adapter needs lightning: pip install 'sdc-forensics[lightning]'")
        from sdc_forensics.recorder import RecorderOptions

        self.trace_dir, self.dataset = Path(trace_dir), dataset
        self.options = options or RecorderOptions()
        self.comm_hook, self.comm_state, self.inject = comm_hook, comm_state, tuple(inject or ())
        self.rec = None
        self._step = None
        # (indices, batch) of the batch on its way to training_step
        self._batch = None
        # the collator named in the trace (None: the dataset function's, or torch's default)
        self._collator = None
        # the rank-step's RNG seed, and the next microbatch's number
        self._seed, self._microbatch = None, 0

    def on_fit_start(self, trainer, pl_module) -> None:
        """Refuse what cannot be replayed and wire the data, optimizer and checkpoint hooks; the
        recorder itself starts in :meth:`on_train_start`, once Lightning restored a resumed run."""
        from sdc_forensics.recipe import RecipeError as _RecipeError, import_reference

        problems = _refusals(trainer, pl_module)
        if problems:
            raise _common.refuse(
                f"sdc-forensics cannot record this Lightning job exactly: {problems[0]} (docs/integrations.md)"
            )
        try:
            import_reference(self.dataset, what="dataset function")
        except _RecipeError as exc:
            raise _common.refuse(str(exc)) from None
        rotating = [c for c in trainer.checkpoint_callbacks if getattr(c, "save_top_k", -1) != -1]
        if rotating:
            _common.warn_rotation(f"ModelCheckpoint(save_top_k={rotating[0].save_top_k})")
        optimizer = trainer.optimizers[0]
        settings = {
            "module_class": _common.reference(_module_class(pl_module)),
            "hparams": _json_hparams(pl_module),
            "dataset": self.dataset,
            "collator": None,
            "clip": float(trainer.gradient_clip_val or 0.0),
            "scheduler": bool(trainer.lr_scheduler_configs),
        }
        source = trainer.fit_loop._data_source  # noqa: SLF001 - where the training loader comes from (fit() or a *_dataloader hook)
        given = getattr(source, "instance", None)
        if isinstance(given, torch.utils.data.DataLoader):
            settings["collator"] = _common.reference(given.collate_fn)
        elif given is None or not callable(getattr(given, getattr(source, "name", ""), None)):
            raise _common.refuse(
                "the adapter finds no training DataLoader (pass train_dataloaders= to fit, or define train_dataloader())"
            )
        self._collator = settings["collator"]
        self._settings = settings
        self._wire(trainer, pl_module, optimizer)
        if isinstance(given, torch.utils.data.DataLoader):
            # before fit_loop.setup_data rebuilds it with a DistributedSampler and starts iterating
            self._tag(given)
        # a LightningModule's or DataModule's train_dataloader(): tag what it returns
        else:
            hook = getattr(given, source.name)
            setattr(given, source.name, lambda: self._tag(hook()))

    def on_train_start(self, trainer, pl_module) -> None:
        """Start the attempt at the step Lightning restored: ``fit(ckpt_path=...)`` loads the loops'
        state (``global_step``) after ``on_fit_start``, so a recorder made there would number a
        resumed attempt 0 and write checkpoint 0 over the run's own. A fresh run (no ``ckpt_path``)
        saves checkpoint 0, under a name no file has yet."""
        from sdc_forensics.recorder import Recorder

        start = int(trainer.global_step)
        options = dataclasses.replace(self.options, start_step=start)
        self.rec = Recorder(
            self.trace_dir,
            trainer.strategy.model,
            trainer.optimizers[0],
            recipe=RECIPE,
            recipe_args=self._settings,
            options=options,
            comm_hook=self.comm_hook,
            comm_state=self.comm_state,
            inject=self.inject,
            framework=_common.framework_info("lightning", ADAPTER),
        )
        # post-hooks run in registration order: the recorder's (the weights after the update, their vote) must run before
        # this one closes the step, or no step would carry its weights digest and the update would go unchecked
        self._handle = trainer.optimizers[0].register_step_post_hook(lambda opt, args, kwargs: self._end_step())
        if (
            trainer.ckpt_path is None and start == 0
            # replay starts from a checkpoint: checkpoint 0 is the initial state
        ):
            folder = (
                Path(trainer.checkpoint_callback.dirpath)
                if getattr(trainer.checkpoint_callback, "dirpath", None)
                else Path(trainer.default_root_dir) / "checkpoints"
            )
            trainer.save_checkpoint(trainer.strategy.broadcast(_common.unused_path(folder / "sdc-step=0.ckpt"), src=0))

    def _wire(self, trainer, pl_module, optimizer) -> None:
        """Indices through the dataset and collator; the batch hook that takes them off; the
        optimizer's closure run before its hooked step; checkpoints noted after they are saved."""
        original_transfer = pl_module.on_before_batch_transfer

        def on_before_batch_transfer(batch, dataloader_idx):
            if isinstance(batch, dict) and INDEX_KEY in batch and pl_module.training:
                self._batch, batch = (batch[INDEX_KEY].tolist(), None), batch["batch"]
            return original_transfer(batch, dataloader_idx)

        pl_module.on_before_batch_transfer = on_before_batch_transfer
        original_training_step = pl_module.training_step

        def training_step(*args, **kwargs):
            # not a recorded microbatch
            if self._step is None:
                return original_training_step(*args, **kwargs)
            # the forward's draws (dropout) from a seed the trace holds: the recipe draws the same masks
            with _common.seeded(self._seed, self._microbatch, pl_module.device):
                out = original_training_step(*args, **kwargs)
            self._microbatch += 1
            return out

        pl_module.training_step = training_step
        hooked_step = optimizer.step

        def step(closure=None, **kwargs):
            # forward, backward, clipping: before the step hooks
            loss = closure() if closure is not None else None
            hooked_step(**kwargs)
            return loss

        if hasattr(
            hooked_step,
            "_wrapped_by_lr_sched",
            # the scheduler's step counter is still inside: say so to Lightning
        ):
            step._wrapped_by_lr_sched = True
        optimizer.step = step
        # the step-closing post-hook: registered in on_train_start, after the recorder's own
        self._handle = None
        original_save = trainer.save_checkpoint
        sharded = type(trainer.strategy).__name__ == "ModelParallelStrategy"

        def save_checkpoint(filepath, *args, **kwargs):
            if (
                self._step is not None
                and trainer.ckpt_path is not None
                and trainer.global_step == self.rec.options.start_step
            ):
                # ModelCheckpoint does not restore the step it last saved at, so a resumed fit saves the restored step
                # again after its first microbatch, over the file it resumed from (save_top_k=-1): that state is on disk
                if trainer.is_global_zero:
                    log.warning(
                        "sdc-forensics: not saving %s: it would repeat checkpoint %d, which the run resumed from (%s)",
                        filepath,
                        trainer.global_step,
                        trainer.ckpt_path,
                    )
                return None
            _common.refuse_existing(filepath, trainer.strategy.broadcast(_common.taken(filepath), src=0))
            if self._step is not None:
                raise UsageError(
                    "a checkpoint saved in the middle of an accumulation cycle: save after the optimizer step"
                )
            # a DCP directory every rank writes: its tensors digested as if whole, before the save
            if sharded:
                from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

                state = {
                    "state_dict": get_model_state_dict(pl_module),
                    "optimizer_0": get_optimizer_state_dict(pl_module, optimizer),
                }
                out = []
                self.rec.checkpoint(
                    int(trainer.global_step),
                    filepath,
                    state,
                    save=lambda _state, _path: out.append(original_save(filepath, *args, **kwargs)),
                )
                return out[0] if out else None
            out = original_save(filepath, *args, **kwargs)
            trainer.strategy.barrier("sdc-forensics checkpoint note")
            _common.note_folder(
                self.rec, int(trainer.global_step), filepath, pl_module, is_writer=trainer.is_global_zero
            )
            return out

        trainer.save_checkpoint = save_checkpoint

    def _tag(self, loader: Any) -> Any:
        """Have ``loader`` carry each batch's sample indices (its dataset and collator, which the
        loader Lightning rebuilds with a DistributedSampler keeps); returns it."""
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise UsageError(f"the training data is a {type(loader).__name__}; the adapter records a torch DataLoader")
        dataset = loader.dataset
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise UsageError(
                "the training dataset is not map-style (an IterableDataset has no indices to record as microbatch IDs)"
            )
        if not isinstance(getattr(dataset, "__getitems__", None), _TagItems):
            # what the DataLoader's fetcher calls for a batch
            dataset.__getitems__ = _TagItems(dataset)
        if not isinstance(loader.collate_fn, _TagBatch):
            named = _common.reference(loader.collate_fn)
            if named is not None and named != (self._collator or "torch.utils.data._utils.collate:default_collate"):
                raise UsageError(
                    f"the training loader collates with {named}, which the trace does not name: pass the "
                    "DataLoader to trainer.fit(), or have the dataset function return (dataset, collator)"
                )
            loader.collate_fn = _TagBatch(loader.collate_fn)
        return loader

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._batch is None:
            raise SdcError(
                "a training batch reached the LightningModule without its sample indices; the adapter needs the "
                "training DataLoader Lightning built (no custom sampler wrapper that drops __getitems__)"
            )
        indices, self._batch = self._batch[0], None
        if self._step is None:
            self._step = self.rec.begin_step(int(trainer.global_step))
            self._seed, self._microbatch = (
                _common.step_seed(self.rec.options.seed, trainer.global_step, trainer.global_rank),
                0,
            )
            self._step.add_microbatch_ids(
                [_common.step_header(trainer.accumulate_grad_batches), _common.rng_header(self._seed)]
            )
        self._step.add_microbatch_ids(_common.batch_ids(indices))
        self._step.input(batch)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._step is not None:
            self._step.loss(loss)

    def _end_step(self) -> None:
        if self._step is not None:
            self.rec.end_step()
            self._step = None

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.rec is not None:
            self._handle.remove()
            self.rec.close()
            trainer.strategy.barrier("sdc-forensics close")
            self.rec = None

    def on_exception(self, trainer, pl_module, exception) -> None:
        """Training leaves on ``exception`` (an error, an alarm, KeyboardInterrupt, which Lightning
        also hands here before it exits 1): the END record says so; no collective is waited on."""
        rec, self.rec, self._step = self.rec, None, None
        if rec is not None:
            self._handle.remove()
        _common.close_on_error(rec, exception)


def _train_loaders(trainer) -> list:
    """The DataLoaders Lightning iterates for training (inside its CombinedLoader)."""
    combined = trainer.fit_loop._combined_loader  # noqa: SLF001
    loaders = combined.flattened if combined is not None else []
    return [dl for dl in loaders if isinstance(dl, torch.utils.data.DataLoader)]


def _json_hparams(pl_module) -> dict:
    import inspect

    hparams = dict(pl_module.hparams)
    required = [
        n
        for n, p in inspect.signature(type(pl_module).__init__).parameters.items()
        if n != "self" and p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    missing = [n for n in required if n not in hparams]
    if missing:
        raise UsageError(
            f"{type(pl_module).__qualname__}({', '.join(missing)}) cannot be rebuilt for replay: call "
            "self.save_hyperparameters() in its __init__"
        )
    from sdc_forensics.recipe import check_recipe_args

    try:
        return check_recipe_args(hparams)
    except UsageError as exc:
        raise UsageError(f"the LightningModule's hparams cannot be recorded for replay: {exc}") from None


@dataclasses.dataclass(kw_only=True)
class LightningRecipe:
    """Rebuilds a recorded Lightning job (fields: what :class:`SdcCallback` wrote as ``recipe_args``)."""

    module_class: str
    hparams: dict
    dataset: str
    collator: str | None = None
    clip: float = 0.0
    scheduler: bool = False

    def __post_init__(self) -> None:
        self._batches: _common.SampleBatches | None = None
        self._model = None

    def build(self, device: Any = "cpu"):
        from lightning.pytorch.core.optimizer import _configure_optimizers

        from sdc_forensics.recipe import import_reference

        rng = torch.random.get_rng_state()
        model = import_reference(self.module_class, what="LightningModule class", subclass_of=torch.nn.Module)(
            **self.hparams
        ).to(device)
        torch.random.set_rng_state(rng)
        model.train()
        optimizers, configs, _ = _configure_optimizers(model.configure_optimizers())
        if len(optimizers) != 1:
            raise RecipeError(f"configure_optimizers() returned {len(optimizers)} optimizers; the recorded job had one")
        first = configs[0] if configs else None
        scheduler = (first["scheduler"] if isinstance(first, dict) else first.scheduler) if first is not None else None
        if bool(scheduler) != self.scheduler:
            raise RecipeError("configure_optimizers() does not return the scheduler the recorded job had")
        self._model = model
        return model, optimizers[0], scheduler

    def load_checkpoint(self, path: str, model, optimizer, scheduler) -> None:
        # ModelParallelStrategy's distributed checkpoint: DCP reshards it into this one process
        if Path(path).is_dir():
            self._load_distributed(Path(path), model, optimizer, scheduler)
            return
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        model.load_state_dict(state["state_dict"])
        optimizer.load_state_dict(state["optimizer_states"][0])
        if scheduler is not None:
            scheduler.load_state_dict(state["lr_schedulers"][0])

    @staticmethod
    def _load_distributed(path: Path, model, optimizer, scheduler) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"state_dict": model_state, "optimizer_0": optim_state}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["state_dict"], optim_state_dict=state["optimizer_0"])
        # the rest of Lightning's checkpoint (loops, schedulers) is rank 0's meta.pt
        if scheduler is not None:
            meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
            scheduler.load_state_dict(meta["lr_schedulers"][0])

    def fetch_microbatch(self, microbatch_id: int, device: Any = "cpu"):
        if self._batches is None:
            self._batches = _common.dataset_batches(self.dataset, self.collator)
        batch = self._batches.fetch(microbatch_id, device)
        if _common.is_placeholder(batch) or self._model is None:
            return batch
        # the module's batch hooks, as Lightning applies them
        batch = self._model.on_before_batch_transfer(batch, 0)
        batch = self._model.transfer_batch_to_device(batch, torch.device(device), 0)
        return self._model.on_after_batch_transfer(batch, 0)

    def loss(self, model, microbatch):
        if _common.is_placeholder(microbatch):
            return _common.zero_loss()
        with (
            self._batches.seeded(
                next((p.device for p in model.parameters()), "cpu")
                # dropout, as training seeded it
            ),
            warnings.catch_warnings(),
        ):
            # training_step's self.log() has no Trainer in a replay: Lightning would warn at every interval
            warnings.filterwarnings("ignore", message=r"You are trying to `self\.log\(\)`")
            out = model.training_step(microbatch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        divisor = self._batches.divisor if self._batches is not None else 0
        return loss / divisor if divisor else loss

    def before_step(self, model, optimizer) -> None:
        # Precision.clip_grad_by_norm: the optimizer's parameters, group by group
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], self.clip)

    def after_step(self, model, optimizer, scheduler) -> None:
        if scheduler is not None:
            scheduler.step()
