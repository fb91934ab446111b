"""Speed-up of a replay shared across processes (``torchrun``, gloo, CPU) over the single-process replay.

A clean run of the demo job is recorded (``W`` = 6 gloo ranks, a wide MLP of the demo recipe,
``DemoRecipe(in_features=512, hidden=1024, microbatch_size=512)``: 1.6 M parameters, two
microbatches of 512 per rank and step, so that a rank's step is compute worth sharing, not only
gradient bytes to move). Then the same replay (``replay_from_trace``, steps ``0..S-1`` from checkpoint 0:
every rank's local gradient, the exchange, the average in gloo's ring order, the optimizer step,
every comparison) runs with 1 process (no launcher: the single-process path) and under
``torchrun --standalone --nproc-per-node P`` for P = 2 and 3, interleaved (repetition *i* of every
P, then *i + 1*), ``--repeat`` times. Each process times the replay alone, between two barriers
(process start, torch import and the rendezvous are not timed); process 0 reports. Every replay
must come out ``exact`` and clean, or the benchmark fails.

The figure: (median seconds with 1 process) / (median seconds with P processes). Original rank
``r`` goes to process ``r % P``: with ``W`` = 6, two processes compute 3 ranks each and three
compute 2, so the ideal is 2x and 3x; the average, the optimizer step and the comparisons are
done by every process (not shared) and the exchange is added. **This machine has 2 cores**: the
ceiling is 2x for any P (3 processes share 2 cores), less with the machine's other load, and each
replay process runs at the thread count the steps recorded (1).

``--intervals K`` measures the other way of sharing instead: whole checkpoint intervals. The
clean run is recorded with ``K`` + 1 checkpoint intervals of ``--steps`` steps each, and the
whole ``bisect`` (``forensics.bisect.bisect``: it replays the last interval with the ranks of each
step shared, then widens backwards over the other ``K``) is timed with 1 process, and with 2 and 3
processes twice: as the product runs it (the ``K`` intervals dealt out whole, each replayed by
one process alone, when ``distributed.intervals_pay`` says so) and with that rule forced off
(every interval's steps rank-shared), side by side. Every bisect must come out clean, every
window exact.

    python benchmarks/bench_distributed_replay.py [--repeat 3] [--steps 6] [--intervals K] [--quick] [--json]

``--json`` prints ``{"replay_speedup_2proc": {"value", "unit": "x", "goal": null, "met": null, ...},
"replay_speedup_3proc": {...}}`` on stdout (with ``--intervals``: ``bisect_speedup_{P}proc`` and
``bisect_speedup_{P}proc_ranks_only``); people's lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDE = {"in_features": 512, "hidden": 1024, "microbatch_size": 512}
WORLD_SIZE = 6
PROCESSES = (1, 2, 3)
CEILING = 2.0  # cores of the machine these figures were measured on


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(trace: str, steps: int, mode: str) -> None:
    """One replay process (or the only one): time the replay between barriers, process 0 prints it."""
    import importlib

    import torch
    import torch.distributed as dist

    # imported before the timer: the replay's modules, and torch's compiler stack, which
    # torch.use_deterministic_algorithms imports on first use (seconds, not replay)
    for name in ("sdc_forensics.replay.replayer", "torch._inductor"):
        importlib.import_module(name)

    from sdc_forensics.fingerprint.core import digest
    from sdc_forensics.replay import distributed
    from sdc_forensics.forensics.replay import ReplayRequest, replay_from_trace

    torch.use_deterministic_algorithms(False)
    digest(torch.zeros(64), 0)  # the compiled digest kernel is loaded on first use: not replay either
    group = distributed.start("cpu", 600.0)
    if group is not None:
        dist.barrier()
    if mode == "bisect-ranks":
        distributed.intervals_pay = lambda *args, **kwargs: False  # the rule forced off: every step rank-shared
    started = time.perf_counter()
    if mode == "replay":
        run = replay_from_trace(trace, ReplayRequest(start_step=0, stop_step=steps - 1))
        outcome = {
            "verdict": run.decision.verdict.value,
            "comparison": run.result.comparison,
            "last_step": run.result.last_step,
        }
    else:
        from sdc_forensics.forensics.bisect import BisectOptions, bisect

        result = bisect(trace, BisectOptions())
        windows = result.replayed.windows
        outcome = {
            "verdict": result.verdict.value,
            "comparison": "exact" if all(w.comparison == "exact" for w in windows) else "tolerant",
            "last_step": max(w.last for w in windows) if windows else -1,
        }
    if group is not None:
        dist.barrier()
    seconds = time.perf_counter() - started
    if distributed.is_lead():
        print(json.dumps({"seconds": seconds, **outcome}), flush=True)
    distributed.finish(True)


def _replay(trace: Path, steps: int, processes: int, mode: str = "replay") -> float:
    script = [str(Path(__file__).resolve()), "--worker", str(trace), "--steps", str(steps), "--mode", mode]
    cmd = (
        [sys.executable, *script]
        if processes == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--rdzv-endpoint=localhost:{_free_port()}",
            f"--nproc-per-node={processes}",
            *script,
        ]
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(lines) != 1:
        raise SystemExit(f"replay with {processes} process(es) failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    doc = json.loads(lines[0])
    if (doc["verdict"], doc["comparison"], doc["last_step"]) != ("clean", "exact", steps - 1):
        raise SystemExit(
            f"replay with {processes} process(es) was not an exact clean replay of steps 0..{steps - 1}: {doc}"
        )
    return float(doc["seconds"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per process count (median)")
    parser.add_argument("--steps", type=int, default=6, help="steps recorded and replayed")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    parser.add_argument("--quick", action="store_true", help="2 repetitions, 3 steps")
    parser.add_argument(
        "--intervals",
        type=int,
        default=0,
        metavar="K",
        help="time the whole bisect over K+1 checkpoint intervals of --steps steps: intervals shared out whole vs ranks only",
    )
    parser.add_argument("--worker", metavar="TRACE", help=argparse.SUPPRESS)
    parser.add_argument(
        "--mode", default="replay", choices=("replay", "bisect", "bisect-ranks"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.mode)
        return 0
    if args.quick:
        args.repeat, args.steps = 2, 3
    if args.intervals:
        return _intervals(args)
    from sdc_forensics.demo.run import RECIPE_REFERENCE, run_demo

    with tempfile.TemporaryDirectory(prefix="bench-dist-replay-") as work:
        out = Path(work) / "run"
        print(f"recording a clean run: {WORLD_SIZE} ranks, {args.steps} steps, DemoRecipe({WIDE})", file=sys.stderr)
        run_demo(
            out,
            injections=("none",),
            steps=args.steps,
            checkpoint_every=args.steps,
            world_size=WORLD_SIZE,
            recipe=RECIPE_REFERENCE,
            recipe_args=WIDE,
        )
        seconds: dict[int, list[float]] = {p: [] for p in PROCESSES}
        for i in range(args.repeat):
            for p in PROCESSES:
                seconds[p].append(_replay(out / "trace", args.steps, p))
                print(f"repetition {i + 1}: {p} process(es): {seconds[p][-1]:.2f} s", file=sys.stderr)
    median = {p: statistics.median(v) for p, v in seconds.items()}
    figures = {}
    for p in PROCESSES[1:]:
        figures[f"replay_speedup_{p}proc"] = {
            "value": round(median[1] / median[p], 3),
            "unit": "x",
            "goal": None,
            "met": None,
            "ideal": round(WORLD_SIZE / -(-WORLD_SIZE // p), 3),
            "ceiling_this_machine": CEILING,
            "median_seconds": round(median[p], 3),
            "median_seconds_1proc": round(median[1], 3),
            "runs_seconds": [round(s, 3) for s in seconds[p]],
            "runs_seconds_1proc": [round(s, 3) for s in seconds[1]],
            "steps": args.steps,
            "world_size": WORLD_SIZE,
            "cpus": os.cpu_count(),
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
    for name, fig in figures.items():
        print(
            f"{name}: {fig['value']}x (ideal {fig['ideal']}x; this {fig['cpus']}-core machine caps it near {CEILING}x, "
            f"less under its load {fig['load_average_1min']}); median {fig['median_seconds']} s vs {fig['median_seconds_1proc']} s",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    return 0


def _intervals(args) -> int:
    from sdc_forensics.demo.run import RECIPE_REFERENCE, run_demo

    total = args.steps * (args.intervals + 1)
    runs = [(1, "bisect")] + [(p, mode) for p in PROCESSES[1:] for mode in ("bisect", "bisect-ranks")]
    seconds: dict[tuple, list[float]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory(prefix="bench-dist-bisect-") as work:
        out = Path(work) / "run"
        print(
            f"recording a clean run: {WORLD_SIZE} ranks, {total} steps, a checkpoint every {args.steps}, DemoRecipe({WIDE})",
            file=sys.stderr,
        )
        run_demo(
            out,
            injections=("none",),
            steps=total,
            checkpoint_every=args.steps,
            world_size=WORLD_SIZE,
            recipe=RECIPE_REFERENCE,
            recipe_args=WIDE,
        )
        for i in range(args.repeat):
            for p, mode in runs:
                seconds[(p, mode)].append(_replay(out / "trace", total, p, mode))
                print(f"repetition {i + 1}: {p} process(es), {mode}: {seconds[(p, mode)][-1]:.2f} s", file=sys.stderr)
    median = {run: statistics.median(v) for run, v in seconds.items()}
    base = median[(1, "bisect")]
    figures = {}
    for p, mode in runs[1:]:
        name = f"bisect_speedup_{p}proc" + ("_ranks_only" if mode == "bisect-ranks" else "")
        figures[name] = {
            "value": round(base / median[(p, mode)], 3),
            "unit": "x",
            "goal": None,
            "met": None,
            "ceiling_this_machine": CEILING,
            "median_seconds": round(median[(p, mode)], 3),
            "median_seconds_1proc": round(base, 3),
            "runs_seconds": [round(x, 3) for x in seconds[(p, mode)]],
            "runs_seconds_1proc": [round(x, 3) for x in seconds[(1, "bisect")]],
            "intervals_shared": args.intervals,
            "steps_per_interval": args.steps,
            "world_size": WORLD_SIZE,
            "cpus": os.cpu_count(),
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
        print(
            f"{name}: {figures[name]['value']}x; median {figures[name]['median_seconds']} s vs {base:.2f} s with 1 process",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
