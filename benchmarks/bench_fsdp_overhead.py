"""What recording a sharded job costs: the FSDP2 (or HSDP) job of ``sdc_forensics/demo/sharded.py``
with the recorder against the same loop without it, side by side on 4 gloo processes.

Each repetition runs, in one process group of ``--world`` ranks, the job bare and recorded
(alternating which goes first), ``--steps`` steps each with a model ``--width`` wide (checkpoints off: their cost is DCP's
and the digest of the state, measured apart by ``bench_verify.py``); the figure is the median over
repetitions of (recorded step time / bare step time) per rank, then the median over ranks.

    python benchmarks/bench_fsdp_overhead.py [--parallel fsdp|hsdp] [--width 512] [--steps 20] [--reps 5] [--world 4]
        [--reduction ordered|native] [--weights-every 1] [--profile]

``--profile``: instead, rank 0's recorded steps under cProfile (the recorder's functions, by
cumulative time): where the overhead goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rep(
    rank: int,
    root: str,
    width: int,
    steps: int,
    hsdp: bool,
    reduction: str,
    first_recorded: bool,
    weights_every: int = 1,
) -> dict:
    import torch.distributed as dist

    return {
        name: _loop_one(
            rank,
            dist.get_world_size(),
            root,
            width,
            steps,
            hsdp,
            reduction,
            name == "recorded",
            weights_every=weights_every,
        )
        for name in (("recorded", "bare") if first_recorded else ("bare", "recorded"))
    }


def _profiled(rank: int, root: str, width: int, steps: int, hsdp: bool, reduction: str) -> str:
    import cProfile
    import io
    import pstats

    import torch.distributed as dist

    profile = cProfile.Profile() if rank == 0 else None
    _loop_one(rank, dist.get_world_size(), root, width, steps, hsdp, reduction, True, profile)
    if profile is None:
        return ""
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("sdc_forensics", 25)
    return text.getvalue()


def _loop_one(
    rank, world, root, width, steps, hsdp, reduction, recorded, profile=None, weights_every: int = 1
) -> float:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.demo import sharded
    from sdc_forensics.recorder import Recorder, RecorderOptions

    mesh = init_device_mesh(
        "cpu", (2, 2) if hsdp else (world,), mesh_dim_names=("replicate", "shard") if hsdp else ("shard",)
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(sharded.IN_FEATURES, width),
        nn.ReLU(),
        nn.LayerNorm(width),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, sharded.CLASSES),
    )
    for layer in (model[0], model[3], model[5]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rec = None
    if recorded:
        trace = Path(tempfile.mkdtemp(dir=root))
        rec = Recorder(
            trace,
            model,
            optimizer,
            recipe=sharded.REFERENCE,
            options=RecorderOptions(policy="continue", reduction=reduction, weights_every=weights_every),
        )
    times = []
    for step in range(steps):
        if profile is not None and step == 2:  # after the first steps' buffers and caches
            profile.enable()
        mb = step * world + rank
        started = time.perf_counter()
        if rec is not None:
            with rec.step(step, microbatch_ids=[mb]) as h:
                loss = sharded.loss_of(model, h.input(sharded.microbatch(mb)))
                h.loss(loss)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        else:
            loss = sharded.loss_of(model, sharded.microbatch(mb))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    if profile is not None:
        profile.disable()
    if rec is not None:
        rec.close()
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", choices=("fsdp", "hsdp"), default="fsdp")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--reduction", choices=("native", "ordered"), default="ordered")
    parser.add_argument(
        "--world", type=int, default=4, help="ranks (HSDP needs 4: 2 x 2); 2 on a 2-core machine gives each its core"
    )
    parser.add_argument(
        "--weights-every",
        type=int,
        default=1,
        help="the weights checks' interval (the shard vote and the gathered parameters' vote; 0: only at checkpoints)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print rank 0's profile of the recorded steps instead")
    args = parser.parse_args(argv)
    from tests.factories import gloo_job

    if args.profile:
        with tempfile.TemporaryDirectory(prefix="sdc-fsdp-profile-") as tmp:
            print(
                gloo_job(
                    _profiled,
                    args.world,
                    Path(tmp, "out"),
                    tmp,
                    args.width,
                    args.steps,
                    args.parallel == "hsdp",
                    args.reduction,
                )[0]
            )
        return

    ratios, bare_ms = [], []
    with tempfile.TemporaryDirectory(prefix="sdc-fsdp-overhead-") as tmp:
        for rep in range(args.reps):
            found = gloo_job(
                _rep,
                args.world,
                Path(tmp, f"rep{rep}"),
                tmp,
                args.width,
                args.steps,
                args.parallel == "hsdp",
                args.reduction,
                rep % 2 == 1,
                args.weights_every,
            )
            ratios.append(statistics.median(r["recorded"] / r["bare"] for r in found))
            bare_ms.append(statistics.median(r["bare"] for r in found) * 1e3)
    params = args.width * (24 + 1) + 2 * args.width + args.width * (args.width + 1) + 5 * (args.width + 1)
    doc = {
        "world": args.world,
        "parallel": args.parallel,
        "reduction": args.reduction,
        "weights_every": args.weights_every,
        "width": args.width,
        "parameters": params,
        "steps": args.steps,
        "reps": args.reps,
        "ratio_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "bare_step_ms_median": round(statistics.median(bare_ms), 2),
    }
    print(
        json.dumps(doc, indent=1)
        if args.json
        else f"{args.parallel} ({args.reduction}), {params:,} parameters, {args.world} gloo ranks: recorded / bare step time = "
        f"{doc['ratio_median']} (median of {args.reps}; each {doc['ratios']}), bare step {doc['bare_step_ms_median']} ms"
    )


if __name__ == "__main__":
    main()
