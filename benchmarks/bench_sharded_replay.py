"""Peak memory of each replay process at k = 1, 2, 4, and replay time against the job's step time
(issue 35: a sharded job replayed at its size).

A clean FSDP2 job is recorded: ``W`` = 4 gloo ranks (forked), a ``--width``-wide MLP of two blocks
(``Linear(D, 4D)``, ReLU, ``Linear(4D, D)``, LayerNorm; ``D`` = 512: 4.2 M parameters), AdamW
(16 bytes of model state per parameter: weights, gradients, two moments), two microbatches of 64
rows accumulated per rank and step without sync, the ordered reduce-scatter, DCP checkpoints at 0
and ``--steps``. The job's step time is rank 0's wall time of a recorded step (median).

Then ``sdc-forensics replay --from 0 --to STEPS-1`` runs with ``k`` = 1 process (the whole-model
replay: no launcher) and under ``torchrun --standalone --nproc-per-node k`` with
``SDC_FORENSICS_REPLAY_SHARDED=1`` for ``k`` = 2 and 4 (the model ``fully_shard``-ed over the
``k`` processes), alternating (repetition *i* of every ``k``, then *i + 1*), ``--repeat`` times.
Every replay must certify (exit 0, exact). Each replay process reports, from inside itself:

* its **resident set** just before the command starts (torch, the package, the CLI, DCP and FSDP
  imported, the fingerprint kernel loaded): the interpreter's floor, the same at every ``k``;
* its **peak resident set** at the end: the kernel's high-water mark of the process's pages
  (``VmHWM``), reset to the floor just before the command (``/proc/self/clear_refs``, Linux); it
  includes glibc's arenas and gloo's buffers (torch's CPU allocator has no peak counter, and
  ``tracemalloc`` does not see its allocations);
* the difference, **the replay's peak**: what the replay itself added, model state, gradients,
  activations and communication buffers included;
* the command's wall time (checkpoint load and model build included), divided by the steps replayed.

The memory plan's estimate per process (``replay/memory.py``, no activation allowance) is printed
beside it: ``(model state + accumulator)/k`` plus ``k``-independent terms (the unsharded local
gradient FSDP2 accumulates without sync, as the job itself held it, its largest parameter once more
for the flat copy, three of the largest parameter group for FSDP2's all-gathers, the runtime
allowance). The plan must be at least the measured peak.

``--phases`` adds one replay per ``k`` whose stages (build and load, forward, backward, the flat
copy, the exchange, the optimizer step, ...) are wrapped: at each stage's start and end the
high-water mark is read and reset, so each stage reports the resident set when it starts and its
peak (above the floor, the maximum over the replay and over processes): where the peak is.

    python benchmarks/bench_sharded_replay.py [--width 512] [--steps 3] [--repeat 3] [--phases] [--json]

``--json`` prints one document on stdout (per ``k``: median peak and floor in MiB over processes
and repetitions, seconds per replayed step; the job's step time; with ``--phases`` the stages'
table per ``k``); people's lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
WORLD, MICROBATCH, ACCUMULATE = 4, 64, 2
RECIPE = "bench_sharded_replay:WideRecipe"


def build_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width), nn.LayerNorm(width))
        for _ in range(2)
    ]
    return nn.Sequential(*blocks)


def microbatch(microbatch_id: int, width: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + microbatch_id)
    x = torch.randn(MICROBATCH, width, generator=gen)
    return x.to(device), torch.roll(x, 1, dims=1).to(device)


class WideRecipe:
    """The replay recipe of the benchmark's job (``sdc_forensics.recipe``'s protocol)."""

    def __init__(self, width: int = 512) -> None:
        self.width = width

    def build(self, device="cpu"):
        model = build_model(self.width).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None

    def load_checkpoint(self, path, model, optimizer, scheduler) -> None:
        from sdc_forensics.demo.sharded import load_dcp

        load_dcp(path, model, optimizer)

    def fetch_microbatch(self, microbatch_id: int, device="cpu"):
        return microbatch(microbatch_id, self.width, device)

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


def _job_rank(rank: int, port: int, out: str, width: int, steps: int) -> None:
    """One rank of the recorded FSDP2 job; rank 0 writes its step times."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.demo.sharded import dcp_state
    from sdc_forensics.recorder import Recorder, RecorderOptions

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
    model = build_model(width)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    trace, ckpt = Path(out, "trace"), Path(out, "checkpoints")
    with Recorder(
        trace,
        model,
        optimizer,
        recipe=RECIPE,
        recipe_args={"width": width},
        options=RecorderOptions(reduction="ordered"),
    ) as rec:
        for step in range(steps + 1):
            if step in (0, steps):
                rec.checkpoint(step, ckpt / f"step-{step:08d}", dcp_state(model, optimizer))
            if step == steps:
                break
            first = (step * WORLD + rank) * ACCUMULATE
            ids = list(range(first, first + ACCUMULATE))
            dist.barrier()
            start = time.perf_counter()
            with rec.step(step, microbatch_ids=ids) as h:
                for m, mb in enumerate(ids):
                    model.set_requires_gradient_sync(m == ACCUMULATE - 1)
                    x, y = h.input(microbatch(mb, width))
                    loss = nn.functional.mse_loss(model(x), y)
                    h.loss(loss)
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out, "job.json").write_text(json.dumps({"step_seconds": times}))


def _status(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process (bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def worker(out: str, args: list[str]) -> None:
    """One replay process: the CLI run in this process; its floor, peak and wall time written to ``out``."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import sdc_forensics.replay.sharded_replayer  # noqa: F401
    from sdc_forensics.cli.main import cli
    from sdc_forensics.fingerprint.core import warm_up

    # what every replay loads first (the fingerprint kernel compiled or read from numba's cache)
    warm_up(torch.device("cpu"), dtypes=[torch.float32])
    probe = _PhaseProbe() if os.environ.get("BENCH_PHASES") == "1" else None
    # the high-water mark restarts from here (Linux: clear_refs 5 resets VmHWM to VmRSS)
    Path("/proc/self/clear_refs").write_text("5")
    floor = _status("VmRSS")
    start = time.perf_counter()
    try:
        code = cli.main(args, prog_name="sdc-forensics", standalone_mode=False)
    except SystemExit as done:
        code = done.code
    seconds = time.perf_counter() - start
    if probe is not None:
        probe.mark()
    peak = _status("VmHWM")
    rank = int(os.environ.get("RANK", "0"))
    phases = probe.table(floor) if probe is not None else {}
    Path(out, f"rank-{rank}.json").write_text(
        json.dumps({"floor": floor, "peak": peak, "seconds": seconds, "code": code, "phases": phases})
    )


class _PhaseProbe:
    """Where a replay process's resident set peaks (``--phases``): the replay's stages wrapped, the
    high-water mark read and reset (``clear_refs``) at every stage's start and end, each peak and the
    resident set at the stage's start kept per stage (their maxima over the replay)."""

    def __init__(self) -> None:
        import torch.optim

        from sdc_forensics.replay import replayer, sharded_replayer

        self.stack, self.peaks, self.held = ["other"], {}, {}
        S = sharded_replayer.ShardedReplayer
        self._wrap(sharded_replayer, "_recipe_call", "build and load (meta build, fully_shard, DCP)")
        self._wrap(replayer, "_recipe_call", "build and load (meta build, fully_shard, DCP)")
        # the recipe the replay loads is the module's, not this script's __main__ copy
        import bench_sharded_replay as module

        self._wrap(module.WideRecipe, "loss", "forward (FSDP2 all-gathers)")
        self._wrap(torch.autograd, "backward", "backward (all-gathers, the unsharded local gradient)")
        self._wrap(S, "_local", "flat copy of the local gradient")
        self._wrap(S, "digest_of", "fingerprint")
        self._wrap(S, "fp_of", "fingerprint")
        self._wrap(S, "_all_to_all", "exchange (all_to_all, accumulator)")
        self._wrap(S, "_compare_weights", "weights shards compared")
        self._wrap(torch.optim.AdamW, "step", "optimizer step")

    def _wrap(self, owner, name: str, label: str) -> None:
        import functools

        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            self.mark()
            self.stack.append(label)
            self.held[label] = max(self.held.get(label, 0), _status("VmRSS"))
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark()
                self.stack.pop()

        setattr(owner, name, wrapped)

    def mark(self) -> None:
        """The stage now running peaked at ``VmHWM`` since the last mark; the mark restarts."""
        label = self.stack[-1]
        self.peaks[label] = max(self.peaks.get(label, 0), _status("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")

    def table(self, floor: int) -> dict:
        return {
            label: {"held_at_start": self.held.get(label, floor) - floor, "peak": peak - floor}
            for label, peak in self.peaks.items()
        }


def _replay(k: int, trace: Path, steps: int, out: Path, phases: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (trace / "ledger.jsonl").unlink(missing_ok=True)
    args = ["replay", str(trace), "--from", "0", "--to", str(steps - 1), "--json"]
    me = [str(Path(__file__).resolve()), "--worker", str(out), "--"] + args
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"}
    env["BENCH_PHASES"] = "1" if phases else "0"
    if k == 1:
        cmd = [sys.executable] + me
    else:
        env["SDC_FORENSICS_REPLAY_SHARDED"] = "1"
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--rdzv-endpoint=localhost:{port}",
            f"--nproc-per-node={k}",
        ] + me
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    doc = json.loads(done.stdout[done.stdout.index("{") :]) if "{" in done.stdout else {}
    if done.returncode != 0 or doc.get("comparison") != "exact":
        raise SystemExit(f"the k={k} replay did not certify (exit {done.returncode}): {done.stderr[-2000:]}")
    if k > 1 and "(sharded)" not in json.dumps(doc):
        raise SystemExit(f"the k={k} replay was not sharded")
    return {r: json.loads((out / f"rank-{r}.json").read_text()) for r in range(k)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--phases", action="store_true", help="one more replay per k with its stages probed: where the peak is"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts, rest = parser.parse_known_args()
    if opts.worker:
        worker(opts.worker, rest[1:] if rest[:1] == ["--"] else rest)
        return
    import bench_sharded_replay as me

    from sdc_forensics.demo import forked
    from sdc_forensics.replay import memory

    say = lambda *a: print(*a, file=sys.stderr)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench_sharded_replay_") as tmp:
        root = Path(tmp)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        forked.start(me._job_rank, (port, str(root / "job"), opts.width, opts.steps), WORLD)
        trace = root / "job" / "trace"
        job_step = statistics.median(json.loads((root / "job" / "job.json").read_text())["step_seconds"])
        os.environ[memory.ACTIVATIONS_ENV] = "0"
        plan = memory.plan_trace(trace)
        numel = plan.numel
        say(f"job: FSDP over {WORLD} gloo ranks, {numel / 1e6:.2f} M parameters, AdamW; step {job_step:.3f} s (median)")
        runs: dict[int, list] = {1: [], 2: [], 4: []}
        for i in range(opts.repeat):
            for k in runs:
                runs[k].append(_replay(k, trace, opts.steps, root / f"r{i}-k{k}"))
        mib = 1 << 20
        result = {"numel": numel, "world_size": WORLD, "job_step_seconds": job_step, "k": {}}
        say(f"{'k':>2} {'floor MiB':>10} {'peak MiB':>9} {'replay MiB':>11} {'plan MiB':>9} {'s/step':>7} {'x job':>6}")
        for k, reps in runs.items():
            procs = [p for rep in reps for p in rep.values()]
            floor = statistics.median(p["floor"] for p in procs) / mib
            peak = statistics.median(p["peak"] for p in procs) / mib
            added = statistics.median((p["peak"] - p["floor"]) for p in procs) / mib
            per_step = statistics.median(max(p["seconds"] for p in rep.values()) for rep in reps) / opts.steps
            planned = plan.per_process(k) / mib
            result["k"][str(k)] = {
                "floor_mib": round(floor, 1),
                "peak_mib": round(peak, 1),
                "replay_peak_mib": round(added, 1),
                "plan_mib": round(planned, 1),
                "seconds_per_step": round(per_step, 3),
                "x_job_step": round(per_step / job_step, 1),
            }
            say(
                f"{k:>2} {floor:>10.1f} {peak:>9.1f} {added:>11.1f} {planned:>9.1f} {per_step:>7.2f} "
                f"{per_step / job_step:>6.1f}"
            )
        say(f"model state (parameters, gradients, AdamW's two moments): {plan.state_bytes / mib:.1f} MiB")
        result["state_mib"] = round(plan.state_bytes / mib, 1)
        if opts.phases:
            result["phases"] = {}
            for k in runs:
                # a separate replay: the probe's resets of the high-water mark would disturb the peaks above
                procs = _replay(k, trace, opts.steps, root / f"phases-k{k}", phases=True).values()
                labels = sorted({label for p in procs for label in p["phases"]})
                table = {
                    label: {
                        field: round(max(p["phases"].get(label, {}).get(field, 0) for p in procs) / mib, 1)
                        for field in ("held_at_start", "peak")
                    }
                    for label in labels
                }
                result["phases"][str(k)] = table
                say(f"k = {k}: MiB above the floor (max over processes), held at the stage's start, peak during it")
                for label, row in sorted(table.items(), key=lambda item: -item[1]["peak"]):
                    say(f"  {label:<55} {row['held_at_start']:>7.1f} {row['peak']:>7.1f}")
    if opts.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
