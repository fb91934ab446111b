"""Throughput of the exact digest, the sketch and the full fingerprint, as a ratio to ``torch.sum``.

For each dtype (float32, bfloat16) and size (64 MB .. 1 GB of tensor), on the chosen device
(CPU here, CUDA when present: ``--device cuda``), it times ``torch.sum`` (one read pass, the
yardstick), ``core.digest``, ``core.fingerprint(with_digest=False)`` (sketch and stats) and
``core.fingerprint`` (everything), interleaved run by run so that a noisy neighbour hits all
four alike, and prints the median of ``--runs`` runs as milliseconds and as a multiple of the
sum. The goal of the design brief: a full fingerprint costs at most 2x ``torch.sum``. It also
prints the extra peak memory of a full fingerprint (CUDA: allocator peak above the tensor;
CPU, Linux: peak RSS above the RSS before the call), which must stay bounded (no full-size
temporaries), and the load average, since on a shared machine that moves CPU timings a lot.

Usage::

    .venv/bin/python benchmarks/bench_fingerprint.py --runs 5
    .venv/bin/python benchmarks/bench_fingerprint.py --device cuda --sizes-mb 64 256 1024 4096
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

import torch

from sdc_forensics.fingerprint import core

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OPS = ("sum", "digest", "sketch", "full")


def _ops(tensor: torch.Tensor) -> dict:
    return {
        "sum": lambda: tensor.sum(),
        "digest": lambda: core.digest(tensor),
        "sketch": lambda: core.fingerprint(tensor, with_digest=False),
        "full": lambda: core.fingerprint(tensor),
    }


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _extra_peak_mb(tensor: torch.Tensor) -> float:
    """Peak memory a full fingerprint needs beyond the tensor, in MB."""
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
        torch.cuda.reset_peak_memory_stats(tensor.device)
        base = torch.cuda.memory_allocated(tensor.device)
        core.fingerprint(tensor)
        torch.cuda.synchronize(tensor.device)
        return (torch.cuda.max_memory_allocated(tensor.device) - base) / 1e6
    _reset_peak_rss()
    before = _rss_kib("VmRSS")
    core.fingerprint(tensor)
    return (_rss_kib("VmHWM") - before) * 1024 / 1e6


def _reset_peak_rss() -> None:
    """Linux: reset the process's peak RSS (VmHWM) to its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) from /proc, in KiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def bench_one(dtype: torch.dtype, size_mb: int, device: torch.device, runs: int) -> dict:
    """Median seconds of each op over ``runs`` interleaved runs, and the extra peak memory."""
    numel = size_mb * 1_000_000 // torch.tensor([], dtype=dtype).element_size()
    torch.manual_seed(0)
    tensor = torch.randn(numel, dtype=dtype, device=device)
    extra_mb = _extra_peak_mb(tensor)  # first call also warms caches and tables
    ops = _ops(tensor)
    times = {name: [] for name in OPS}
    for _ in range(runs):
        for name in OPS:
            times[name].append(_timed(ops[name], device))
    del tensor
    return {"median": {name: statistics.median(t) for name, t in times.items()}, "extra_mb": extra_mb}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{_cpu_model()}, {os.cpu_count()} cores"
    load_before = os.getloadavg()[0]
    print(f"# Fingerprint throughput on {device} ({where}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    print()
    print("| dtype | size | sum | digest | sketch | full | full GB/s | extra peak memory |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for dtype_name in args.dtypes:
        for size_mb in args.sizes_mb:
            result = bench_one(DTYPES[dtype_name], size_mb, device, args.runs)
            med = result["median"]
            ratios = " | ".join(f"{med[name] * 1e3:.0f} ms ({med[name] / med['sum']:.1f}x)" for name in OPS[1:])
            print(
                f"| {dtype_name} | {size_mb} MB | {med['sum'] * 1e3:.0f} ms | {ratios} | "
                f"{size_mb / 1e3 / med['full']:.2f} | {result['extra_mb']:.0f} MB |"
            )
    print()
    print(f"median of {args.runs} interleaved runs; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
