"""Run every benchmark and print one table: each figure, its goal, and whether it is met.

Each benchmark runs in its own process (``python benchmarks/NAME.py --json [--quick]``) and
prints its figures as JSON: ``{name: {"value", "unit", "goal", "goal_op", "met"}}`` (or that
dict under a ``"figures"`` key). Every figure is a ratio measured side by side in one run of
that benchmark (ours vs its baseline, median of several repetitions), so the table means the
same on a busy machine as on a quiet one. A benchmark that fails or times out is a row that
says so, and the exit code is 1; a figure whose goal is missed does not change the exit code.

    python benchmarks/run_all.py [--quick] [--json] [--only NAME ...] [--timeout S]

``--quick`` (about 5 minutes on 2 cores) uses small sizes; without it each benchmark runs at
the size its goal is stated for (the trace scan at 1,024 ranks x 20,000 steps, ~4.4 GB of disk).
``--json`` prints ``{name: {value, unit, goal, met, ...}}`` on stdout instead of the table.
CUDA figures come from ``benchmarks/gpu_check.sh`` on a GPU machine; without a GPU the table
says that they are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: (script, arguments for --quick, arguments for the full run): the full run is at goal size.
BENCHMARKS: list[tuple[str, list[str], list[str]]] = [
    ("bench_fingerprint.py", ["--quick", "--threads", "1"], ["--threads", "1", "--sizes-mb", "64", "256"]),
    ("bench_trace_scan.py", ["--quick"], ["--ranks", "1024", "--steps", "20000"]),
    ("bench_overhead.py", ["--quick", "--steps", "8"], []),  # 3 pairs (its own --quick) swing by +-10 points
    # issue 37: the nanoGPT-shaped job under DDP (its goal-sized run: 4 layers x 128, 3 runs of 12 pairs)
    (
        "bench_overhead.py",
        ["--model", "gpt", "--shape", "2x64", "--steps", "8"],
        ["--model", "gpt", "--shape", "4x128", "--runs", "3"],
    ),
    ("bench_replay.py", ["--quick"], []),
    ("bench_verify.py", ["--quick"], []),
    (
        "bench_adapter_overhead.py",
        ["--quick", "--jobs", "hf-small", "lightning"],
        [],
    ),  # the 3.3 M GPT-2 job only in the full run
]


def _figures(stdout: str) -> dict:
    """The benchmark's figures from its stdout (the JSON document, possibly after other lines)."""
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON on stdout")
    data = json.loads(stdout[start:])
    figures = data.get("figures", data)
    if not isinstance(figures, dict) or not all(isinstance(v, dict) and "value" in v for v in figures.values()):
        raise ValueError("stdout JSON is not {name: {value, unit, goal, met}}")
    return figures


def run_one(script: str, args: list[str], timeout: float) -> tuple[dict, str | None, float]:
    """``(figures, error or None, seconds)`` of one benchmark run in a child process."""
    command = [sys.executable, str(HERE / script), "--json", *args]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent)
    except subprocess.TimeoutExpired:
        return {}, f"timed out after {timeout:.0f} s", time.perf_counter() - start
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {}, f"exit {done.returncode}: {last}", seconds
    try:
        return _figures(done.stdout), None, seconds
    except ValueError as exc:
        return {}, str(exc), seconds


def _cuda_rows() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            return {}
    except ImportError:
        pass
    return {
        "cuda_figures": {
            "value": None,
            "unit": "",
            "goal": "measured on a GPU",
            "goal_op": "",
            "met": None,
            "note": "no CUDA device on this machine: run benchmarks/gpu_check.sh on one (docs/gpu.md)",
        }
    }


def _format_value(figure: dict) -> str:
    value = figure.get("value")
    if value is None:
        return "missing"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _format_goal(figure: dict) -> str:
    goal = figure.get("goal")
    if goal is None:
        return ""
    op = figure.get("goal_op", "")
    if isinstance(goal, float) and abs(goal) >= 1e4:
        goal = f"{goal:,.0f}"
    return f"{op} {goal}".strip()


def table(rows: list[tuple[str, str, dict]]) -> str:
    """Markdown table: figure, value, unit, goal, met, benchmark."""
    lines = ["| figure | value | unit | goal | met | benchmark |", "| --- | ---: | --- | --- | --- | --- |"]
    for script, name, figure in rows:
        met = {True: "yes", False: "**no**", None: "-"}[figure.get("met")]
        note = f" ({figure['note']})" if figure.get("note") else ""
        lines.append(
            f"| {name} | {_format_value(figure)} | {figure.get('unit', '')} | {_format_goal(figure)} | {met}{note} | {script} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: about 5 minutes on 2 cores")
    parser.add_argument(
        "--json", action="store_true", help="print {name: {value, unit, goal, met}} instead of the table"
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (e.g. bench_verify)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per benchmark (default 300 quick, 1800 full)"
    )
    args = parser.parse_args(argv)
    timeout = args.timeout or (300.0 if args.quick else 1800.0)
    chosen = [
        b for b in BENCHMARKS if not args.only or b[0].removesuffix(".py") in {o.removesuffix(".py") for o in args.only}
    ]
    if not chosen:
        parser.error(f"--only matched no benchmark; known: {', '.join(b[0].removesuffix('.py') for b in BENCHMARKS)}")

    rows: list[tuple[str, str, dict]] = []
    failed = False
    for script, quick_args, full_args in chosen:
        figures, error, seconds = run_one(script, quick_args if args.quick else full_args, timeout)
        print(
            f"{script}: {'failed: ' + error if error else f'{len(figures)} figures'} ({seconds:.0f} s)", file=sys.stderr
        )
        if error:
            failed = True
            rows.append(
                (
                    script,
                    script.removesuffix(".py"),
                    {"value": None, "unit": "", "goal": None, "met": False, "note": error},
                )
            )
        rows.extend((script, name, figure) for name, figure in figures.items())
    rows.extend(("gpu_check.sh", name, figure) for name, figure in _cuda_rows().items())

    if args.json:
        print(json.dumps({name: figure for _, name, figure in rows}, indent=2, sort_keys=True))
    else:
        sys.path.insert(0, str(HERE))
        from bench_verify import _cpu_name  # one reading of the CPU's name for every benchmark

        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(
            f"machine: {_cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
            f"{'--quick' if args.quick else 'goal-sized'} run; load average {load:.1f}"
        )
        print(table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
