"""What starting W ranks costs: ``spawn`` against the fork server of ``sdc_forensics.demo.forked``.

Each launch starts ``W`` ranks that do what the demo's ranks do before their first step: join a
gloo process group, build a small model and its SGD optimizer (``torch.optim`` imports
``torch._dynamo`` on a process's first optimizer), fingerprint a gradient (numba loads the
kernels), then leave. Four ways, alternating, ``--reps`` launches each, in one run:

* ``spawn``: ``torch.multiprocessing.start_processes(..., start_method="spawn")``, each rank
  importing everything itself (what the tests' gloo jobs did);
* ``forkserver``: a fork server that imported torch only, stopped after each launch (what the
  demo did before ``forked.py``);
* ``forked, first``: ``sdc_forensics.demo.forked.start`` with no server running: the server
  preloads torch._dynamo and the kernels, then forks the ranks (the CLI's one demo run);
* ``forked, next``: the same again, the server kept from the launch before (a test session's or
  a campaign's second and later runs).

Prints the median wall seconds of a launch for each, and each one's ratio to ``spawn``.

    python benchmarks/bench_fork_start.py [--world 4] [--reps 5] [--json]

Timings on a shared machine are noisy: read the ratios, measured side by side, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from sdc_forensics.fingerprint.core import fingerprint

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(8, 64)).sum().backward()
        fingerprint(model.weight.grad)
        optimizer.step()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(way: str, world: int) -> float:
    import torch.multiprocessing as mp

    from sdc_forensics.demo import forked

    if way != "forked, next":  # every other way starts from no fork server
        forked.stop_server()
    started = time.perf_counter()
    if way.startswith("forked"):
        forked.start(_rank, (world, free_port()), world)
    else:
        if way == "forkserver":
            mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
        mp.start_processes(_rank, args=(world, free_port()), nprocs=world, start_method=way)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ways = ("spawn", "forkserver", "forked, first", "forked, next")
    times: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.reps):
        for way in ways:
            times[way].append(_launch(way, args.world))
    median = {w: statistics.median(t) for w, t in times.items()}
    from campaign import machine  # benchmarks/campaign.py: CPU model, cores, memory, torch, commit

    result = {
        "machine": machine(),
        "python": sys.version.split()[0],
        "world": args.world,
        "reps": args.reps,
        "median_s": median,
        "ratio_to_spawn": {w: median[w] / median["spawn"] for w in ways},
        "runs_s": times,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    where = result["machine"]
    print(
        f"{args.world} ranks, median of {args.reps} launches each (alternating); {where['cpu']}, {where['cores']} cores, "
        f"torch {where['torch']}, commit {where['commit']}"
    )
    print(f"{'way':<15}{'median s':>10}{'vs spawn':>10}")
    for way in ways:
        print(f"{way:<15}{median[way]:>10.2f}{median[way] / median['spawn']:>10.2f}")


if __name__ == "__main__":
    main()
