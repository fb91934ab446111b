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
import os
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


def start(fn: Callable, args: tuple, nprocs: int, *, join: bool = True):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, start_method="forkserver")``, the
    ranks forked from a server that loaded :data:`PRELOAD`. ``fn`` must be importable by name.

    ``join=True`` (the default) waits for the ranks and returns ``None`` (a failed rank raises
    torch's ``ProcessRaisedException`` / ``ProcessExitedException``); ``join=False`` returns the
    ``ProcessContext``.
    """
    import torch.multiprocessing as mp

    global _server_env
    # a server started elsewhere (None) or in another environment
    if _server_env != _environment():
        stop_server()
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    _server_env = _environment()
    if join:
        while not context.join():
            pass
        return None
    return context


def stop_server() -> None:
    """Stop the fork server now (private API, best effort); the next :func:`start` starts one."""
    global _server_env
    from multiprocessing import forkserver

    _server_env = None
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()
