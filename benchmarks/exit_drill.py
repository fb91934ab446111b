"""How often a recorded job's process aborts at its exit, with and without the exit drain.

Launches a nanoGPT-style recorded job (``benchmarks/exit_drill_job.py``: DDP on gloo, AdamW,
clipping, accumulation, checkpoints, ending through the interpreter's teardown as a user's
script does) ``--launches`` times under ``torchrun --standalone --nproc-per-node 2``,
alternating ``SDC_FORENSICS_EXIT_DRAIN_S=0`` (no wait at exit) and the default
(``recorder/exchange.drain_at_exit``), and counts launches where a rank aborted with "terminate
called without an active exception" (a gloo worker thread freeing a finished collective's tensor
during the interpreter's teardown) or torchrun exited non-zero. The abort is a race: it shows
more often on a loaded machine (``--load N`` starts N busy-looping processes beside the jobs).

    python benchmarks/exit_drill.py --launches 60 --load 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def launch(drain: str | None, work: Path) -> tuple[int, bool]:
    from tests.distributed.launch import torchrun

    env = {} if drain is None else {"SDC_FORENSICS_EXIT_DRAIN_S": drain}
    for name in ("trace", "ckpt"):
        subprocess.run(["rm", "-rf", str(work / name)], check=True)
    code, _, err, _ = torchrun(
        2, [str(ROOT / "benchmarks" / "exit_drill_job.py"), "--out", str(work)], timeout_s=600, env=env
    )
    return code, "terminate called" in err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=40, help="launches in all, half each way")
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes beside the jobs")
    args = parser.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    counts = {"no drain": [0, 0, 0], "drain": [0, 0, 0]}
    try:
        with tempfile.TemporaryDirectory(prefix="sdc-exit-drill-") as tmp:
            for i in range(args.launches):
                way = "no drain" if i % 2 == 0 else "drain"
                code, aborted = launch("0" if way == "no drain" else None, Path(tmp))
                row = counts[way]
                row[0] += 1
                row[1] += int(aborted)
                row[2] += int(code != 0)
                print(f"launch {i + 1:3d} {way:8s} exit {code} {'ABORT' if aborted else ''}", flush=True)
    finally:
        for burner in burners:
            burner.kill()
    print(f"machine: {os.uname().machine}, {os.cpu_count()} CPUs, load {args.load}")
    for way, (n, aborted, failed) in counts.items():
        print(f"{way:8s}: {aborted} of {n} launches aborted at exit, {failed} exited non-zero")


if __name__ == "__main__":
    main()
