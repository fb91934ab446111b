"""The recorder's exit drain (``recorder/exchange.drain_at_exit``, docs/recorder.md "At the job's
exit"): one exit handler per process that records, which waits with the GIL released before the
interpreter's teardown, so that gloo's workers free the last collectives' tensors while the
interpreter is whole. The race it closes is measured by ``benchmarks/exit_drill.py``; this checks
the handler is there, once, and that ``SDC_FORENSICS_EXIT_DRAIN_S=0`` removes it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, time
import torch, torch.distributed as dist
from sdc_forensics.recorder import exchange
from sdc_forensics.demo.ports import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
before = atexit._ncallbacks()
for _ in range(3):
    exchange.WordExchange(dist.group.WORLD, 1, torch.device("cpu"))
print(atexit._ncallbacks() - before)
dist.destroy_process_group()
print(time.time(), flush=True)
"""


@pytest.mark.parametrize(("drain", "handlers"), [(None, 1), ("0", 0), ("0.5", 1)])
def test_one_exit_handler_per_process_unless_turned_off(drain, handlers):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SDC_FORENSICS_EXIT_DRAIN_S", None)
    if drain is not None:
        env["SDC_FORENSICS_EXIT_DRAIN_S"] = drain
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    registered, ended = done.stdout.split()
    assert registered == str(handlers)
    if drain == "0.5":
        # the process outlived its last line by the wait at least (a lower bound: sleep never returns early)
        assert time.time() - float(ended) >= 0.5
