"""One replay window: the checks before it (device, placement, the checkpoint's hostile-input
checks and read limits, the memory plan), then the replayer that fits the trace.

Its own module above ``replay/replayer.py`` (the one-process replay) and
``replay/sharded_replayer.py`` (a sharded job at its size, issue 35), which builds on the first:
the choice between them is made here, so neither imports the other's chooser (no two-way import).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from sdc_forensics import numerics
from sdc_forensics.checkpoint.formats import open_checkpoint
from sdc_forensics.errors import CheckpointError
from sdc_forensics.replay import distributed, env, pp, pp_exact, replayer, sharded, tp, tp_exact
from sdc_forensics.replay.pp import PpReplayer
from sdc_forensics.replay.pp_exact import PpExactReplayer
from sdc_forensics.replay.replayer import Replayer, ReplayOptions, ReplayResult
from sdc_forensics.replay.sharded_replayer import ShardedReplayer
from sdc_forensics.replay.tp import TpReplayer
from sdc_forensics.replay.tp_exact import TpExactReplayer
from sdc_forensics.trace.reader import Trace


def replay_window(
    trace: Trace, recipe, options: ReplayOptions, on_step: Callable[[int], None] | None = None
) -> ReplayResult:
    """Replay one window with deterministic settings on the requested device.

    Args:
        trace: the open trace.
        recipe: a recipe object (``sdc_forensics.recipe.load_recipe``).
        options: :class:`ReplayOptions`.
        on_step: called after each replayed step (progress).

    Raises:
        UsageError: the device is unavailable, or is a suspect's GPU and not forced.
        CheckpointError: the checkpoint file is malformed, beyond the read limits, or needs a pickle
            global outside the allow-list (checked by the package's readers before the recipe loads it).
        StartStateMismatch: the checkpoint does not hold the weights the replicas agreed on.
    """
    device = env.resolve_device(options.device)
    # every process alike
    distributed.check_placement(device, trace, options.suspect_gpus, options.force_device)
    env.check_not_suspect(device, options.suspect_gpus, options.force_device)
    # per-step counts are applied step by step
    threads = options.num_threads or replayer._recorded_threads(trace)
    if not (
        Path(options.checkpoint_path).is_file() or Path(options.checkpoint_path).is_dir()
        # a folder: a Trainer's checkpoint-N
    ):
        raise CheckpointError(
            f"checkpoint {options.checkpoint_path} (step {options.start_step}) does not exist; pass --checkpoints DIR"
        )
    with open_checkpoint(
        options.checkpoint_path
        # the hostile-input checks and read limits, before the recipe's own torch.load
    ) as opened:
        infos = opened.infos()
    if pp_exact.wanted(trace, recipe):
        # a pipeline job at its layout: one stage per process (PP x TP of them) under torchrun, exact; the
        # memory plan counts each process's part of the model, not the whole
        pp_exact.check_memory(trace, options, device, infos)
        replayer_class = PpExactReplayer
    else:
        # the memory plan refuses a replay that cannot fit; a sharded job that does not fit one process is replayed sharded
        replayer_class = ShardedReplayer if sharded.dispatch(trace, options, device, infos) else Replayer
        # a tensor-parallel job: its TP plan on TP processes under torchrun, exact; else each rank's TP boxes, tolerant
        if tp.is_tp(trace):
            replayer_class = TpExactReplayer if tp_exact.wanted(trace, recipe) else TpReplayer
        # a pipeline job: the whole model on one process, exact (the stages hand activations over as they are)
        elif pp.is_pp(trace):
            replayer_class = PpReplayer
    with numerics.reproduce(replayer._recorded_numerics(trace, options.start_step), device, threads) as settings:
        result = replayer_class(trace, recipe, device).run(options, on_step)
    return dataclasses.replace(result, settings=settings)
