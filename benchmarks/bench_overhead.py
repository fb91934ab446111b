"""Recorder overhead: median optimizer-step time with and without the recorder, in the same run.

Reference setting (printed with the figures):

* ``W`` = 2 ``gloo`` processes on CPU, ``torch.set_num_threads(1)`` each (one core per rank).
* Model: an MLP classifier of ``--layers`` square ``--width`` x ``--width`` linear layers with
  GELU (default 4 x 1024 x 1024: 4.2 M float32 parameters, 16.8 MB of gradients per rank),
  cross-entropy over ``--width`` classes.
* Per rank and step: 2 microbatches of ``--rows`` rows (default 8192), accumulated under
  ``no_sync``; AdamW. About ``6 * params * rows * 2`` = 413 GFLOP per rank-step: the arithmetic
  intensity of a real job's step (16 k samples or tokens per rank per step), not a toy. The
  recorder's cost per step is fixed (a few passes over gradients and weights) plus the input
  digest, so its relative overhead falls as the work per step grows: ``--rows`` shows it.
* Two identical DDP models in the same processes; steps alternate between the recorded one
  and the bare one, so drift of the machine hits both equally. The recorder fingerprints every
  step (local and reduced gradient, weights digest), runs the all-reduce and weights checks
  every step and writes the trace; audits are off in the timed comparison.
* Audits are timed separately: a few extra recorded steps with an audit each (one extra
  forward and backward of a rank's microbatches, plus a tiebreak only on a mismatch).

Usage::

    python benchmarks/bench_overhead.py [--steps 15] [--width 1024] [--layers 4] [--rows 1024] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_forensics.demo.run import train_step

WORLD_SIZE = 2
MICROBATCHES = 2


class BenchRecipe:
    """A recipe for the benchmark model (audits fetch microbatches by ID through it)."""

    def __init__(self, width: int = 1024, layers: int = 4, rows: int = 1024) -> None:
        self.width, self.layers, self.rows = width, layers, rows

    def build(self, device="cpu"):
        torch.manual_seed(0)
        blocks = []
        for _ in range(self.layers):
            blocks += [nn.Linear(self.width, self.width), nn.GELU()]
        model = nn.Sequential(*blocks[:-1]).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None

    def fetch_microbatch(self, microbatch_id, device="cpu"):
        gen = torch.Generator().manual_seed(int(microbatch_id))
        x = torch.randn(self.rows, self.width, generator=gen)
        labels = torch.randint(0, self.width, (self.rows,), generator=gen)
        return x.to(device), labels.to(device)

    def loss(self, model, microbatch):
        inputs, labels = microbatch
        return nn.functional.cross_entropy(model(inputs), labels) / MICROBATCHES

    def load_checkpoint(self, path, model, optimizer, scheduler):
        raise NotImplementedError("the benchmark never resumes")


#: Configured by the parent through the environment, so audits can load it by reference.
recipe = BenchRecipe(
    width=int(os.environ.get("SDC_BENCH_WIDTH", 1024)),
    layers=int(os.environ.get("SDC_BENCH_LAYERS", 4)),
    rows=int(os.environ.get("SDC_BENCH_ROWS", 1024)),
)


def _step(ddp, optimizer, batches, handle=None) -> None:
    train_step(ddp, optimizer, recipe, batches, len(batches), handle)


def _parts_ms(model: nn.Module) -> dict[str, float]:
    """Median cost of the recorder's per-step passes over a model of this size, measured alone."""
    from sdc_forensics.fingerprint.core import fingerprint
    from sdc_forensics.statedict import weights_digest

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def _ms(fn) -> float:
        fn()
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            runs.append(1000 * (time.perf_counter() - start))
        return round(statistics.median(runs), 2)

    return {
        "fingerprint_of_gradient": _ms(lambda: fingerprint(flat)),  # x2 per step: local and reduced
        "weights_digest": _ms(lambda: weights_digest(model.named_parameters())),
        "one_read_pass_sum": _ms(lambda: flat.sum()),
    }


def _worker(rank: int, port: int, args: argparse.Namespace, out: str, trace_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=600))
    from sdc_forensics.recorder import Recorder, RecorderOptions

    model_rec, opt_rec, _ = recipe.build()
    model_bare, opt_bare, _ = recipe.build()
    ddp_rec, ddp_bare = DistributedDataParallel(model_rec), DistributedDataParallel(model_bare)
    warmup, steps = 2, args.steps
    audit_steps = tuple(range(warmup + steps, warmup + steps + args.audit_steps))
    rec = Recorder(trace_dir, ddp_rec, opt_rec, recipe="bench_overhead:recipe",
                   options=RecorderOptions(audit_steps=audit_steps, node_of_rank=tuple(range(WORLD_SIZE))))
    times: dict[str, list[float]] = {"recorded": [], "bare": [], "audited": []}
    cpu: dict[str, list[float]] = {"recorded": [], "bare": [], "audited": []}  # process CPU seconds
    for step in range(warmup + steps + args.audit_steps):
        ids = [(step * WORLD_SIZE + rank) * MICROBATCHES + m for m in range(MICROBATCHES)]
        batches = [recipe.fetch_microbatch(i) for i in ids]
        order = ("recorded", "bare") if step % 2 == 0 else ("bare", "recorded")
        for kind in order if step < warmup + steps else ("recorded",):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            if kind == "bare":
                _step(ddp_bare, opt_bare, batches)
            else:
                with rec.step(step, microbatch_ids=ids) as handle:
                    _step(ddp_rec, opt_rec, batches, handle)
            elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
            if step >= warmup:
                times["audited" if step in audit_steps else kind].append(elapsed)
                cpu["audited" if step in audit_steps else kind].append(cpu_s)
    rec.close()
    dist.barrier()
    trace_bytes = sum(p.stat().st_size for p in Path(trace_dir).glob("rank-*.sdct"))
    if rank == 0:
        params = sum(p.numel() for p in model_rec.parameters())
        Path(out).write_text(json.dumps({"times": times, "cpu": cpu, "params": params, "trace_bytes": trace_bytes, "parts_ms": _parts_ms(model_rec)}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps of each kind (interleaved)")
    parser.add_argument("--audit-steps", type=int, default=3, help="extra recorded steps with an audit each")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8192, help="rows per microbatch (2 microbatches per rank-step)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    os.environ.update(SDC_BENCH_WIDTH=str(args.width), SDC_BENCH_LAYERS=str(args.layers), SDC_BENCH_ROWS=str(args.rows))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(_worker, args=(port, args, out, str(Path(tmp) / "trace")), nprocs=WORLD_SIZE)
        result = json.loads(Path(out).read_text())
    times = result["times"]
    bare, recorded = statistics.median(times["bare"]), statistics.median(times["recorded"])
    audited = statistics.median(times["audited"]) if times["audited"] else float("nan")
    figures = {
        "setting": f"W={WORLD_SIZE} gloo CPU, 1 thread/rank, MLP {args.layers}x{args.width}^2 ({result['params'] / 1e6:.2f} M params), "
        f"{MICROBATCHES} x {args.rows} rows per rank-step, AdamW",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "steps_per_kind": len(times["bare"]),
        "median_step_s_bare": round(bare, 4),
        "median_step_s_recorded": round(recorded, 4),
        "overhead_pct": round(100 * (recorded / bare - 1), 2),
        # the two steps of a pair ran back to back: their ratio cancels the machine's slower drifts
        "paired_overhead_pct": round(100 * (statistics.median(r / b for r, b in zip(times["recorded"], times["bare"])) - 1), 2),
        # CPU seconds of rank 0's process: what the recorder costs, whatever else the machine runs
        "median_step_cpu_s_bare": round(statistics.median(result["cpu"]["bare"]), 4),
        "median_step_cpu_s_recorded": round(statistics.median(result["cpu"]["recorded"]), 4),
        "cpu_overhead_pct": round(100 * (statistics.median(result["cpu"]["recorded"]) / statistics.median(result["cpu"]["bare"]) - 1), 2),
        "median_step_s_audited": round(audited, 4),
        "audit_overhead_pct": round(100 * (audited / bare - 1), 1),
        "recorder_parts_ms": result["parts_ms"],
        "trace_bytes_per_rank_step": result["trace_bytes"] // (WORLD_SIZE * (len(times["recorded"]) + len(times["audited"]) + 2)),
        "note": "trace bytes include the file headers and the AUDIT records of the audited steps",
    }
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    else:
        for key, value in figures.items():
            print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()
