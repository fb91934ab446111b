"""Launch a recorded framework job as a launcher does: one ``python`` per rank, gloo on a free port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.factories import free_port

REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    module: str, argv: list[str], *, world: int = 2, cwd: Path, timeout: float = 300
) -> list[subprocess.CompletedProcess]:
    """Run ``module.run()`` (``tests.integrations.hfjob``, ...) in ``world`` processes; their exit codes and stderr."""
    return _spawn(["-c", f"import {module} as job; job.run()", *argv], world=world, cwd=cwd, timeout=timeout)


def _spawn(args: list[str], *, world: int, cwd: Path, timeout: float) -> list[subprocess.CompletedProcess]:
    """``python ARGS`` in ``world`` processes with the environment torchrun gives its ranks (a free port each time)."""
    env = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            cwd=cwd,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    out = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(proc.args, proc.returncode, "", err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


def run_and_leave(main) -> None:
    """Run ``main()`` as a launched rank, then leave without the interpreter's teardown (gloo's race
    at exit, docs/recorder.md "Limits"): a traceback goes to stderr, the exit code says it."""
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def assert_ok(ranks: list[subprocess.CompletedProcess]) -> None:
    assert [r.returncode for r in ranks] == [0] * len(ranks), "\n".join(r.stderr[-3000:] for r in ranks)


#: Runs a script as ``python mytrain.py`` does, then leaves as :func:`run_and_leave` does.
_RUN_AS_MAIN = (
    "import os, runpy, sys\n"
    "sys.path.insert(0, os.getcwd())\n"
    "from tests.integrations.launch import run_and_leave\n"
    "run_and_leave(lambda: runpy.run_path(sys.argv[1], run_name='__main__'))\n"
)


def run_script(cwd: Path, script: str, *, world: int = 2, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Run ``cwd/script`` as ``__main__`` in ``world`` processes, as torchrun starts them."""
    return _spawn(["-c", _RUN_AS_MAIN, script], world=world, cwd=cwd, timeout=timeout)
