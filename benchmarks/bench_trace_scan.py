"""Trace scan throughput: triage by the compiled kernels vs the numpy path vs orjson JSON lines.

Builds a synthetic trace (default 1,024 ranks x 20,000 steps, the recorder's 216-byte records,
4.4 GB; ``--trace DIR`` reuses one), then, side by side in one run:

* **fast**: ``Trace.open`` + ``triage_trace`` with the compiled kernels
  (``SDC_FORENSICS_KERNELS=on``, ``trace/scan.py``): checksums of every record, per-step
  strict-majority consensus of weights and reduced digests, the all-reduce residual from
  sketches against the calibrated tolerance, NaN/Inf, audits, missing steps; outlier hints off,
  as in the JSON baseline, and again with them on (``bisect --trace-only`` runs with them);
* **numpy**: the same with ``SDC_FORENSICS_KERNELS=off``, the scan as it was before the kernels;
* **orjson**: what a user would otherwise write: the same records as JSON lines (one file per
  rank) parsed with ``orjson``, the same consensus and residual per step with numpy, on the
  first ``--baseline-steps`` steps (it is slow), its rate extrapolated per rank-step.

Reports rank-steps per second (median of ``--repeat`` runs), the ratios, which path ran, the
peak traced heap (``tracemalloc``) of the fast path on traces of 1/4, 1/2 and all of the steps,
and the time of the very first call on a machine (a subprocess with an empty numba cache).

    python benchmarks/bench_trace_scan.py [--ranks 1024] [--steps 20000] [--repeat 3] [--quick] [--json]

``--json`` prints ``{name: {value, unit, goal, met}}`` on stdout (people's lines go to stderr);
``--quick`` runs 256 ranks x 8,000 steps in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from sdc_forensics.fingerprint import tolerance
from sdc_forensics.triage.trace_only import TriageOptions, triage_trace
from sdc_forensics.trace import scan
from sdc_forensics.trace.reader import Trace
from sdc_forensics.trace.synthetic import PlantedFault, write_synthetic_trace

GOAL_RANK_STEPS_PER_S = 5e6
#: Heap at all steps over heap at 1/4 of them, at most: "flat in steps".
GOAL_HEAP_GROWTH = 1.1
#: The first call on a machine compiles the kernels; a CLI must not stall like a 15 s compile.
GOAL_COLD_S = 15.0


CPU_SECONDS: dict[str, list[float]] = {}


def ours(
    trace_dir: Path, *, kernels: bool, outliers: bool = False, stop_step: int | None = None
) -> tuple[float, int, object]:
    """One ``Trace.open`` + ``triage_trace``: (seconds, rank-steps, result). The process's CPU
    seconds go to :data:`CPU_SECONDS` (a figure that a busy shared machine disturbs less)."""
    os.environ[scan.KERNELS_ENV] = "on" if kernels else "off"
    try:
        start, cpu = time.perf_counter(), time.process_time()
        trace = Trace.open(trace_dir)
        result = triage_trace(trace, TriageOptions(outliers=outliers, stop_step=stop_step))
        seconds = time.perf_counter() - start
        CPU_SECONDS.setdefault(f"{result.scan_path}{' hints' if outliers else ''}", []).append(
            time.process_time() - cpu
        )
    finally:
        del os.environ[scan.KERNELS_ENV]
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
                handle.write(
                    orjson.dumps(
                        {
                            "step": int(r["step"]),
                            "rank": rank,
                            "loss": float(r["loss"]),
                            "weights_digest": f"{int(r['weights_digest']):016x}",
                            "reduced_digest": f"{int(r['reduced_digest']):016x}",
                            "local_norm": float(r["local_norm"]),
                            "reduced_norm": float(r["reduced_norm"]),
                            "local_sketch": r["local_sketch"].tolist(),
                            "reduced_sketch": r["reduced_sketch"].tolist(),
                        }
                    )
                    + b"\n"
                )
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


def heap_peak(trace_dir: Path) -> int:
    """Peak traced heap (bytes) of one fast triage."""
    tracemalloc.start()
    try:
        ours(trace_dir, kernels=True)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


_COLD = """
import sys, time
from sdc_forensics.triage.trace_only import triage_trace
from sdc_forensics.trace.reader import Trace
trace = Trace.open(sys.argv[1])
start = time.perf_counter()
result = triage_trace(trace)
print(time.perf_counter() - start, result.scan_path)
"""


def cold_first_call(trace_dir: Path, cache_dir: Path) -> tuple[float, str]:
    """Seconds of the first ``triage_trace`` in a fresh process with an empty numba cache."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), **{scan.KERNELS_ENV: "on"})
    out = subprocess.run(
        [sys.executable, "-c", _COLD, str(trace_dir)], env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    return float(out[0]), out[1]


def make_trace(path: Path, ranks: int, steps: int, fault_step: int, audit_every: int = 0) -> Path:
    faults = (
        PlantedFault(kind="weights", step=fault_step, rank=ranks // 3),
        PlantedFault(kind="allreduce-all", step=fault_step + 1, rank=0),
    )
    trace_dir = write_synthetic_trace(path, num_ranks=ranks, num_steps=steps, faults=faults)
    if audit_every:
        add_audits(trace_dir, ranks, audit_every)
    return trace_dir


def add_audits(trace_dir: Path, ranks: int, audit_every: int) -> None:
    """Interleave AUDIT records as a recorder writes them (rank r recomputes rank r + 1's
    microbatch every ``audit_every`` steps, agreeing): files are no longer dense, so the scan
    takes its cursor path, and triage reads the audited steps' input digests."""
    from sdc_forensics.fingerprint import constants as C
    from sdc_forensics.trace import format as F

    dtype = F.record_dtype(8)
    for rank in range(ranks):
        path = trace_dir / f"rank-{rank:05d}.attempt-000.sdct"
        header = path.read_bytes()[: F.HEADER_SIZE]
        recs = np.fromfile(path, dtype=dtype, offset=F.HEADER_SIZE)
        at = np.flatnonzero(recs["step"] % audit_every == 0)
        subject = (rank + 1) % ranks
        audit = recs[at].copy()
        audit["kind"] = int(F.Kind.AUDIT)
        audit["flags"] = int(F.Flag.CONTIGUOUS_IDS)
        audit["aux_rank"] = subject
        own = C.splitmix64(
            audit["step"].astype(np.uint64) * np.uint64(1000) + np.uint64(subject)
        )  # the subject's local_digest
        audit["aux_digest"] = own
        audit["local_digest"] = own
        audit["input_digest"] = 0
        merged = np.insert(recs, at + 1, F.seal(audit))
        with open(path, "wb") as fh:
            fh.write(header)
            fh.write(merged.tobytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--baseline-steps", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="an existing synthetic trace to scan (its fault at --baseline-steps // 2)",
    )
    parser.add_argument(
        "--audit-every", type=int, default=0, help="interleave AUDIT records every N steps (files not dense)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="256 ranks x 8,000 steps, 300 JSON steps: well under a minute"
    )
    parser.add_argument("--json", action="store_true", help="print {name: {value, unit, goal, met}} on stdout")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.steps, args.baseline_steps = 256, 8_000, 300
    out = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    fault_step = args.baseline_steps // 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        trace_dir = args.trace or make_trace(root / "trace", args.ranks, args.steps, fault_step, args.audit_every)
        opened = Trace.open(trace_dir)
        ranks, (first, last) = opened.world_size, opened.step_range()
        steps = last - first + 1
        size_mb = sum(p.stat().st_size for p in Path(trace_dir).iterdir() if p.is_file()) / 1e6
        say(
            f"trace: {ranks} ranks x {steps} steps, {size_mb:.0f} MB"
            + ("" if args.trace else f", written in {time.perf_counter() - t0:.1f} s")
        )
        write_jsonl(trace_dir, root / "jsonl", args.baseline_steps)
        say(
            f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; numba {'present' if scan._import_kernels() else 'missing'}"
        )

        cold_s, cold_path = cold_first_call(make_trace(root / "small", 8, 64, 10), root / "numba-cache")
        fast, fast_hints, slow, base = [], [], [], []
        for _ in range(args.repeat):
            seconds, rank_steps, result = ours(trace_dir, kernels=True)
            fast.append(rank_steps / seconds)
            seconds, rank_steps, hinted = ours(trace_dir, kernels=True, outliers=True)
            fast_hints.append(rank_steps / seconds)
            seconds, rank_steps, reference = ours(trace_dir, kernels=False)
            slow.append(rank_steps / seconds)
            b_seconds, b_count, b_div, b_bad = baseline(root / "jsonl")
            base.append(b_count / b_seconds)
        path = result.scan_path
        assert reference.scan_path == scan.NUMPY
        assert result.evidence == reference.evidence and result.damage == reference.damage, (
            "the fast path disagrees with numpy"
        )
        assert result.first_suspect_step is not None and result.first_suspect_step <= fault_step, (
            result.first_suspect_step
        )
        assert b_div and b_div[0] == fault_step and b_bad == [fault_step + 1], (b_div[:3], b_bad[:3])
        fast_med, hints_med, slow_med, base_med = (statistics.median(v) for v in (fast, fast_hints, slow, base))
        runs = lambda values: ", ".join(f"{v / 1e6:.2f}" for v in values)  # noqa: E731
        say(
            f"fast ({path}), no hints:     {fast_med / 1e6:8.2f} M rank-steps/s  (median of {args.repeat}: {runs(fast)})"
        )
        say(
            f"fast ({hinted.scan_path}), outlier hints: {hints_med / 1e6:5.2f} M rank-steps/s  (median of {args.repeat}: {runs(fast_hints)})"
        )
        say(
            f"numpy path (kernels off):   {slow_med / 1e6:8.2f} M rank-steps/s  (median of {args.repeat}: {runs(slow)})"
        )
        say(f"orjson JSON lines + numpy:  {base_med / 1e6:8.3f} M rank-steps/s  (first {args.baseline_steps} steps)")
        say(f"fast / numpy: {fast_med / slow_med:.1f} x;  fast / orjson: {fast_med / base_med:.1f} x")
        say(
            "CPU seconds per run (both cores together): "
            + "; ".join(f"{k}: {', '.join(f'{v:.2f}' for v in vs)}" for k, vs in CPU_SECONDS.items())
        )
        say(f"first call on a machine (empty numba cache, {cold_path}): {cold_s:.1f} s")

        say("peak traced heap of the fast path, traces of 1/4, 1/2 and all of the steps (window 1,024 steps):")
        heaps = []
        for fraction in (4, 2, 1):
            part_steps = steps // fraction
            part = (
                trace_dir
                if fraction == 1
                else make_trace(
                    root / f"part{fraction}", ranks, part_steps, min(fault_step, part_steps - 2), args.audit_every
                )
            )
            heaps.append(heap_peak(part))
            say(f"  {part_steps:6d} steps: {heaps[-1] / 1e6:7.1f} MB")
            if part != trace_dir:
                for p in part.iterdir():
                    p.unlink()
        growth = heaps[-1] / heaps[0]

    figures = {
        "trace_scan_rank_steps_per_s": {
            "value": fast_med,
            "unit": "rank-steps/s",
            "goal": GOAL_RANK_STEPS_PER_S,
            "goal_op": ">=",
            "met": fast_med >= GOAL_RANK_STEPS_PER_S,
        },
        "trace_scan_with_hints_rank_steps_per_s": {
            "value": hints_med,
            "unit": "rank-steps/s",
            "goal": GOAL_RANK_STEPS_PER_S,
            "goal_op": ">=",
            "met": hints_med >= GOAL_RANK_STEPS_PER_S,
        },
        "trace_scan_fast_over_numpy": {"value": fast_med / slow_med, "unit": "x", "goal": None, "met": None},
        "trace_scan_fast_over_orjson": {"value": fast_med / base_med, "unit": "x", "goal": None, "met": None},
        "trace_scan_heap_growth_quarter_to_all": {
            "value": growth,
            "unit": "x",
            "goal": GOAL_HEAP_GROWTH,
            "goal_op": "<=",
            "met": growth <= GOAL_HEAP_GROWTH,
        },
        "trace_scan_heap_peak_bytes": {"value": heaps[-1], "unit": "bytes", "goal": None, "met": None},
        "trace_scan_first_call_cold_s": {
            "value": cold_s,
            "unit": "s",
            "goal": GOAL_COLD_S,
            "goal_op": "<",
            "met": cold_s < GOAL_COLD_S,
        },
        "trace_scan_path": {"value": path, "unit": "", "goal": scan.NUMBA, "goal_op": "=", "met": path == scan.NUMBA},
        "trace_scan_size": {"value": f"{ranks} ranks x {steps} steps", "unit": "", "goal": None, "met": None},
    }
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
