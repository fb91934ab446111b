"""Run ``torchrun --standalone`` with a free rendezvous port and a hard timeout (tests only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], *, timeout_s: float, env: dict[str, str] | None = None):
    """``python -m torch.distributed.run --standalone --nproc-per-node NPROC ARGS`` (``-m MOD`` or a
    script); ``(returncode, stdout, stderr, seconds)``. Raises ``subprocess.TimeoutExpired`` after
    ``timeout_s`` (the whole process group is killed first)."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--rdzv-endpoint=localhost:{port}",
           f"--nproc-per-node={nproc}", "--monitor-interval=0.1"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("WORLD_SIZE", None)
    started = time.monotonic()
    proc = subprocess.Popen(cmd + args, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    return proc.returncode, stdout, stderr, time.monotonic() - started
