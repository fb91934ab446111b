"""Start ranks forked from one fork server that has already loaded what every rank would load.

A rank started with ``spawn`` imports torch (about 2 s of CPU on the 2-core development VM), then
``torch._dynamo`` on its first optimizer (``torch.optim`` imports it lazily: about 3 s more), then
the fingerprint kernels from numba's cache (about 0.5 s). Forked from a server that did this once
(:mod:`sdc_forensics.demo._preload`), W ranks cost one import instead of W, and a process that
launches several runs (a test session, a campaign) pays it once (``benchmarks/bench_fork_start.py``).

The server is kept for the next launch only while the environment is the one it started with:
its children inherit the server's ``os.environ`` and what torch, numba and this package read from
it at import, so a changed variable (``OMP_NUM_THREADS``, ``NUMBA_*``, ``SDC_FORENSICS_*``) starts a
new server. The server exits once the process that started it and every rank it forked have
exited; torch's parent-death signal of a rank then points at the server, so a rank of a launcher
that was killed runs on until its own collective times out (the demo's ranks have a timeout).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from collections.abc import Callable

#: Modules the fork server imports before it forks a rank. ``_preload`` imports torch._dynamo
#: and loads the numba kernels (no torch operator runs, so no thread pool exists at the fork).
PRELOAD = (
    "torch",
    "torch.distributed",
    "sdc_forensics.demo._preload",
    "sdc_forensics.recorder",
    "sdc_forensics.demo.run",
)

#: Variables that change while a process runs and that nothing reads at import (pytest's test id).
_VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})

_server_env: dict[str, str] | None = None


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _VOLATILE}


#: Seconds ``start(join=True)`` waits for its ranks before it dumps their stacks and kills them.
JOIN_DEADLINE_S = 600.0


def start(fn: Callable, args: tuple, nprocs: int, *, join: bool = True, deadline_s: float | None = JOIN_DEADLINE_S):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, start_method="forkserver")``, the
    ranks forked from a server that loaded :data:`PRELOAD`. ``fn`` must be importable by name.

    ``join=True`` (the default) waits for the ranks and returns ``None`` (a failed rank raises
    torch's ``ProcessRaisedException`` / ``ProcessExitedException``); ``join=False`` returns the
    ``ProcessContext``. A rank still running ``deadline_s`` seconds after the start (None: no
    deadline) writes every thread's Python stack to its stderr (``faulthandler`` on ``SIGUSR1``),
    every rank is killed, and :class:`TimeoutError` names the ranks that were still running: a
    rank stuck in a collective or in a torn-down process group fails its caller instead of
    hanging it.
    """
    import torch.multiprocessing as mp

    global _server_env
    # a server started elsewhere (None) or in another environment
    if _server_env != _environment():
        stop_server()
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    context = mp.start_processes(_traced, args=(fn, *args), nprocs=nprocs, join=False, start_method="forkserver")
    _server_env = _environment()
    if not join:
        return context
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    while not context.join(timeout=None if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
        if deadline is not None and time.monotonic() >= deadline:
            _dump_and_kill(context.processes, deadline_s)
    return None


def _traced(rank: int, fn: Callable, *args) -> None:
    """A rank: ``fn(rank, *args)``, with ``faulthandler`` ready to print its stacks on ``SIGUSR1``."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fn(rank, *args)


def _dump_and_kill(processes, deadline_s: float) -> None:
    running = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for rank in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(2.0)  # faulthandler writes from its signal handler; give it the moment
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    raise TimeoutError(
        f"rank(s) {', '.join(map(str, running))} still running {deadline_s:g} s after the start: "
        "killed; each printed its threads' Python stacks on its stderr before"
    )


def stop_server() -> None:
    """Stop the fork server now (private API, best effort); the next :func:`start` starts one."""
    global _server_env
    from multiprocessing import forkserver

    _server_env = None
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()
