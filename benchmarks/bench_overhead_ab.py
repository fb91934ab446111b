"""The recorder's cost now against an earlier commit's, side by side: ``bench_overhead.py --model gpt``
runs alternately with this checkout's ``sdc_forensics`` and with a baseline checkout's
(``PYTHONPATH``), so that drift of a shared machine hits both alike.

Each repetition runs the baseline, then this checkout (the order flips every repetition); each
run is ``bench_overhead.py ARGS --runs 1 --json`` (its own alternating bare / recorded pairs).
Printed per side: the median over repetitions of the run's recorded / bare ratio (wall and CPU),
and every run's figures. The baseline is a checkout of any commit (``git worktree add /tmp/base
REV``); the benchmark script itself is this checkout's, so the two differ only in the recorder.

Usage::

    python benchmarks/bench_overhead_ab.py --baseline /tmp/base --repeat 3 -- --shape 2x64 --parallel fsdp --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(code: Path, args: list[str]) -> dict:
    """One ``bench_overhead.py --model gpt ARGS --runs 1 --json`` with ``sdc_forensics`` from ``code``."""
    env = dict(os.environ, PYTHONPATH=str(code))
    # run from a neutral directory: spawned ranks put their working directory first on sys.path
    out = subprocess.run(
        [sys.executable, str(HERE / "bench_overhead.py"), "--model", "gpt", *args, "--runs", "1", "--json"],
        env=env,
        cwd=tempfile.gettempdir(),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (figure,) = json.loads(out[out.index("{") :]).values()
    detail = figure["detail"]
    return {"wall": detail["wall_ratio"], "cpu": detail["cpu_ratio"], "code": detail.get("code", str(code))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--repeat", type=int, default=3, help="alternating repetitions (default 3)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then bench_overhead.py's --model gpt arguments")
    args = parser.parse_args(argv)
    if not (args.baseline / "sdc_forensics").is_dir():
        parser.error(f"{args.baseline} holds no sdc_forensics package: give a checkout of the baseline commit")
    bench = [a for a in args.args if a != "--"]
    sides = {"baseline": args.baseline.resolve(), "this checkout": HERE.parent}
    found: dict[str, list[dict]] = {name: [] for name in sides}
    for index in range(args.repeat):
        order = list(sides) if index % 2 == 0 else list(reversed(sides))
        for name in order:
            found[name].append(_run(sides[name], bench))
            print(f"repetition {index + 1}, {name}: {json.dumps(found[name][-1])}", flush=True)
    print(f"bench_overhead.py --model gpt {' '.join(bench)}: recorded / bare, median of {args.repeat} runs")
    for name, runs in found.items():
        wall = statistics.median(r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        print(f"  {name:14} {wall:.3f} wall, {cpu:.3f} CPU   ({sides[name]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
