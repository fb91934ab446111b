"""What the incident report costs on top of the analysis: ``report`` (Markdown, HTML) against
``bisect`` on the same trace, side by side in one run, as ratios (median of ``--repeat`` runs).

The trace is synthetic (``sdc_forensics.trace.synthetic``, as ``bench_trace_scan.py`` uses):
``--ranks`` x ``--steps`` with a NaN planted on one rank, analysed ``--trace-only`` (no replay),
so the figure is the report's own cost: reading the records it plots and drawing them. Each
command runs as a user runs it, the installed ``sdc-forensics`` in a fresh process.

Usage::

    python benchmarks/bench_report.py                         # 64 ranks x 20,000 steps, 3 repeats
    python benchmarks/bench_report.py --ranks 64 --steps 100000 --repeat 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sdc_forensics.trace.synthetic import PlantedFault, write_synthetic_trace


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1, 4):
        sys.exit(f"error: {' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    args = parser.parse_args()
    exe = str(Path(sys.executable).parent / "sdc-forensics")
    with tempfile.TemporaryDirectory(prefix="sdc-bench-report-") as tmp:
        trace = Path(tmp) / "trace"
        write_synthetic_trace(
            trace,
            num_ranks=args.ranks,
            num_steps=args.steps,
            faults=(PlantedFault(kind="nonfinite", step=args.steps * 7 // 9, rank=9 % args.ranks),),
        )
        commands = {
            "bisect": [exe, "bisect", str(trace), "--trace-only"],
            "report_md": [exe, "report", str(trace), "--trace-only", "-o", str(Path(tmp) / "review.md"), "--force"],
            "report_html": [exe, "report", str(trace), "--trace-only", "-o", str(Path(tmp) / "review.html"), "--force"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):  # interleaved, so load drifts hit every command alike
            for name, command in commands.items():
                times[name].append(_timed(command))
        html_bytes = (Path(tmp) / "review.html").stat().st_size
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "ranks": args.ranks,
        "steps": args.steps,
        "repeat": args.repeat,
        "median_s": median,
        "report_md_over_bisect": median["report_md"] / median["bisect"],
        "report_html_over_bisect": median["report_html"] / median["bisect"],
        "html_bytes": html_bytes,
    }
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return
    print(f"{args.ranks} ranks x {args.steps} steps, median of {args.repeat}, --trace-only:")
    print(f"  report -o review.md   / bisect: {result['report_md_over_bisect']:.2f}x")
    print(f"  report -o review.html / bisect: {result['report_html_over_bisect']:.2f}x  ({html_bytes / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
