"""Run ``torchrun --standalone`` with a free rendezvous port and a hard timeout (tests only)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    from sdc_forensics.demo.ports import free_port as below_ephemeral

    return below_ephemeral()


def start_torchrun(
    nproc: int, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Start ``python -m torch.distributed.run --standalone --nproc-per-node NPROC ARGS`` (``-m MOD``
    or a script) on a free rendezvous port, in its own process group, in ``cwd`` (default: the
    repository); see :func:`wait`."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--rdzv-endpoint=localhost:{free_port()}",
        f"--nproc-per-node={nproc}",
        "--monitor-interval=0.1",
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    proc = subprocess.Popen(
        cmd + args,
        cwd=cwd or ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    proc.started = time.monotonic()
    return proc


def wait(proc: subprocess.Popen, timeout_s: float):
    """``(returncode, stdout, stderr, seconds)`` of a :func:`start_torchrun` process. Raises
    ``subprocess.TimeoutExpired`` after ``timeout_s`` (the whole process group is killed first)."""
    try:
        stdout, stderr = proc.communicate(timeout=max(0.1, timeout_s - (time.monotonic() - proc.started)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    return proc.returncode, stdout, stderr, time.monotonic() - proc.started


def torchrun(
    nproc: int, args: list[str], *, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
):
    """:func:`start_torchrun` then :func:`wait`: ``(returncode, stdout, stderr, seconds)``."""
    return wait(start_torchrun(nproc, args, env=env, cwd=cwd), timeout_s)


def torchrun_document(args: list[str], processes: int = 2, timeout_s: float = 600) -> tuple[int, dict, str]:
    """``python -m sdc_forensics ARGS --json`` on ``processes`` torchrun processes: ``(exit code, the
    JSON document process 0 printed, stderr)``; fails the test, with stderr's tail, where it printed none."""
    import json

    rc, out, err, _ = torchrun(processes, ["-m", "sdc_forensics", *args, "--json"], timeout_s=timeout_s)
    assert out.strip(), err[-3000:]
    return rc, json.loads(out), err


def launch_direct(
    nproc: int, args: list[str], *, timeout_s: float, env: dict[str, str] | None = None, wait_for: tuple[int, ...] = ()
):
    """Start ``nproc`` processes of ``python ARGS`` with the ``torch.distributed`` environment set by
    hand (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), as ``srun``
    with one task per GPU would. Waits for the processes in ``wait_for`` (default: all) at most
    ``timeout_s`` in all, then kills every one still running. Returns ``[(returncode or None,
    stdout, stderr)]`` by process, and the seconds until the awaited ones ended."""
    port = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    procs = []
    for rank in range(nproc):
        rank_env = {
            **base,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    started = time.monotonic()
    awaited = wait_for or tuple(range(nproc))
    try:
        for rank in awaited:
            procs[rank].wait(timeout=max(0.1, timeout_s - (time.monotonic() - started)))
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    results = []
    for proc in procs:
        out, err = proc.communicate()
        results.append((proc.returncode if proc.returncode is not None and proc.returncode >= 0 else None, out, err))
    return results, elapsed


def strip_timing(value):
    """The document without timing fields (none today; kept so that one added later does not break the comparison)."""
    if isinstance(value, dict):
        return {
            k: strip_timing(v)
            for k, v in value.items()
            if not re.search(r"(^|_)(seconds|elapsed|time|duration)(_|$)", k)
        }
    if isinstance(value, list):
        return [strip_timing(v) for v in value]
    return value
