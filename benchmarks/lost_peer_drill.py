"""Lost-peer drill: launch a 3-process ``bisect`` many times with one process made to hang (or to
die) at a replayed step, and count how the other processes end.

Each launch starts ``python -m sdc_forensics bisect TRACE --json --replay-timeout T`` three times
with the ``torch.distributed`` environment set by hand (as ``srun`` with one task per process
would, so the exit statuses are the processes' own), gloo on CPU, one thread each. The test-only
hook ``SDC_FORENSICS_TEST_FAIL_REPLAY_PROCESS=1:STEP[:hang]`` (docs/distributed.md, "Failures")
makes process 1 hang (``--mode hang``) or ``os._exit(17)`` (``--mode kill``) just before it
replays step STEP. Process 1 is killed by the drill once the others ended (as ``srun`` would).

A launch passes when processes 0 and 2 both exit 4 on their own, process 0 with one ``error:``
line and process 2 silent. Anything else (a signal such as SIGABRT, exit -6, an empty line, a
process still running after ``--timeout``) is counted and its stderr tail printed.

The trace is a demo run (``grad:step=4:rank=2:bit=31``, 6 steps, a checkpoint every 3) made once
in ``--out`` (a temporary folder by default).

    python benchmarks/lost_peer_drill.py --launches 60 [--mode hang|kill] [--replay-timeout 5] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = "SDC_FORENSICS_TEST_FAIL_REPLAY_PROCESS"  # sdc_forensics.replay.distributed.TEST_FAIL_ENV
FAIL_STEP = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(trace: Path, mode: str, replay_timeout: float, timeout_s: float):
    """One launch: ``(statuses, stderr tails, seconds)``; a status is the exit code, ``-N`` for a
    signal, ``None`` for a process still running when it was killed."""
    port = _free_port()
    hook = f"1:{FAIL_STEP}:hang" if mode == "hang" else f"1:{FAIL_STEP}"
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), HOOK: hook}
    procs = []
    for rank in range(3):
        env = {
            **base,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sdc_forensics",
                    "bisect",
                    str(trace),
                    "--json",
                    "--replay-timeout",
                    f"{replay_timeout:g}",
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    started = time.monotonic()
    for rank in (0, 2):
        try:
            procs[rank].wait(timeout=max(0.1, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            break
    seconds = time.monotonic() - started
    statuses = [proc.poll() for proc in procs]
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    errs = [proc.communicate()[1] for proc in procs]
    return statuses, errs, seconds


def _passed(statuses, errs) -> bool:
    lines0 = [line for line in errs[0].splitlines() if line.startswith("error: ")]
    return statuses[0] == 4 and statuses[2] == 4 and len(lines0) == 1 and errs[2] == ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--mode", choices=("hang", "kill"), default="hang")
    parser.add_argument("--replay-timeout", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one launch may take")
    parser.add_argument("--out", type=Path, default=None, help="folder for the demo run (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from sdc_forensics.demo.run import run_demo

    out = args.out or Path(tempfile.mkdtemp(prefix="lost-peer-drill-"))
    if not (out / "trace").is_dir():
        run_demo(out, injections=("grad:step=4:rank=2:bit=31",), steps=6, checkpoint_every=3)
    counts: collections.Counter = collections.Counter()
    failures = []
    seconds = []
    for i in range(args.launches):
        statuses, errs, took = _launch(out / "trace", args.mode, args.replay_timeout, args.timeout)
        seconds.append(took)
        counts["passed" if _passed(statuses, errs) else "failed"] += 1
        counts[f"process 2 status {statuses[2]}"] += 1
        if not _passed(statuses, errs):
            failures.append({"launch": i, "statuses": statuses, "stderr_0": errs[0][-600:], "stderr_2": errs[2][-600:]})
            if not args.json:
                print(
                    f"launch {i}: statuses {statuses}\n  process 0: {errs[0][-300:]!r}\n  process 2: {errs[2][-300:]!r}",
                    flush=True,
                )
    seconds.sort()
    result = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "mode": args.mode,
        "launches": args.launches,
        "passed": counts["passed"],
        "failed": counts["failed"],
        "process_2_statuses": {k.split()[-1]: v for k, v in counts.items() if k.startswith("process 2")},
        "median_launch_s": round(seconds[len(seconds) // 2], 1) if seconds else None,
        "failures": failures,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{args.mode}: {result['passed']} of {args.launches} launches ended with exit 4 on processes 0 and 2 "
            f"(process 2 statuses {result['process_2_statuses']}; median launch {result['median_launch_s']} s) on {result['machine']}"
        )
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
