"""Imported by the fork server of :mod:`sdc_forensics.demo.forked`, once, before it forks the ranks.

Loads what every rank would otherwise load by itself: ``torch._dynamo`` (which ``torch.optim``
imports on a process's first optimizer) and the fingerprint kernels from numba's cache. No torch
operator runs here, so no intra-op thread pool exists when the ranks are forked.
"""

import importlib

from sdc_forensics.fingerprint import cpu_kernel

# Best effort: the fork server survives only an ImportError in its preload list, and a server
# that died would fail every launch; a rank then loads what failed here itself, as a spawned
# one would (and a broken numba cache falls back to the torch path in that rank, as it says).
try:
    importlib.import_module("torch._dynamo")
    cpu_kernel.warm_up()
except Exception:  # noqa: BLE001 - nothing here may stop the server
    pass
