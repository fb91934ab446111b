"""What the FSDP2/HSDP online checks catch: a fault campaign on real ``fully_shard`` jobs (gloo, CPU).

One process group of 4 ranks runs every trial one after another (a fresh model, mesh and
monitor per trial, so no spawn per trial): ``--faults`` single-bit (or NaN) faults at a random
location, rank, step and bit, and ``--clean`` runs with none. The job is ``demo/sharded.py``'s
tied-head transformer (its embedding is its head: one parameter, in the root's group) trained
with AdamW (two parameter groups) and ``clip_grad_norm_(model.parameters(), MAX_NORM)`` on its
DTensor parameters between the checks and the update, a limit far below its gradient norm, so
clipping engages on every step (the output says on how many). Locations:

* ``local-gradient``: a bit of the rank's local gradient before the reduce-scatter (a finite
  flip is summed consistently: no online check can see it, only a replay or an audit);
* ``local-gradient-nan``: a NaN there;
* ``reduce-scatter-output``: a bit of the rank's reduce-scatter output (``watch``/``check``);
* ``all-reduce-output``: HSDP 2 x 2, a bit of the rank's replica all-reduce output;
* ``gathered``: a bit of the rank's all-gathered copy of the tied embedding (``check_gathered``);
* ``weights-shard``: HSDP 2 x 2, a bit of the rank's shard of the tied embedding
  (``check_shards``: 2 replicas detect, cannot attribute).

A trial is **exact** when the check names exactly the faulty rank at the fault's step,
**detected** when it fires at that step but names another set (or nobody, by design with 2
replicas), **missed** when nothing fires, and a clean run with any alarm is a **false alarm**.
Results per location and per bit class (sign, exponent, high/low mantissa), with the seed.

Usage::

    .venv/bin/python benchmarks/fsdp_campaign.py --faults 120 --clean 10 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

WORLD = 4
STEPS = 3
LOCATIONS = (
    "local-gradient",
    "local-gradient-nan",
    "reduce-scatter-output",
    "all-reduce-output",
    "gathered",
    "weights-shard",
)
#: the clipping limit: the tied transformer's gradient norm is several times larger at every step
MAX_NORM = 0.05
#: the parameter the weight drills flip: the embedding, which is also the head
TIED = "embed.weight"


def bit_class(bit: int) -> str:
    if bit == 31:
        return "sign"
    if bit >= 23:
        return "exponent"
    return "mantissa-high" if bit >= 16 else "mantissa-low"


def _flip(tensor: torch.Tensor, index: int, bit: int, nan: bool) -> None:
    with torch.no_grad():
        flat = tensor.reshape(-1)
        index %= flat.numel()
        if nan:
            flat[index] = float("nan")
        else:
            flat.view(torch.int32)[index] ^= (1 << bit) if bit < 31 else -(1 << 31)


def _trial(rank: int, fault: dict | None) -> dict:
    """One short job with the checks on; returns ``{"fired": {step: suspects} of the steps whose
    checks fired, "updated": steps that updated the weights, "clipped": those on which clipping
    scaled the gradients down}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sdc_forensics.demo import sharded
    from sdc_forensics.recorder.fsdp_checks import check_gathered, check_shards
    from sdc_forensics.recorder.fsdp_monitor import watch

    hsdp = fault is not None and fault["location"] in ("all-reduce-output", "weights-shard")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = sharded.shard(sharded.build_model(0, "tied-lm"), mesh)
    now = [0]

    def hits(location: str) -> bool:
        return fault is not None and fault["step"] == now[0] and fault["rank"] == rank and fault["location"] == location

    def inject(location: str, call: int, tensor: torch.Tensor) -> None:
        name = (
            "local-gradient-nan"
            if fault and fault["location"] == "local-gradient-nan" and location == "local-gradient"
            else location
        )
        if call == fault_call and hits(name):
            _flip(tensor, fault["index"], fault["bit"], nan=name.endswith("nan"))

    def corrupt(name: str, tensor: torch.Tensor) -> None:
        if name == TIED and (hits("gathered") or hits("weights-shard")):
            _flip(tensor, fault["index"], fault["bit"], nan=False)

    fault_call = fault["call"] if fault else 0
    monitor = watch(model, inject=inject)
    optimizer = sharded.make_optimizer(model, "adamw")
    fired, clipped, updated = {}, 0, 0
    for step in range(STEPS):
        now[0] = step
        sharded.loss_of(model, sharded.microbatch(step * WORLD + rank, model="tied-lm")).backward()
        suspects = set(monitor.check(step).suspects)
        found = monitor_fired = bool(suspects)
        gathered = check_gathered(model, corrupt=corrupt if fault and fault["location"] == "gathered" else None)
        shards = check_shards(model, corrupt=corrupt if fault and fault["location"] == "weights-shard" else None)
        for result in (gathered, shards):
            if not result.clean:
                found = True
                suspects |= set(result.suspects)
        if found:
            fired[step] = sorted(suspects)
        finite = all(torch.isfinite(p.grad.to_local()).all() for p in model.parameters() if p.grad is not None)
        skip = torch.tensor([float(monitor_fired and not finite)])
        dist.all_reduce(skip, op=dist.ReduceOp.MAX)  # every rank skips alike: the clipping below is a collective
        if skip.item():
            optimizer.zero_grad()
            continue
        norm = sharded.clip(model, MAX_NORM)  # after the checks, as a job's loop clips after backward
        clipped += int(norm.full_tensor().item() > MAX_NORM)
        updated += 1
        optimizer.step()
        optimizer.zero_grad()
    return {"fired": fired, "clipped": clipped, "updated": updated}


def _worker(rank: int, port: int, plan_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=300),
    )
    results = []
    try:
        for fault in json.loads(Path(plan_path).read_text()):
            results.append(_trial(rank, fault))
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def plan(faults: int, clean: int, seed: int) -> list[dict | None]:
    rng = random.Random(seed)
    trials: list[dict | None] = [None] * clean
    for i in range(faults):
        location = LOCATIONS[i % len(LOCATIONS)]
        trials.append(
            {
                "location": location,
                "rank": rng.randrange(WORLD),
                "step": rng.randrange(STEPS),
                "call": rng.randrange(3),
                "bit": rng.randrange(32),
                "index": rng.randrange(1 << 20),
            }
        )
    rng.shuffle(trials)
    return trials


def judge(fault: dict | None, fired: dict) -> str:
    if fault is None:
        return "false-alarm" if fired else "clean"
    at = fired.get(str(fault["step"]), fired.get(fault["step"]))
    if at is None:
        return "missed"
    return (
        "exact"
        if at == [fault["rank"]] and len(fired) >= 1 and min(int(s) for s in fired) == fault["step"]
        else "detected"
    )


def run(faults: int, clean: int, seed: int) -> tuple[list[dict | None], list[dict] | None, list[tuple[int, int]]]:
    """``(trials, what fired in each, (steps clipped, steps updated) in each)`` of a campaign;
    ``None`` for the second when ranks disagree."""
    import torch.multiprocessing as mp

    here = Path(__file__).resolve()
    for path in (str(here.parents[1]), str(here.parent)):  # the children import this module by name
        if path not in sys.path:
            sys.path.insert(0, path)
    from tests.factories import free_port

    trials = plan(faults, clean, seed)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp, "plan.json")
        plan_path.write_text(json.dumps(trials))
        mp.start_processes(_worker, args=(free_port(), str(plan_path), tmp), nprocs=WORLD, start_method="spawn")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    agreed = all(r == per_rank[0] for r in per_rank)
    return (
        trials,
        ([t["fired"] for t in per_rank[0]] if agreed else None),
        [(t["clipped"], t["updated"]) for t in per_rank[0]],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=120)
    parser.add_argument("--clean", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.time()
    trials, fired, clipped = run(args.faults, args.clean, args.seed)
    if fired is None:
        print("fsdp_campaign: ranks disagree on a result (the checks must decide together)", file=sys.stderr)
        return 1
    outcomes = [judge(f, seen) for f, seen in zip(trials, fired)]
    by_location: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_bits: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for fault, outcome in zip(trials, outcomes):
        key = "clean run" if fault is None else fault["location"]
        by_location[key][outcome] += 1
        if fault is not None and fault["location"] not in ("local-gradient-nan",):
            by_bits[f"{fault['location']} / {bit_class(fault['bit'])}"][outcome] += 1
    cpu = os.cpu_count()
    print(
        f"# FSDP2/HSDP online checks: {args.faults} faults, {args.clean} clean runs, seed {args.seed}, "
        f"{WORLD} gloo ranks, torch {torch.__version__}, {cpu} CPUs, {time.time() - started:.0f} s"
    )
    print(
        f"# tied-head transformer, AdamW, clip_grad_norm_ to {MAX_NORM}: clipping engaged on "
        f"{sum(c for c, _ in clipped)} of the {sum(u for _, u in clipped)} steps that updated"
    )
    print()
    print("| location | trials | exact | detected, other ranks | missed | false alarm |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for key in list(LOCATIONS) + ["clean run"]:
        c = by_location.get(key, collections.Counter())
        print(f"| {key} | {sum(c.values())} | {c['exact']} | {c['detected']} | {c['missed']} | {c['false-alarm']} |")
    print()
    print("| location / bit class | trials | exact | detected | missed |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for key in sorted(by_bits):
        c = by_bits[key]
        print(f"| {key} | {sum(c.values())} | {c['exact']} | {c['detected']} | {c['missed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
