"""Run the *installed* ``sdc-forensics`` command as a user's job would: stdout captured, stderr
redirected to a file (not a terminal, like a Slurm log or ``2>file``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def command() -> str:
    """The console script next to this interpreter (the one ``pip install`` made), else on PATH."""
    beside = Path(sys.executable).parent / "sdc-forensics"
    found = str(beside) if beside.exists() else shutil.which("sdc-forensics")
    if found is None:
        raise RuntimeError("the sdc-forensics command is not installed: pip install -e .")
    return found


def run_installed(
    args: list[str],
    tmp_path: Path,
    *,
    cwd: Path | None = None,
    env: dict | None = None,
    stdin: str | None = None,
    timeout: float = 300,
) -> Ran:
    """Run ``sdc-forensics ARGS`` with stderr to a file under ``tmp_path``; never a terminal."""
    log = Path(tmp_path) / f"stderr-{os.getpid()}-{len(list(Path(tmp_path).glob('stderr-*')))}.log"
    full_env = {**os.environ, "COLUMNS": "80", **(env or {})}
    full_env.pop("FORCE_COLOR", None)
    with open(log, "w", encoding="utf-8") as errf:
        proc = subprocess.run(
            [command(), *args],
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=errf,
            input=stdin,
            text=True,
            timeout=timeout,
        )
    return Ran(proc.returncode, proc.stdout, log.read_text(encoding="utf-8"))
