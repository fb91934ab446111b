"""Trace scan throughput: sdc-forensics' vectorised triage vs reading JSON lines with orjson.

Builds a synthetic trace (default 256 ranks x 10,000 steps, the recorder's 216-byte records),
then, side by side in one run:

* **ours**: ``Trace.open`` + ``triage_trace`` (checksums of every record, per-step strict-majority
  consensus of weights digests, the all-reduce residual from sketches against the calibrated
  tolerance, NaN/Inf, audits), window by window; outlier hints off, as in the baseline;
* **baseline**: what a user would otherwise write: the same records as JSON lines (one file per
  rank), parsed with ``orjson`` line by line, the same consensus and residual computed per step
  with numpy. The baseline runs on the first ``--baseline-steps`` steps (it is slow) and its rate
  is extrapolated per rank-step.

Reports rank-steps per second (median of ``--repeat`` runs), the ratio, and the peak traced
memory (``tracemalloc``) of ours at 1/4, 1/2 and all of the steps, to show it stays flat.

    python benchmarks/bench_trace_scan.py [--ranks 256] [--steps 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from sdc_forensics.fingerprint import tolerance
from sdc_forensics.forensics.triage import TriageOptions, triage_trace
from sdc_forensics.trace.reader import Trace
from sdc_forensics.trace.synthetic import PlantedFault, write_synthetic_trace


def ours(trace_dir: Path, stop_step: int | None = None) -> tuple[float, int, object]:
    start = time.perf_counter()
    trace = Trace.open(trace_dir)
    result = triage_trace(trace, TriageOptions(outliers=False, stop_step=stop_step))
    seconds = time.perf_counter() - start
    bounds = result.step_range
    last = bounds[1] if stop_step is None else min(stop_step, bounds[1])
    return seconds, (last - bounds[0] + 1) * trace.world_size, result


def write_jsonl(trace_dir: Path, out_dir: Path, num_steps: int) -> None:
    import orjson

    trace = Trace.open(trace_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    handles = [open(out_dir / f"rank-{r:05d}.jsonl", "wb") for r in range(trace.world_size)]
    for window in trace.step_windows(window=1024, stop=num_steps - 1):
        rec = window.records
        for row in range(len(window.steps)):
            for rank, handle in enumerate(handles):
                r = rec[row, rank]
                handle.write(orjson.dumps({
                    "step": int(r["step"]), "rank": rank, "loss": float(r["loss"]),
                    "weights_digest": f"{int(r['weights_digest']):016x}", "reduced_digest": f"{int(r['reduced_digest']):016x}",
                    "local_norm": float(r["local_norm"]), "reduced_norm": float(r["reduced_norm"]),
                    "local_sketch": r["local_sketch"].tolist(), "reduced_sketch": r["reduced_sketch"].tolist(),
                }) + b"\n")
    for handle in handles:
        handle.close()


def baseline(jsonl_dir: Path) -> tuple[float, int, list[int], list[int]]:
    """Per-step consensus and residual from JSON lines; returns (s, rank-steps, diverged steps, residual steps)."""
    import orjson

    start = time.perf_counter()
    files = sorted(jsonl_dir.glob("rank-*.jsonl"))
    handles = [open(f, "rb") for f in files]
    diverged, bad_allreduce, count = [], [], 0
    tol_rel = tolerance.relative_tolerance("float32", len(files))
    while True:
        rows = [orjson.loads(line) for line in (h.readline() for h in handles) if line]
        if not rows:
            break
        count += len(rows)
        digests = [r["weights_digest"] for r in rows]
        majority = max(set(digests), key=digests.count)
        if digests.count(majority) * 2 <= len(digests) or any(d != majority for d in digests):
            diverged.append(rows[0]["step"])
        local = np.array([r["local_sketch"] for r in rows], dtype=np.float64)
        reduced = np.array([r["reduced_sketch"] for r in rows], dtype=np.float64)
        scale = tolerance.scale(np.array([r["local_norm"] for r in rows]), np.array([r["reduced_norm"] for r in rows]))
        if (np.abs(reduced - local.mean(axis=0)).max(axis=1) > tol_rel * scale).any():
            bad_allreduce.append(rows[0]["step"])
    for handle in handles:
        handle.close()
    return time.perf_counter() - start, count, diverged, bad_allreduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--baseline-steps", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        fault_step = args.baseline_steps // 2
        faults = (PlantedFault(kind="weights", step=fault_step, rank=args.ranks // 3),
                  PlantedFault(kind="allreduce", step=fault_step + 1, rank=0))
        t0 = time.perf_counter()
        trace_dir = write_synthetic_trace(root / "trace", num_ranks=args.ranks, num_steps=args.steps, faults=faults)
        size_mb = sum(p.stat().st_size for p in trace_dir.iterdir() if p.is_file()) / 1e6
        print(f"trace: {args.ranks} ranks x {args.steps} steps, {size_mb:.0f} MB, written in {time.perf_counter() - t0:.1f} s")
        write_jsonl(trace_dir, root / "jsonl", args.baseline_steps)

        ours_rates, base_rates = [], []
        for _ in range(args.repeat):
            seconds, rank_steps, result = ours(trace_dir)
            ours_rates.append(rank_steps / seconds)
            b_seconds, b_count, b_div, b_bad = baseline(root / "jsonl")
            base_rates.append(b_count / b_seconds)
        assert result.first_suspect_step is not None and result.first_suspect_step <= fault_step, result.first_suspect_step
        assert b_div and b_div[0] == fault_step and b_bad == [fault_step + 1], (b_div[:3], b_bad[:3])
        ours_med, base_med = statistics.median(ours_rates), statistics.median(base_rates)
        print(f"ours (triage_trace):     {ours_med / 1e6:8.2f} M rank-steps/s  (median of {args.repeat}; runs {[f'{r / 1e6:.2f}' for r in ours_rates]})")
        print(f"baseline (orjson jsonl): {base_med / 1e6:8.3f} M rank-steps/s  (first {args.baseline_steps} steps)")
        print(f"ratio ours / baseline:   {ours_med / base_med:8.1f} x")

        print("peak traced memory of ours as the trace grows (window fixed):")
        for fraction in (4, 2, 1):
            stop = args.steps // fraction - 1
            tracemalloc.start()
            ours(trace_dir, stop_step=stop)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            print(f"  {stop + 1:6d} steps: {peak / 1e6:7.1f} MB")


if __name__ == "__main__":
    main()
