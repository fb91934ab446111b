"""torchtitan: the FSDP2/HSDP online checks inside a torchtitan ``Trainer``, in two lines.

::

    from sdc_forensics.integrations import torchtitan as sdc

    trainer = Trainer(config)            # torchtitan's, run with --training.disable_cuda_graphs on GPUs
    sdc.watch(trainer, policy="raise")   # every rank
    trainer.train()

What it does (``docs/integrations.md``, "torchtitan"): :func:`~sdc_forensics.recorder.fsdp_monitor.watch`
on each of ``trainer.model_parts`` (the reduce-scatter and HSDP all-reduce checks, NaN/Inf
before and after), and a wrapper around ``trainer.optimizers.step`` that, on every rank before
each optimizer step, runs the step's check and, every ``weights_every`` steps, the weights check
(:func:`~sdc_forensics.recorder.fsdp_checks.check_shards` across HSDP replicas, or
:func:`~sdc_forensics.recorder.fsdp_checks.check_gathered` on a 1-D FSDP mesh). The step named
is ``trainer.step``. Every result is kept in ``trainer.sdc_results`` (``policy="return"``) or
raised as :class:`~sdc_forensics.errors.SdcAlarm` (``policy="raise"``).

Refused, in one line, before anything is wrapped:

* CUDA graphs (torchtitan's default on GPUs): a captured graph replays its kernels without the
  Python hooks the checks run in, so every step after the capture would go unchecked; run with
  ``--training.disable_cuda_graphs``.
* Pipeline parallelism (by :func:`watch`): stages hold different parameters, and the checks are
  collectives every rank must make alike; :func:`record` records it.
* A model part that is not ``fully_shard``-ed (torchtitan's ``replicate()`` data parallelism):
  nothing here checks it yet.

Recorded, with :func:`record` instead of :func:`watch`: the sharded recorder
(``recorder/fsdp_layout.py``; with pipeline parallelism, ``parallel_dims.pp_enabled``, the
pipeline layout ``recorder/pp_layout.py`` given ``trainer.pp_schedule``, whose stages are
``trainer.model_parts``, several per rank under ``ScheduleInterleaved1F1B``, and whose
``scale_grads`` it reads: torchtitan's is off) around ``trainer.train_step``, so every
torchtitan step is a trace step (its online checks included), with the microbatch IDs a
function of yours gives (torchtitan's loader is a stateful iterator over a streamed dataset and
has no sample index to record), and, every ``checkpoint_every`` steps, a DCP checkpoint the
recorder writes and notes (``{"model", "optim"}``: every model part's state dict, the optimizer
container's own; torchtitan's checkpoints are not read). ``bisect --trace-only`` works on any
such trace; a replay needs your recipe (``docs/integrations.md`` gives its shape): one that
rebuilds the model and fetches a microbatch by the IDs you recorded.
Said at attach (rank 0, one line): a ``checkpoint_dir`` that is torchtitan's own checkpoint folder
while its ``checkpoint.keep_latest_k`` purges it (``_rotation``). However ``train()`` ends (an
exception, an alarm, KeyboardInterrupt), the trace is closed.
Written against torchtitan 0.3.0's ``Trainer`` (``model_parts``, ``optimizers``, ``step``,
``config.training``, ``parallel_dims``, ``pp_schedule``). torchtitan 0.3.0 installs over torch
2.13.0+cpu, but its ``Trainer`` does not start without CUDA (its model imports triton; its
constructor calls ``torch.cuda.set_device``: docs/integrations.md gives the lines), so it is
tested here on a trainer-shaped object around a real ``fully_shard`` job
(``tests/integrations/test_torchtitan.py``), not on torchtitan itself.
"""

from __future__ import annotations

from sdc_forensics.errors import UsageError


def _pipelined(trainer) -> bool:
    """Whether the trainer runs pipeline parallelism (``parallel_dims.pp_enabled``, or several model parts)."""
    return len(list(getattr(trainer, "model_parts", None) or ())) > 1 or bool(
        getattr(getattr(trainer, "parallel_dims", None), "pp_enabled", False)
    )


def _refusal(trainer, *, pipeline: bool = False) -> str | None:
    """What this adapter cannot do with ``trainer`` (one line; None: nothing). ``pipeline``: the
    caller records a pipeline job through its schedule (``record``); ``watch`` does not."""
    config = getattr(trainer, "config", None)
    training = getattr(config, "training", None)
    device = getattr(trainer, "device", None)
    on_gpu = getattr(device, "type", "cpu") == "cuda"
    if on_gpu and training is not None and not getattr(training, "disable_cuda_graphs", True):
        return (
            "torchtitan captures the forward and backward in CUDA graphs, which replay without the Python hooks the "
            "checks run in: run with --training.disable_cuda_graphs"
        )
    parts = list(getattr(trainer, "model_parts", None) or ())
    if not parts:
        return "this trainer has no model_parts: pass torchtitan's Trainer after it is built"
    if _pipelined(trainer) and not pipeline:
        return (
            "pipeline parallelism is not supported by watch: its stages hold different parameters and the checks are "
            "collectives; record(trainer, ...) records it (through trainer.pp_schedule)"
        )
    if _pipelined(trainer) and getattr(trainer, "pp_schedule", None) is None:
        return (
            "pipeline parallelism without trainer.pp_schedule: the recorder records a pipeline job through its schedule "
            "(torchtitan 0.3's Trainer.pp_schedule)"
        )
    if not hasattr(getattr(trainer, "optimizers", None), "step"):
        return "this trainer has no optimizers.step to check before"
    from sdc_forensics.integrations._common import compile_refusal

    # torchtitan's --compile.enable: the hooks and the replay need eager modules
    for part in parts:
        compiled = compile_refusal(part)
        if compiled:
            return compiled[0]
    return None


def _rotation(trainer, checkpoint_dir) -> str | None:
    """The setting, when torchtitan's own checkpointing rotates the forensic checkpoints away:
    ``checkpoint.keep_latest_k`` > 0 (torchtitan's default is 10) with checkpointing enabled and
    ``checkpoint_dir`` its checkpoint folder (``job.dump_folder``/``checkpoint.folder``), where its
    purge deletes every ``step-N`` entry but the latest k, the recorder's ``step-N`` included. A
    ``checkpoint_dir`` of its own is not rotated: nothing to say."""
    from pathlib import Path

    config = getattr(trainer, "config", None)
    checkpoint = getattr(config, "checkpoint", None)
    if checkpoint is None or checkpoint_dir is None:
        return None
    enabled = getattr(
        checkpoint,
        "enable",
        getattr(checkpoint, "enable_checkpoint", False),
        # 0.3.0: enable; older: enable_checkpoint
    )
    keep = int(getattr(checkpoint, "keep_latest_k", 0) or 0)
    if not enabled or keep <= 0:
        return None
    folder = Path(
        str(getattr(getattr(config, "job", None), "dump_folder", "") or "."),
        str(getattr(checkpoint, "folder", "checkpoint")),
    )
    if Path(checkpoint_dir).resolve() != folder.resolve():
        return None
    return f"torchtitan's checkpoint.keep_latest_k={keep} in {folder} (record's checkpoint_dir: give it a folder of its own)"


def watch(trainer, *, policy: str = "return", weights_every: int = 1, inject=None):
    """Installs the FSDP2 online checks in a torchtitan ``Trainer``; every rank calls it.

    Args:
        trainer: torchtitan's ``Trainer``, built (its model parts ``fully_shard``-ed).
        policy: ``"return"`` (results in ``trainer.sdc_results``) or ``"raise"``.
        weights_every: run the weights check every this many steps (0: never).
        inject: fault drills, as :func:`sdc_forensics.recorder.fsdp_monitor.watch`'s (specs count
            torchtitan's steps).

    Returns:
        The :class:`~sdc_forensics.recorder.fsdp_monitor.FsdpMonitor` of the model part.
    """
    from sdc_forensics.recorder import fsdp_checks, fsdp_monitor

    problem = _refusal(trainer)
    if problem is not None:
        from sdc_forensics.integrations._common import refuse

        raise refuse(f"sdc-forensics cannot watch this torchtitan trainer: {problem}")
    if policy not in ("return", "raise"):
        raise UsageError(f"policy must be 'return' or 'raise', not {policy!r}")
    if weights_every < 0:
        raise UsageError(f"weights_every must be >= 0, not {weights_every}")
    model = trainer.model_parts[0]
    # torchtitan counts steps from 1 and adds one before each train_step: the next is trainer.step + 1
    monitor = fsdp_monitor.watch(model, inject=inject, start_step=int(getattr(trainer, "step", 0)) + 1)
    replicated = any(_replicated(p) for p in model.parameters())
    optimizers = trainer.optimizers
    step_optimizers = optimizers.step
    trainer.sdc_results = []

    def checked_step(*args, **kwargs):
        step = int(getattr(trainer, "step", -1))
        results = [monitor.check(step, policy=policy)]
        if weights_every and step % weights_every == 0:
            weights = fsdp_checks.check_shards if replicated else fsdp_checks.check_gathered
            results.append(weights(model, policy=policy, step=step))
        trainer.sdc_results.append((step, results))
        return step_optimizers(*args, **kwargs)

    optimizers.step = checked_step
    return monitor


def record(
    trainer,
    trace_dir,
    *,
    microbatch_ids=None,
    recipe: str | None = None,
    recipe_args: dict | None = None,
    checkpoint_every: int = 0,
    checkpoint_dir=None,
    options=None,
    inject=(),
):
    """Records a torchtitan ``Trainer``'s job as a trace; every rank calls it, before ``train()``.

    Args:
        trainer: torchtitan's ``Trainer``, built (its model parts ``fully_shard``-ed).
        trace_dir: where the trace goes (the same on every rank).
        microbatch_ids: ``f(trainer) -> list[int]``, the IDs of the microbatches this rank trains
            on in step ``trainer.step`` (what your recipe's ``fetch_microbatch`` takes); None: no
            IDs (``bisect --trace-only`` and the online checks, no replay).
        recipe, recipe_args: your replay recipe (``"module:attr"``) and its arguments, recorded in
            the manifest.
        checkpoint_every: every this many steps, before the step, the recorder saves and notes a
            DCP checkpoint of the model and optimizer under ``checkpoint_dir`` (``step-N``: the state
            entering step N); 0: none (a replay then has nothing to start from).
        options, inject: the :class:`~sdc_forensics.recorder.Recorder`'s.

    Returns:
        The :class:`TitanRecording` (a context manager: ``with sdc.record(...): trainer.train()``
        closes its recorder), also ``trainer.sdc_recorder``.
    """
    import torch

    problem = _refusal(trainer, pipeline=True)
    if problem is None and not callable(getattr(trainer, "train_step", None)):
        problem = "this trainer has no train_step to record each step around"
    if problem is None and not isinstance(trainer.optimizers, torch.optim.Optimizer):
        problem = "trainer.optimizers is not a torch Optimizer (torchtitan's OptimizersContainer is one)"
    if problem is None and checkpoint_every and checkpoint_dir is None:
        problem = "checkpoint_every needs a checkpoint_dir to write the checkpoints to"
    if problem is None and checkpoint_every < 0:
        problem = f"checkpoint_every must be >= 0, not {checkpoint_every}"
    if (
        problem is None
        and checkpoint_every
        and len(trainer.model_parts) > 1
        and not _own_state_dict(trainer.optimizers)
    ):
        problem = (
            "forensic checkpoints of several model parts need torchtitan's OptimizersContainer (its state_dict keys "
            "the optimizer state by parameter name across the parts): pass it as trainer.optimizers, or checkpoint_every=0"
        )
    if problem is not None:
        from sdc_forensics.integrations._common import refuse

        raise refuse(f"sdc-forensics cannot record this torchtitan trainer: {problem}")
    rotating = _rotation(trainer, checkpoint_dir) if checkpoint_every else None
    if rotating is not None:
        from sdc_forensics.integrations._common import warn_rotation

        warn_rotation(rotating)
    recording = TitanRecording(
        trainer,
        trace_dir,
        microbatch_ids=microbatch_ids,
        recipe=recipe,
        recipe_args=recipe_args,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=checkpoint_dir,
        options=options,
        inject=inject,
    )
    trainer.train_step = recording.train_step
    trainer.sdc_recorder = recording
    train = getattr(trainer, "train", None)
    # the trace closed however train() ends (an exception, an alarm, KeyboardInterrupt)
    if callable(train):

        def closing_train(*args, **kwargs):
            try:
                out = train(*args, **kwargs)
            except BaseException as exc:
                recording.close(on_error=True, exc=exc)
                raise
            recording.close()
            return out

        trainer.train = closing_train
    return recording


class TitanRecording:
    """What :func:`record` installs: the recorder, made at the first step, around ``train_step``.

    The recorder is built when the first step begins, not when ``record`` is called: torchtitan's
    ``train()`` loads its checkpoint first, so only then does ``trainer.step`` say where a resumed
    run starts (the attempt's first step). A context manager: leaving it closes the recorder.
    """

    def __init__(
        self,
        trainer,
        trace_dir,
        *,
        microbatch_ids,
        recipe,
        recipe_args,
        checkpoint_every,
        checkpoint_dir,
        options,
        inject,
    ) -> None:
        self.trainer, self.trace_dir = trainer, trace_dir
        self.recorder = None
        self._ids, self._every, self._dir = microbatch_ids, checkpoint_every, checkpoint_dir
        self._kwargs = {"recipe": recipe, "recipe_args": recipe_args, "inject": inject}
        self._options = options
        self._start = 0
        self._train_step = trainer.train_step

    def _open(self):
        import dataclasses

        from sdc_forensics.integrations import _common
        from sdc_forensics.recorder import Recorder, RecorderOptions

        trainer = self.trainer
        # torchtitan adds one before each train_step: this is the attempt's first
        self._start = int(trainer.step)
        options = dataclasses.replace(self._options or RecorderOptions(), start_step=self._start)
        self.recorder = Recorder(
            self.trace_dir,
            # a pipeline job: its schedule (the stages, the microbatch count, the gradients' scaling)
            trainer.pp_schedule if _pipelined(trainer) else trainer.model_parts[0],
            trainer.optimizers,
            options=options,
            framework=_common.framework_info("torchtitan", "sdc_forensics.integrations.torchtitan"),
            **self._kwargs,
        )

    def train_step(self, *args, **kwargs):
        from pathlib import Path

        if self.recorder is None:
            self._open()
        trainer, rec = self.trainer, self.recorder
        step = int(trainer.step)
        if self._every and (step - self._start) % self._every == 0:
            from sdc_forensics.integrations import _common

            # a resumed run re-saving a step of an earlier attempt: a new name, as rank 0 finds it (never over the old one)
            path = _rank0_says(_common.unused_path(Path(self._dir) / f"step-{step:08d}"))
            rec.checkpoint(step, path, _state(trainer))
        ids = None if self._ids is None else [int(i) for i in self._ids(trainer)]
        with rec.step(step, microbatch_ids=ids):
            return self._train_step(*args, **kwargs)

    def close(self, *, on_error: bool = False, exc: BaseException | None = None) -> None:
        """Close the recorder (``on_error``: training is leaving on an exception, ``exc`` when
        known) and give the trainer its own ``train_step`` back. Idempotent."""
        from sdc_forensics.integrations import _common

        self.trainer.train_step = self._train_step
        if on_error:
            _common.close_on_error(self.recorder, exc)
        elif self.recorder is not None:
            self.recorder.close(on_error=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close(on_error=exc[0] is not None, exc=exc[1])


def _own_state_dict(optimizers) -> bool:
    """Whether the optimizer defines its own ``state_dict`` (torchtitan's ``OptimizersContainer``)."""
    import torch

    return type(optimizers).state_dict is not torch.optim.Optimizer.state_dict


def _state(trainer) -> dict:
    """What a forensic checkpoint saves: ``{"model", "optim"}``. The model's is every model part's
    (a pipeline rank's stages: their whole-model names, as torchtitan's ``ModelWrapper`` merges
    them). The optimizer's state is torchtitan's own flat, name-keyed one where its container
    defines it (``OptimizersContainer`` overrides ``state_dict``, which ``get_state_dict`` cannot
    read), else ``get_state_dict``'s (one model part: ``record`` refuses several without it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

    parts, optimizers = trainer.model_parts, trainer.optimizers
    if _own_state_dict(optimizers):
        model_state = {key: value for part in parts for key, value in get_model_state_dict(part).items()}
        return {"model": model_state, "optim": optimizers.state_dict()}
    model_state, optim_state = get_state_dict(parts[0], optimizers)
    return {"model": model_state, "optim": optim_state}


def _rank0_says(value):
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _replicated(param) -> bool:
    return any(p.is_replicate() for p in getattr(param, "placements", ()) or ())
