"""What the ordered reduction costs against DDP's own all-reduce, side by side in one run (issue 21).

For each world size ``W`` and bucket size, ``W`` gloo processes on this machine time, alternately,
``--reps`` times each:

* ``native``: what DDP does without a comm hook (the bucket scaled by ``1/W``, then
  ``all_reduce(SUM)``: gloo's ring);
* ``ordered``: ``RecorderOptions(reduction="ordered")``'s reduction (``recorder/ordered.py``:
  ``all_to_all_single``, a left-to-right sum in rank order, ``all_gather``).

Every process measures; the table gives the median over repetitions of the slowest process's time
(a collective ends when its last rank does) and the ratio ordered / native. Then, with ``--step``,
the training-time cost on a whole step: the conv net demo recipe, ``W`` = 4 gloo ranks, recorded,
native vs the ordered reduction (on CPU the rest of :func:`sdc_forensics.recorder.replayable`,
the deterministic-algorithm flags, changes no kernel), median step time of each (from the
trace's STEP record times), alternating runs.

    python benchmarks/bench_reduction.py [--world-sizes 2 4 8] [--sizes-mb 1 25 100] [--reps 5] [--step] [--json]

Timings on a shared machine are noisy: read the ratios, measured side by side, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _native(buffer: torch.Tensor, world_size: int) -> None:
    buffer.mul_(1.0 / world_size)
    dist.all_reduce(buffer)


def _worker(rank: int, world_size: int, port: int, sizes_mb: list[float], reps: int, out: str) -> None:
    from sdc_forensics.recorder.ordered import _ordered_all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    results = {}
    try:
        for size_mb in sizes_mb:
            numel = int(size_mb * 2**20) // 4
            source = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            buffer = source.clone()
            times = {"native": [], "ordered": []}
            for rep in range(reps + 1):  # the first round warms up (allocations, connections)
                for kind in ("native", "ordered") if rep % 2 == 0 else ("ordered", "native"):
                    buffer.copy_(source)
                    dist.barrier()
                    started = time.perf_counter()
                    if kind == "native":
                        _native(buffer, world_size)
                    else:
                        _ordered_all_reduce(buffer, dist.group.WORLD, average=True)
                    elapsed = time.perf_counter() - started
                    if rep:
                        times[kind].append(elapsed)
            results[str(size_mb)] = times
        gathered = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def measure_reduction(world_size: int, sizes_mb: list[float], reps: int) -> list[dict]:
    """Rows ``{world_size, size_mb, native_s, ordered_s, ratio}`` for one world size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.start_processes(
            _worker, args=(world_size, _free_port(), sizes_mb, reps, out), nprocs=world_size, start_method="spawn"
        )
        per_rank = json.loads(Path(out).read_text())
    rows = []
    for size_mb in sizes_mb:
        key = str(size_mb)
        slowest = {
            kind: [max(r[key][kind][i] for r in per_rank) for i in range(reps)] for kind in ("native", "ordered")
        }
        native, ordered = statistics.median(slowest["native"]), statistics.median(slowest["ordered"])
        rows.append(
            {
                "world_size": world_size,
                "size_mb": size_mb,
                "native_s": round(native, 5),
                "ordered_s": round(ordered, 5),
                "ratio": round(ordered / native, 2),
            }
        )
    return rows


def _median_step_s(trace_dir: Path, steps: int) -> float:
    """Median time between consecutive STEP records of the slowest rank (steps 2.., after warm-up)."""
    import numpy as np

    from sdc_forensics.decide.incident import step_times
    from sdc_forensics.trace.reader import Trace

    times = step_times(Trace.open(trace_dir), range(steps))  # {step: (R,) ns}
    ends = np.array([times[s].max() for s in range(1, steps)], dtype=np.float64)
    return float(np.median(np.diff(ends))) / 1e9


def measure_step(steps: int, blocks: int) -> dict:
    """Median step time of the conv net demo, 4 gloo ranks recorded, native vs the ordered reduction
    (what replayable() changes on CPU: deterministic-algorithm flags change no CPU kernel here)."""
    from sdc_forensics.demo.run import DemoConfig, run_config

    times = {"native": [], "ordered": []}
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(blocks):
            for kind in ("native", "ordered") if block % 2 == 0 else ("ordered", "native"):
                config = DemoConfig(
                    out_dir=Path(tmp) / f"{kind}-{block}",
                    steps=steps,
                    checkpoint_every=steps,
                    recipe="sdc_forensics.demo.convnet:recipe",
                    reduction=kind,
                )
                run_config(config)
                times[kind].append(_median_step_s(config.trace_dir, steps))
    native, ordered = statistics.median(times["native"]), statistics.median(times["ordered"])
    return {
        "native_step_s": round(native, 4),
        "ordered_step_s": round(ordered, 4),
        "ratio": round(ordered / native, 3),
        "steps": steps,
        "blocks": blocks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 25, 100])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--step", action="store_true", help="also the whole-step cost of replayable() on the conv net demo"
    )
    parser.add_argument("--step-blocks", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [row for w in args.world_sizes for row in measure_reduction(w, args.sizes_mb, args.reps)]
    doc = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "reps": args.reps,
        "rows": rows,
    }
    if args.step:
        doc["step"] = measure_step(steps=20, blocks=args.step_blocks)
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
        return
    print(f"{doc['machine']}, median of {args.reps} (slowest rank each)")
    print("| W | bucket | native all-reduce | ordered | ordered / native |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['world_size']} | {r['size_mb']:g} MB | {r['native_s'] * 1e3:.1f} ms | {r['ordered_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x |"
        )
    if args.step:
        s = doc["step"]
        print(
            f"conv net step, 4 ranks recorded: native {s['native_step_s'] * 1e3:.1f} ms, ordered {s['ordered_step_s'] * 1e3:.1f} ms, "
            f"ratio {s['ratio']:.3f} (median over {s['blocks']} alternating runs of {s['steps']} steps)"
        )


if __name__ == "__main__":
    sys.exit(main())
