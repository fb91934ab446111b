"""A PyTorch Lightning job (``strategy="ddp"``) recorded with ``SdcCallback``: a tiny LightningModule
made here, a synthetic map-style dataset, ``accumulate_grad_batches=2``, ``gradient_clip_val``,
AdamW and a per-step warmup schedule, ``ModelCheckpoint`` every ``--save-steps`` optimizer steps.
One process per rank with the launcher's environment::

    python -c 'import tests.integrations.pljob as j; j.run()' --trace T --out O [--steps 6] [--inject SPEC] [--resume CKPT]
        [--policy raise] [--interrupt-at STEP]
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from torch import nn

from tests.integrations.launch import run_and_leave

FEATURES, CLASSES, SAMPLES = 8, 4, 40


class Tiny(L.LightningModule):
    def __init__(self, width: int = 16, lr: float = 2e-2, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, width), nn.LayerNorm(width), nn.Tanh(), nn.Dropout(dropout), nn.Linear(width, CLASSES)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TinySharded(Tiny):
    """The same module sharded in ``configure_model`` (``ModelParallelStrategy``: FSDP2 on the data-parallel mesh)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net[4], mesh=mesh)
        fully_shard(self.net, mesh=mesh)  # the module training_step calls: its forward gathers the rest


class Interrupt(L.Callback):
    """Ctrl+C inside optimizer step ``step`` (after the recording callback began it), on every rank."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(3000 + int(index)))
        return x, x[:CLASSES].argmax()


def make_dataset() -> Points:
    return Points()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--resume", default=None, help="fit(ckpt_path=...): a checkpoint to resume from")
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="dropout before the last layer (replayed: the callback seeds it)"
    )
    parser.add_argument(
        "--policy", default="continue", help="the recorder's policy: raise stops training at an alarm (exit 18)"
    )
    parser.add_argument(
        "--interrupt-at", type=int, default=None, help="raise KeyboardInterrupt on every rank inside this step"
    )
    opts = parser.parse_args(argv)

    from sdc_forensics.integrations.lightning import SdcCallback
    from sdc_forensics.recorder import RecorderOptions, exit_on_alarm

    L.seed_everything(0, verbose=False)
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=opts.out, every_n_train_steps=opts.save_steps, save_top_k=-1, filename="{step}"
    )
    world = int(os.environ["WORLD_SIZE"])
    sharded = opts.strategy == "model_parallel"  # FSDP2 through Lightning: the ordered reduce-scatter certifies it
    record = SdcCallback(
        opts.trace,
        dataset="tests.integrations.pljob:make_dataset",
        options=RecorderOptions(policy=opts.policy, reduction="ordered" if sharded else "native"),
        inject=opts.inject,
    )
    strategy = opts.strategy
    if sharded:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=opts.steps,
        accumulate_grad_batches=1 if sharded else 2,
        gradient_clip_val=0.0 if sharded else 0.5,
        callbacks=[checkpoints, record, *([Interrupt(opts.interrupt_at)] if opts.interrupt_at is not None else [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=4, shuffle=True)
    module = (TinySharded if sharded else Tiny)(dropout=opts.dropout)
    with exit_on_alarm():  # an online check's alarm: one line and exit 18 (on_exception closed the trace)
        trainer.fit(module, train_dataloaders=loader, ckpt_path=opts.resume)


def run() -> None:
    """``main()`` as a launched rank runs it (``launch.run_and_leave``)."""
    run_and_leave(main)
