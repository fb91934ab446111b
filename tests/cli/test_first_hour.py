"""Issue 25, "a new user's first hour": what the installed command prints and exits with when a
user follows the README with a job of their own. Each test is one item of the issue.
"""

from __future__ import annotations

import os
import subprocess

from tests.cli.installed import command, run_installed
from tests.factories import SimFault


def _closed_stderr(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """Run the installed command with stderr a pipe whose reader is gone (``2>&1 | head -1``
    after head exited); stdout captured."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    try:
        return subprocess.run([command(), *args], stdout=subprocess.PIPE, stderr=write_end, env=env, text=True, timeout=300, cwd=tmp_path)
    finally:
        os.close(write_end)


def test_exit_status_does_not_depend_on_stderr_being_a_closed_pipe(sim, tmp_path):
    run = sim(SimFault(where="grad", step=4, rank=3, bit=11), steps=5, checkpoint_every=4)
    trace, checkpoint = str(run / "trace"), str(run / "checkpoints" / "step-00000004.pt")
    for args in (["inspect", trace], ["verify-checkpoint", checkpoint], ["bisect", trace, "--trace-only"],
                 ["bisect", trace, "--checkpoints", str(run / "checkpoints")]):
        unpiped = run_installed(args, tmp_path)
        piped = _closed_stderr(args, tmp_path)
        assert piped.returncode == unpiped.returncode, (args, unpiped.stderr)
    assert run_installed(["inspect", trace], tmp_path).returncode == 0
    assert run_installed(["bisect", trace, "--checkpoints", str(run / "checkpoints")], tmp_path).returncode == 1
    # the shell pipeline of the issue, as a user types it
    bash = subprocess.run(["bash", "-c", f'"{command()}" verify-checkpoint "{checkpoint}" 2>&1 | head -1; exit ${{PIPESTATUS[0]}}'],
                          capture_output=True, text=True, timeout=120)
    assert bash.returncode == 0, bash.stdout + bash.stderr
