"""Does ``torchrun -m sdc_forensics bisect TRACE --json`` print the single-process document?

For each ``--inject`` spec, a demo run (4 gloo processes on CPU, ``--steps`` steps, a checkpoint
every ``--checkpoint-every``, the ``--recipe`` and per-rank ``--threads`` given) is made in
``--out``; then ``sdc-forensics bisect TRACE --json`` runs once in one process, and under
``torchrun --standalone --nproc-per-node P`` for every P of ``--nproc`` (P may exceed the 4 ranks).
A row agrees when process 0's document equals the single-process one (timing fields aside).

    python benchmarks/torchrun_agreement.py --nproc 2,4 --inject weights:step=4:rank=1:bit=30 \\
        --inject input:step=3:rank=3:bit=30 [--recipe MOD:ATTR] [--threads 2,1,2,1] [--json]
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(ROOT))

from tests.distributed.launch import strip_timing  # noqa: E402 - the comparison the torchrun tests make


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--inject", action="append", required=True, help="a demo fault spec (repeatable; 'none' for a clean run)"
    )
    parser.add_argument("--nproc", default="2,3", help="comma-separated process counts")
    parser.add_argument("--recipe", default=None)
    parser.add_argument("--threads", default=None, help="the demo's --threads (one count, or one per rank)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="torchrun-agreement-"))
    env = _env()
    rows = []
    for index, spec in enumerate(args.inject):
        run = out / f"run-{index}"
        demo = [
            sys.executable,
            "-m",
            "sdc_forensics",
            "demo",
            "--out",
            str(run),
            "--inject",
            spec,
            "--steps",
            str(args.steps),
            "--checkpoint-every",
            str(args.checkpoint_every),
        ]
        demo += ["--recipe", args.recipe] if args.recipe else []
        demo += ["--threads", args.threads] if args.threads else []
        subprocess.run(demo, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, check=True)
        bisect = ["-m", "sdc_forensics", "bisect", str(run / "trace"), "--json"]
        single = subprocess.run(
            [sys.executable, *bisect], env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout
        )
        single_doc = json.loads(single.stdout)
        for nproc in (int(n) for n in args.nproc.split(",")):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--rdzv-endpoint=localhost:{_free_port()}",
                f"--nproc-per-node={nproc}",
                *bisect,
            ]
            started = time.monotonic()
            multi = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            seconds = time.monotonic() - started
            try:
                agrees = strip_timing(json.loads(multi.stdout)) == strip_timing(single_doc)
            except json.JSONDecodeError:
                agrees = False
            rows.append(
                {
                    "inject": spec,
                    "processes": nproc,
                    "verdict": single_doc.get("verdict"),
                    "first_divergent_step": single_doc.get("first_divergent_step"),
                    "single_exit": single.returncode,
                    "agrees": agrees,
                    "torchrun_s": round(seconds, 1),
                    **({} if agrees else {"stderr_tail": multi.stderr[-1500:]}),
                }
            )
            if not args.json:
                r = rows[-1]
                print(
                    f"{spec:<40} P={nproc}  single: {r['verdict']} step {r['first_divergent_step']} (exit {r['single_exit']})  "
                    f"torchrun: {'same document' if agrees else 'DIFFERENT'}  {seconds:.0f} s",
                    flush=True,
                )
                if not agrees:
                    print(multi.stderr[-1500:])
    if args.json:
        print(
            json.dumps(
                {
                    "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
                    "recipe": args.recipe,
                    "threads": args.threads,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0 if all(r["agrees"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
