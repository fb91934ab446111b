"""A training script that is not the demo, written as a user would add the recorder to theirs:
its own model width and seed on the command line (handed to the recipe through
``recipe_args``), its own checkpoint format (the DDP wrapper's ``state_dict``, ``module.``
prefixes and all, or the bare module's), ``exit_on_alarm`` around ``main``. Run one process per
rank with the launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)::

    python -m tests.recorder.userjob --trace T --checkpoints C --width 24 [--seed 3] [--state ddp|bare]
        [--steps 6] [--policy continue|raise] [--inject SPEC] [--preregister-hook]

Each rank writes what ``rec.checkpoint`` returned to ``notes-rankR.json`` next to the checkpoints folder.

The recipe below is referenced as ``tests.recorder.userjob:make_recipe`` (a factory taking the
job's settings): replay imports it with ``PYTHONPATH`` set to the repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch import nn

REFERENCE = "tests.recorder.userjob:make_recipe"
IN_FEATURES, CLASSES, MICROBATCH = 8, 4, 6


@dataclasses.dataclass(kw_only=True)
class WidthRecipe:
    """An MLP whose hidden width and init seed are job settings: a replay that does not know
    them builds a model the checkpoints do not fit."""

    width: int
    seed: int = 0

    def build(self, device="cpu"):
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        model = nn.Sequential(nn.Linear(IN_FEATURES, self.width), nn.Tanh(), nn.Linear(self.width, CLASSES)).to(device)
        torch.random.set_rng_state(gen_state)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None

    def fetch_microbatch(self, microbatch_id, device="cpu"):
        gen = torch.Generator().manual_seed(10_007 + int(microbatch_id))
        inputs = torch.randn(MICROBATCH, IN_FEATURES, generator=gen)
        return inputs.to(device), (inputs.sum(dim=1) > 0).long().to(device) + 2 * (inputs[:, 0] > 0).long().to(device)

    def loss(self, model, microbatch):
        inputs, labels = microbatch
        return nn.functional.cross_entropy(model(inputs), labels)

    def load_checkpoint(self, path, model, optimizer, scheduler):
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        weights = dict(state["model"])
        # the job may save the DDP wrapper's state_dict: its keys carry "module."
        nn.modules.utils.consume_prefix_in_state_dict_if_present(weights, "module.")
        model.load_state_dict(weights)
        optimizer.load_state_dict(state["optimizer"])


def make_recipe(width: int, seed: int = 0) -> WidthRecipe:
    """The factory the manifest names; replay calls it with the recorded ``recipe_args``."""
    return WidthRecipe(width=width, seed=seed)


def _allreduce_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(state, bucket)


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sdc_forensics.recorder import Recorder, RecorderOptions, exit_on_alarm

    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state", choices=("ddp", "bare"), default="ddp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--policy", default="continue")
    parser.add_argument("--inject", action="append", default=[])
    parser.add_argument("--preregister-hook", action="store_true")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    settings = {"width": args.width, "seed": args.seed}
    recipe = make_recipe(**settings)
    model, optimizer, _ = recipe.build("cpu")
    ddp = DistributedDataParallel(model)
    if args.preregister_hook:  # a job that already compresses or wraps its all-reduce
        ddp.register_comm_hook(dist.group.WORLD, _allreduce_hook)
    ckpt_dir = Path(args.checkpoints)
    notes = []
    try:
        with (
            exit_on_alarm(),
            Recorder(
                args.trace,
                ddp,
                optimizer,
                recipe=REFERENCE,
                recipe_args=settings,
                inject=args.inject,
                options=RecorderOptions(policy=args.policy, checkpoint_every=2),
            ) as rec,
        ):

            def checkpoint(step: int) -> None:
                weights = ddp.state_dict() if args.state == "ddp" else model.state_dict()
                note = rec.checkpoint(
                    step,
                    ckpt_dir / f"step-{step:08d}.pt",
                    state={"model": weights, "optimizer": optimizer.state_dict()},
                )
                notes.append(
                    {
                        "type": type(note).__name__,
                        "step": note.step,
                        "path": note.path,
                        "param_names": list(note.param_names),
                        "path_from_trace": note.path_from_trace,
                        "blessed": note.blessed,
                    }
                )

            checkpoint(0)
            for step in range(args.steps):
                ids = [step * world_size + rank]
                with rec.step(step, microbatch_ids=ids) as s:
                    batch = s.input(recipe.fetch_microbatch(ids[0], "cpu"))
                    loss = recipe.loss(ddp, batch)
                    loss.backward()
                    s.loss(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                if (step + 1) % 2 == 0:
                    checkpoint(step + 1)
        dist.barrier()  # as a job ends: every rank done with its collectives before any rank tears down gloo
    except Exception:  # noqa: BLE001 - the job fails as Python would (traceback, exit 1), but now
        # tearing gloo down at interpreter exit while the DDP model still holds the group can abort
        # the process ("terminate called without an active exception", exit -6) on a loaded machine:
        # the flaky failure of test_a_model_with_a_comm_hook_is_refused_before_anything_is_written
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if notes:
            Path(args.checkpoints).parent.joinpath(f"notes-rank{rank}.json").write_text(json.dumps(notes))
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    code = 0
    try:
        main()
    except SystemExit as stop:  # exit_on_alarm's code 18
        code = stop.code if isinstance(stop.code, int) else 1
    # and no interpreter teardown: DDP keeps the gloo group alive past destroy_process_group
    # (torch 2.13), and tearing it down at exit while peers close their sockets can abort a rank
    # (SIGABRT) after the job is done: torch's race, which this test job does not take part in
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
