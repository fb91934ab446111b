"""A real Slurm on this machine for the tests: munge, ``slurmctld`` and one ``slurmd`` per node.

Two nodes when the machine has two names that resolve (``hostname -s`` and ``localhost``), each
its own ``slurmd`` on its own port (Slurm's multiple-slurmd support: ``slurmd -N NAME``), both
with the machine's real CPU count; one node otherwise. Plugins that need no cgroups
(``proctrack/linuxproc``, ``task/none``), no accounting database (a finished job is read with
``scontrol show job`` while the controller keeps it, ``MinJobAge``). Everything lives under one
directory: configuration, munge key and socket, state, spool, logs. Node names must resolve,
because job scripts take ``MASTER_ADDR`` from ``scontrol show hostnames``, as on a real cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

#: The binaries the cluster needs (Debian: ``apt-get install slurm-wlm munge``).
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
#: Seconds the daemons get to bring every node to ``idle``.
START_TIMEOUT_S = 60.0


class Unavailable(Exception):
    """Slurm cannot run here; the message says why (the tests skip with it)."""


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def node_names() -> tuple[str, ...]:
    """This machine's names that resolve: ``hostname -s`` first, then ``localhost``."""
    names = []
    for name in (socket.gethostname().split(".")[0], "localhost"):
        try:
            socket.gethostbyname(name)
        except OSError:
            continue
        if name and name not in names:
            names.append(name)
    return tuple(names)


class SlurmCluster:
    """The daemons of one test session; :meth:`start`, then :meth:`stop`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.nodes = node_names()
        self.cpus = os.cpu_count() or 1
        self._daemons: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client command: ``SLURM_CONF``, this Python first on ``PATH``."""
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path, **extra}

    def _write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        munge = self.root / "munge"
        lines = [
            "ClusterName=sdctest",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge / 'munge.socket.2'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'run/slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.root / 'log/slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # finished jobs stay readable with scontrol for 10 minutes; a cancelled step ends fast
            "MinJobAge=600",
            "KillWait=5",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} State=UNKNOWN"
            )
        # FORCE:4: a job beside another (the follower beside training) shares the CPUs, as the drills need on 2 cores
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
        )
        self.conf.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (held by the daemon)
        self._daemons.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        )

    def start(self) -> None:
        """Start munge, the controller and the nodes; wait until every node is idle.

        Raises:
            Unavailable: a binary is missing, this is not root, or the daemons do not come up.
        """
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            raise Unavailable(
                f"Slurm is not installed ({', '.join(missing)} not found): apt-get install slurm-wlm munge"
            )
        if os.geteuid() != 0:
            raise Unavailable("slurmd must run as root (SlurmdUser=root) and this test session is not root")
        if not self.nodes:
            raise Unavailable("no name of this machine resolves (neither hostname -s nor localhost)")
        for sub in ("state", "spool", "run", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._write_conf()
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                "--force",
                f"--socket={munge / 'munge.socket.2'}",
                f"--key-file={key}",
                f"--log-file={self.root / 'log/munged.log'}",
                f"--pid-file={self.root / 'run/munged.pid'}",
                f"--seed-file={munge / 'seed'}",
            ],
        )
        self._wait_for(lambda: (munge / "munge.socket.2").exists(), 10.0, "munged did not create its socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-f", str(self.conf), "-N", name])
        self._wait_for(
            lambda: (
                all(s.startswith("idle") for s in self.node_states().values())
                and len(self.node_states()) == len(self.nodes)
            ),
            START_TIMEOUT_S,
            "the nodes did not become idle",
        )

    def _wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [d for d in self._daemons if d.poll() is not None]
            if dead:
                break
            if ready():
                return
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise Unavailable(f"{what} within {timeout_s:.0f} s; logs: {tail}")

    def log_tail(self, lines: int = 6) -> str:
        """The last lines of every daemon log, one string (for a skip reason or a failure)."""
        out = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-lines:]
            if text:
                out.append(f"[{path.name}] " + " | ".join(text))
        return " ".join(out) or "(no log)"

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` from ``sinfo`` (``idle``, ``alloc``, ``drained``, ...); {} when the controller does not answer."""
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())

    def run(
        self, command: str, *, cwd: Path, env: dict[str, str] | None = None, timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess:
        """``bash -c COMMAND`` in ``cwd`` with the cluster's environment (plus ``env``)."""
        return subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=self.env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def show_node(self, name: str) -> tuple[str, str]:
        """``(State, Reason)`` as ``scontrol show node NAME`` prints them (Reason without its ``[user@time]``)."""
        text = subprocess.run(
            ["scontrol", "show", "node", name], env=self.env(), capture_output=True, text=True, timeout=30
        ).stdout
        state = re.search(r"State=(\S+)", text)
        reason = re.search(r"^\s*Reason=(.*?)(?: \[[^\]]*\])?\s*$", text, re.M)
        return (state.group(1) if state else "", reason.group(1) if reason else "")

    def wait_job(self, job_id: str, timeout_s: float) -> tuple[str, int]:
        """``(JobState, exit code)`` once job ``job_id`` has ended (``scontrol show job``; no accounting here).

        Raises:
            TimeoutError: it still runs (or pends) after ``timeout_s``; it is cancelled first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            text = subprocess.run(
                ["scontrol", "show", "job", job_id], env=self.env(), capture_output=True, text=True, timeout=30
            ).stdout
            state = re.search(r"JobState=(\S+)", text)
            if state and state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                code = re.search(r"ExitCode=(\d+):(\d+)", text)
                return state.group(1), int(code.group(1)) if code else -1
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env(), timeout=30)
                raise TimeoutError(
                    f"job {job_id} is still {state.group(1) if state else '?'} after {timeout_s:.0f} s: {text.strip()}"
                )
            time.sleep(0.5)

    def resume_nodes(self) -> None:
        """Every node back to service (a drill drained one), so that the next drill starts from idle nodes."""
        for name in self.nodes:
            subprocess.run(
                ["scontrol", "update", f"nodename={name}", "state=resume"],
                env=self.env(),
                capture_output=True,
                timeout=30,
            )

    def stop(self) -> None:
        """Cancel every job, then end the daemons (SIGTERM, then SIGKILL after 10 s)."""
        if any(d.poll() is None for d in self._daemons):
            subprocess.run(["scancel", "--user", "root"], env=self.env(), capture_output=True, timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                queue = subprocess.run(["squeue", "-h"], env=self.env(), capture_output=True, text=True, timeout=30)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.5)
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(timeout=10)
        self._daemons.clear()
