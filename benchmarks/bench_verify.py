"""Full checkpoint verification of a ~1 GB safetensors file vs ``sha256sum`` and ``cat``.

Full verification = structure (header, offsets, tiling), the exact digest of every tensor, the
NaN/Inf scan of every tensor and the exact digest of the whole file's bytes (the certificate
checksum): ``sdc_forensics.checkpoint.verify_checkpoint``. The file is written to a temporary
directory, read once to warm the page cache, then each contender runs ``--runs`` times and the
median wall time is reported (runs interleaved: run i of every contender, then run i + 1), with GB/s (10^9 bytes) and ratios.

    .venv/bin/python benchmarks/bench_verify.py [--size-gb 1.0] [--runs 5] [--dir /tmp] [--json] [--quick]

``--quick``: a 0.25 GB file, 3 runs, without the two slow contenders (torch intra-op threads,
the CLI). ``--json`` prints ``{"figures": {name: {value, unit, goal, goal_op, met}}, "machine",
"results"}``; ``benchmarks/run_all.py`` reads the figures.

``cat FILE > /dev/null`` is the read limit (page cache to user space); ``sha256sum`` is what
people use to checksum checkpoints today. The CLI row runs ``sdc-forensics verify-checkpoint``
end to end, including interpreter and torch start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def make_file(path: Path, size_gb: float) -> int:
    """A safetensors file of ~``size_gb`` GB: float32 and bfloat16 tensors of mixed sizes."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    target = int(size_gb * 1e9)
    tensors: dict[str, torch.Tensor] = {}
    total, index = 0, 0
    shapes = [(4096, 4096), (4096, 1024), (1024,), (8192, 2048)]
    while total < target:
        shape = shapes[index % len(shapes)]
        dtype = torch.bfloat16 if index % 3 == 2 else torch.float32
        t = torch.randn(shape, generator=gen).to(dtype)
        nbytes = t.numel() * t.element_size()
        if total + nbytes > target and total:
            break
        tensors[f"layers.{index}.{'weight' if len(shape) == 2 else 'bias'}"] = t
        total += nbytes
        index += 1
    save_file(tensors, path)
    return path.stat().st_size


def _cpu_s() -> float:
    """CPU seconds used so far by this process and its finished children."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _time(fn) -> tuple[float, float]:
    """``(wall s, CPU s)`` of one call; CPU time is what an idle machine would need, load or not."""
    wall, cpu = time.perf_counter(), _cpu_s()
    fn()
    return time.perf_counter() - wall, _cpu_s() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write the file (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument("--quick", action="store_true", help="0.25 GB, 3 runs, no slow contenders (for run_all.py)")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gb, args.runs = min(args.size_gb, 0.25), min(args.runs, 3)

    from sdc_forensics.checkpoint import VerifyOptions, verify_checkpoint

    workdir = Path(tempfile.mkdtemp(prefix="bench_verify_", dir=args.dir))
    try:
        path = workdir / "model.safetensors"
        size = make_file(path, args.size_gb)
        subprocess.run(f"cat '{path}' > /dev/null", shell=True, check=True)  # warm the page cache
        report = verify_checkpoint(path)  # warm-up run (also checks the file verifies)
        assert report.ok, report.findings
        options = VerifyOptions()
        contenders = {
            "verify (structure + digests + NaN/Inf + file checksum)": lambda: verify_checkpoint(path, options=options),
            "verify, no file checksum": lambda: verify_checkpoint(path, options=VerifyOptions(file_checksums=False)),
            "verify, torch intra-op threads (workers=1)": lambda: verify_checkpoint(
                path, options=VerifyOptions(workers=1)
            ),
            "sha256sum": lambda: subprocess.run(["sha256sum", str(path)], check=True, stdout=subprocess.DEVNULL),
            "cat > /dev/null": lambda: subprocess.run(f"cat '{path}' > /dev/null", shell=True, check=True),
        }
        if args.quick:
            del contenders["verify, torch intra-op threads (workers=1)"]
        cli = shutil.which("sdc-forensics") or str(Path(sys.executable).with_name("sdc-forensics"))
        if Path(cli).exists() and not args.quick:
            contenders["CLI verify-checkpoint (incl. start-up)"] = lambda: subprocess.run(
                [cli, "verify-checkpoint", str(path)], check=True, stderr=subprocess.DEVNULL
            )
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {name: [] for name in contenders}
        cpu: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.runs):  # interleaved, so that a burst of load hits every contender alike
            for name, fn in contenders.items():
                wall_s, cpu_s = _time(fn)
                times[name].append(wall_s)
                cpu[name].append(cpu_s)
        medians = {name: statistics.median(values) for name, values in times.items()}
        cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    verify_s = medians["verify (structure + digests + NaN/Inf + file checksum)"]
    rows = [
        {
            "what": name,
            "median_s": round(t, 4),
            "GB_per_s": round(size / t / 1e9, 3),
            "vs_verify": round(t / verify_s, 2),
            "cpu_s_per_GB": round(cpu_medians[name] / (size / 1e9), 4),
        }
        for name, t in medians.items()
    ]
    machine = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "file_bytes": size,
        "tensors": len(report.tensors),
        "runs": args.runs,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    cat_s, sha_s = medians["cat > /dev/null"], medians["sha256sum"]
    figures = {
        "verify_speed_vs_cat": {
            "value": round(cat_s / verify_s, 3),
            "unit": "x the speed of cat",
            "goal": 0.5,
            "goal_op": ">=",
            "met": cat_s / verify_s >= 0.5,
        },
        "verify_speed_vs_sha256sum": {
            "value": round(sha_s / verify_s, 2),
            "unit": "x the speed of sha256sum",
            "goal": 5.0,
            "goal_op": ">=",
            "met": sha_s / verify_s >= 5.0,
        },
    }
    if args.json:
        print(json.dumps({"figures": figures, "machine": machine, "results": rows}, indent=2, sort_keys=True))
    else:
        print(f"file: {size / 1e9:.3f} GB, {len(report.tensors)} tensors; median of {args.runs} runs, warm page cache")
        print(
            f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} ({machine['torch_threads']} threads)"
        )
        print(f"load average before/after: {load_before[0]:.2f} / {machine['load_average_after'][0]:.2f}")
        print(f"{'what':58s} {'median s':>9s} {'GB/s':>8s} {'time / verify':>14s} {'CPU s/GB':>9s}")
        for row in rows:
            print(
                f"{row['what']:58s} {row['median_s']:9.4f} {row['GB_per_s']:8.3f} {row['vs_verify']:14.2f} {row['cpu_s_per_GB']:9.3f}"
            )
        verify_cpu = cpu_medians["verify (structure + digests + NaN/Inf + file checksum)"] / (size / 1e9)
        cores = os.cpu_count() or 1
        print(f"verify needs {verify_cpu:.3f} CPU s per GB: {cores / verify_cpu:.2f} GB/s on {cores} idle cores")
        sha = medians["sha256sum"]
        print(
            f"verify is {sha / verify_s:.1f}x faster than sha256sum; cat reads at {size / medians['cat > /dev/null'] / 1e9:.2f} GB/s"
        )
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
