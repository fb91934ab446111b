"""An ``accelerate`` loop recorded with ``sdc_forensics.integrations.accelerate.record``: a tiny model
made here, a synthetic map-style dataset, ``gradient_accumulation_steps=2``, clipping, AdamW and
a warmup schedule, ``save_state`` every ``--save-steps`` optimizer steps (and once before the
loop: checkpoint 0). One process per rank with the launcher's environment::

    python -c 'import tests.integrations.accjob as j; j.run()' --trace T --out O [--steps 6] [--inject SPEC] [--resume DIR]
        [--policy raise] [--interrupt-at STEP]
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from tests.integrations.launch import run_and_leave

FEATURES, CLASSES, SAMPLES = 8, 4, 40


def build_model() -> nn.Module:
    """The model (its weights come from checkpoint 0 at replay)."""
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, CLASSES))


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(2000 + int(index)))
        return x, x[:CLASSES].argmax()


def make_dataset() -> Points:
    return Points()


def loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def make_scheduler(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))


def main(argv: list[str] | None = None) -> None:
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--resume", default=None, help="a save_state folder to load_state from (a resumed attempt)")
    parser.add_argument(
        "--policy", default="continue", help="the recorder's policy: raise stops training at an alarm (exit 18)"
    )
    parser.add_argument(
        "--interrupt-at",
        type=int,
        default=None,
        help="raise KeyboardInterrupt on every rank inside this step, after its first backward (Ctrl+C)",
    )
    opts = parser.parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, make_scheduler(optimizer))

    from sdc_forensics.integrations import accelerate as sdc
    from sdc_forensics.recorder import RecorderOptions, exit_on_alarm

    recording = sdc.record(
        accelerator,
        opts.trace,
        model=model,
        model_fn="tests.integrations.accjob:build_model",
        loss_fn="tests.integrations.accjob:loss",
        dataset="tests.integrations.accjob:make_dataset",
        scheduler_fn="tests.integrations.accjob:make_scheduler",
        max_grad_norm=0.5,
        options=RecorderOptions(policy=opts.policy),
        inject=opts.inject,
    )
    # an online check's alarm: one line and exit 18, the trace closed by the recording's block first
    with exit_on_alarm(), recording:
        if opts.resume is None:
            accelerator.save_state(os.path.join(opts.out, "step-0"))
        else:  # the adapter reads the folder's step from the trace: the resumed attempt starts there
            accelerator.load_state(opts.resume)
        done = recording.completed
        while done < opts.steps:
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(loss(model, batch))
                    if done == opts.interrupt_at:  # step `done` is open in the recorder: Ctrl+C mid-step
                        raise KeyboardInterrupt
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                if accelerator.sync_gradients:
                    done += 1
                    if done % opts.save_steps == 0:
                        accelerator.save_state(os.path.join(opts.out, f"step-{done}"))
                    if done == opts.steps:
                        break


def run() -> None:
    """``main()`` as a launched rank runs it (``launch.run_and_leave``)."""
    run_and_leave(main)
