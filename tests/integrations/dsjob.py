"""A DeepSpeed job recorded with ``sdc_forensics.integrations.deepspeed`` (tests/integrations/test_deepspeed.py),
and its replay recipe.

Launched once per rank (``tests/integrations/launch.py``) with ``DS_ACCELERATOR=cpu``: a small MLP
under ZeRO stage ``--stage`` (fp32, torch's AdamW, clipped at ``--clip`` when it is above 0), one
microbatch per rank-step (ID ``step * W + rank``), a checkpoint every ``--every`` steps from checkpoint 0, written by
``sdc.checkpoint``. The recipe rebuilds the same module and a ``torch.optim.AdamW`` with the settings
the DeepSpeed config gives (its ``before_step`` clips as DeepSpeed did, ``sdc.clip_grad_norm_``), and
loads those checkpoints with ``sdc.load_checkpoint``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
from torch import nn

from sdc_forensics.integrations import deepspeed as sdc
from tests.integrations.launch import run_and_leave

LR = 1e-2
WEIGHT_DECAY = 0.01


@dataclasses.dataclass(kw_only=True)
class MlpRecipe:
    """The job's replay recipe (``tests.integrations.dsjob:recipe``)."""

    width: int = 32
    batch: int = 8
    #: the DeepSpeed config's gradient_clipping (0: none) and the job's data-parallel size, from recipe_args
    clip: float = 0.0
    world: int = 1
    #: the config's gradient_accumulation_steps: engine.backward divides each microbatch's loss by it
    accumulation: int = 1

    def build(self, device="cpu"):
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, self.width), nn.Tanh(), nn.Linear(self.width, 4)).to(device)
        torch.random.set_rng_state(gen_state)
        # what DeepSpeed's {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": true}} builds
        return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY), None

    def fetch_microbatch(self, microbatch_id, device="cpu"):
        gen = torch.Generator().manual_seed(1000 + int(microbatch_id))
        x = torch.randn(self.batch, 16, generator=gen)
        return x.to(device), torch.sin(x[:, :4] * 3).to(device)

    def objective(self, model, microbatch):
        """The loss the training loop hands ``engine.backward``."""
        x, y = microbatch
        return nn.functional.mse_loss(model(x), y)

    def loss(self, model, microbatch):
        # what engine.backward differentiates: the loss over gradient_accumulation_steps (_scale_loss_by_gas)
        return self.objective(model, microbatch) / self.accumulation

    def before_step(self, model, optimizer):
        if self.clip > 0:
            sdc.clip_grad_norm_(optimizer, self.clip, self.world)

    def load_checkpoint(self, path, model, optimizer, scheduler):
        sdc.load_checkpoint(path, model, optimizer)


recipe = MlpRecipe()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--ds-save", default="", help="also engine.save_checkpoint(DIR) after the last step")
    args = parser.parse_args()

    import importlib

    import deepspeed

    # the shared-memory all-reduce serves DeepSpeed's inference only: its JIT C++ build is skipped
    # (``deepspeed.comm.torch`` as an attribute is the torch library, re-exported: import the module by name)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    model, _, _ = recipe.build()
    config = {
        "train_micro_batch_size_per_gpu": recipe.batch,
        "gradient_accumulation_steps": args.accumulation,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = engine.global_rank, engine.dp_world_size
    rec = sdc.record(
        engine,
        args.trace,
        recipe="tests.integrations.dsjob:recipe",
        recipe_args={"clip": args.clip, "world": world, "accumulation": args.accumulation},
        inject=args.inject,
    )
    try:
        sdc.checkpoint(rec, engine, 0, f"{args.out}/step-0.pt")
        for step in range(args.steps):
            # microbatches step * W * k + rank * k + j, j < k (k = gradient_accumulation_steps)
            ids = [(step * world + rank) * args.accumulation + j for j in range(args.accumulation)]
            with rec.step(step, microbatch_ids=ids) as s:
                for mb in ids:
                    loss = recipe.objective(engine, s.input(recipe.fetch_microbatch(mb)))
                    engine.backward(loss)
                    s.loss(loss / args.accumulation)
                    # DeepSpeed's update at the accumulation boundary only (the last microbatch)
                    engine.step()
            if args.clip > 0:
                # what the test reads to know the clip engaged: DeepSpeed's own total norm of the step
                print(f"rank {rank} step {step} grad_norm {float(engine.get_global_grad_norm())!r}", file=sys.stderr)
            if (step + 1) % args.every == 0:
                sdc.checkpoint(rec, engine, step + 1, f"{args.out}/step-{step + 1}.pt")
        if args.ds_save:
            # DeepSpeed's own checkpoint folder (a collective): TAG/mp_rank_00_model_states.pt and the optimizer files
            engine.save_checkpoint(args.ds_save, tag=f"global_step{args.steps}")
    finally:
        rec.close()


def run() -> None:
    run_and_leave(main)
