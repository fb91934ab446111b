"""Replay cost and bisection efficiency on real recorded runs (``W``-process gloo DDP on CPU).

Two figures:

1. **Replay vs training, same device, two model sizes.** For the demo MLP (26,122 parameters)
   and a wide MLP of the same job (``DemoRecipe(in_features=512, hidden=3072)``: 11,046,922
   parameters, 44 MB of float32 gradients per rank), a clean run of ``S`` steps is recorded by
   the real demo job (``W`` gloo processes, the recorder on, one thread each); then, side by
   side and interleaved (repetition *i* of each contender, then *i + 1*), median of
   ``--repeat``:

   * *train*: one rank's share of those ``S`` steps, in this process, as the job does it with
     the recorder on: a one-process gloo group, ``DistributedDataParallel``, ``Recorder`` (local
     and reduced gradient fingerprints, weights digest, trace written every step), the recipe's
     microbatches of rank 0 accumulated under ``no_sync``, ``optimizer.step()``; from
     checkpoint 0, at the recorded thread count. Set-up (process group, DDP, recorder) is not
     timed; the all-reduce of one process moves nothing, so the baseline is a rank's compute
     and the recorder, not the network (a stricter baseline than a real step);
   * *replay*: ``replay_window`` over the same steps from checkpoint 0, everything included
     (model build, checkpoint load, all ``W`` ranks' recomputation, fingerprints, the average
     in gloo's ring order, the optimizer step, the weights digest, every comparison).

   * *bare* (information only): the same share with no DDP and no recorder, the bare compute
     (this benchmark's baseline before the 10 M model was added).

   The figure: (replay seconds per replayed step) / (``W`` x training seconds per step); a
   replay recomputes all ``W`` ranks, so 1.0 is the bare minimum and the goal is ``<= 1.2``.
   Each replay must come out ``exact`` (bitwise) and clean, or the benchmark fails.

2. **Steps replayed per localised incident.** Demo runs with one injected fault each (the
   locations of the recorder issue, and one fault the trace cannot see), then ``bisect``; the
   number of steps it replayed against the checkpoint interval (goal: at most one interval when
   the trace has evidence). Skipped by ``--quick``, ``--json`` and ``--skip-incidents``.

    python benchmarks/bench_replay.py [--repeat 5] [--quick] [--json] [--skip-incidents]

``--json`` prints ``{"replay_vs_training_demo": {value, unit, goal, met, ...},
"replay_vs_training_10m": {...}}`` on stdout (what ``benchmarks/run_all.py`` reads); people's
lines go to stderr. ``--quick`` (45 s on 2 quiet cores, 3 min at load 13): fewer steps and repetitions, and
``W = 2`` for the wide model.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sdc_forensics.demo.recipe import DemoRecipe
from sdc_forensics.demo.run import RECIPE_REFERENCE, run_demo, train_step
from sdc_forensics.replay.replayer import ReplayOptions
from sdc_forensics.replay.window import replay_window
from sdc_forensics.recipe import load_trace_recipe
from sdc_forensics.trace.checkpoints import read_checkpoint_notes
from sdc_forensics.trace.reader import Trace

GOAL = 1.2  # replay seconds per step / (W x training seconds per step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """One model of the comparison: a name, the demo job's settings, its run's size."""

    name: str
    recipe_args: dict | None
    world_size: int
    steps: int

    @property
    def recipe(self) -> DemoRecipe:
        return dataclasses.replace(DemoRecipe(), **(self.recipe_args or {}))

    @property
    def num_params(self) -> int:
        model, _, _ = self.recipe.build("cpu")
        return sum(p.numel() for p in model.parameters())


WIDE = {"in_features": 512, "hidden": 3072}  # 11,046,922 parameters


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def record(work: Path, model: Model) -> Path:
    """A clean recorded run of ``model.steps`` steps (checkpoint 0 and at the end)."""
    out = work / model.name
    run_demo(
        out,
        injections=("none",),
        steps=model.steps,
        checkpoint_every=model.steps,
        world_size=model.world_size,
        recipe=RECIPE_REFERENCE,
        recipe_args=model.recipe_args,
    )
    return out


def train_recorded(out: Path, model: Model, work: Path, index: int) -> float:
    """Seconds for rank 0's share of the run's steps, from checkpoint 0, with the recorder on
    (one-process gloo group already initialised)."""
    from torch.nn.parallel import DistributedDataParallel

    from sdc_forensics.recorder import Recorder, RecorderOptions

    recipe = model.recipe
    net, optimizer, scheduler = recipe.build("cpu")
    recipe.load_checkpoint(out / "checkpoints/step-00000000.pt", net, optimizer, scheduler)
    ddp = DistributedDataParallel(net)
    rec = Recorder(
        work / f"train-{model.name}-{index}",
        ddp,
        optimizer,
        recipe=RECIPE_REFERENCE,
        recipe_args=model.recipe_args,
        options=RecorderOptions(policy="continue", node_of_rank=(0,)),
    )
    try:
        start = time.perf_counter()
        for step in range(model.steps):
            ids = recipe.microbatch_ids(step, 0, model.world_size)
            with rec.step(step, microbatch_ids=ids) as handle:
                train_step(
                    ddp,
                    optimizer,
                    recipe,
                    (recipe.fetch_microbatch(i, "cpu") for i in ids),
                    len(ids),
                    handle,
                    scheduler,
                )
        return time.perf_counter() - start
    finally:
        rec.close()


def train_bare(out: Path, model: Model) -> float:
    """Seconds for rank 0's share of the steps with no DDP and no recorder: the bare compute
    (the baseline of this benchmark's earlier figure, kept for comparison)."""
    from sdc_forensics.recipe import after_step, before_step

    recipe = model.recipe
    net, optimizer, scheduler = recipe.build("cpu")
    recipe.load_checkpoint(out / "checkpoints/step-00000000.pt", net, optimizer, scheduler)
    start = time.perf_counter()
    for step in range(model.steps):
        optimizer.zero_grad(set_to_none=True)
        for mb_id in recipe.microbatch_ids(step, 0, model.world_size):
            recipe.loss(net, recipe.fetch_microbatch(mb_id)).backward()
        before_step(recipe, net, optimizer)
        optimizer.step()
        after_step(recipe, net, optimizer, scheduler)
    return time.perf_counter() - start


def replay_steps(out: Path, steps: int) -> tuple[float, str]:
    """Seconds of ``replay_window`` over steps ``0..steps-1``, and its comparison (must be clean)."""
    trace = Trace.open(out / "trace")
    note = read_checkpoint_notes(out / "trace")[0]
    options = ReplayOptions(
        start_step=0,
        stop_step=steps - 1,
        checkpoint_path=out / "checkpoints/step-00000000.pt",
        expected_weights_digest=note.weights_digest,
    )
    recipe = load_trace_recipe(trace.manifest)
    start = time.perf_counter()
    result = replay_window(trace, recipe, options)
    elapsed = time.perf_counter() - start
    if result.first_divergent_step is not None or result.last_step != steps - 1 or result.evidence:
        raise SystemExit(f"a clean replay of {out} found evidence: {result}")
    return elapsed, result.comparison


def ratios(work: Path, models: list[Model], repeat: int) -> dict:
    """Record each model's run, then train and replay them interleaved; medians and ratios."""
    import torch.distributed as dist

    runs = {m.name: record(work, m) for m in models}
    threads = {}
    for m in models:
        determinism = json.loads((runs[m.name] / "trace/manifest.json").read_text())["attempts"][0]["determinism"]
        threads[m.name] = int(determinism.get("num_threads") or torch.get_num_threads())
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    times: dict[str, dict[str, list]] = {
        m.name: {"train": [], "bare": [], "replay": [], "comparison": []} for m in models
    }
    try:
        for i in range(repeat):
            for m in models:
                torch.set_num_threads(threads[m.name])  # training's count (replay applies the recorded one itself)
                times[m.name]["train"].append(train_recorded(runs[m.name], m, work, i))
                times[m.name]["bare"].append(train_bare(runs[m.name], m))
                seconds, comparison = replay_steps(runs[m.name], m.steps)
                times[m.name]["replay"].append(seconds)
                times[m.name]["comparison"].append(comparison)
            print(f"repetition {i + 1}/{repeat} done", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    figures = {}
    for m in models:
        t, r = statistics.median(times[m.name]["train"]), statistics.median(times[m.name]["replay"])
        bare = statistics.median(times[m.name]["bare"])
        value = (r / m.steps) / (m.world_size * t / m.steps)
        comparisons = sorted(set(times[m.name]["comparison"]))
        figures[f"replay_vs_training_{m.name}"] = {
            "value": round(value, 3),
            "unit": "x W",
            "goal": GOAL,
            "goal_op": "<=",
            "met": value <= GOAL,
            "params": m.num_params,
            "world_size": m.world_size,
            "steps": m.steps,
            "threads": threads[m.name],
            "repeat": repeat,
            "train_s_per_step": round(t / m.steps, 5),
            "replay_s_per_step": round(r / m.steps, 5),
            "bare_train_s_per_step": round(bare / m.steps, 5),
            "vs_bare_compute": round(r / (m.world_size * bare), 3),
            "comparison": "/".join(comparisons),
        }
    return figures


INCIDENTS = [
    "grad:step={mid}:rank=2:bit=30",
    "allreduce:step={mid}:rank=1:bit=29",
    "allreduce-all:step={on}:rank=0:bit=30",
    "weights:step={mid}:rank=3:bit=22",
    "update:step={on}:rank=0:bit=31",
    "input:step={mid}:rank=1:bit=30",
    "grad:step={mid}:rank=1:bit=12",  # no trace evidence: inside the sketch tolerance, no audit
]


def incidents(work: Path, steps: int, every: int) -> list[dict]:
    from sdc_forensics.forensics.bisect import BisectOptions, bisect
    from sdc_forensics.triage.trace_only import triage_trace

    rows = []
    mid, on = 2 * every + every // 2, 2 * every
    for template in INCIDENTS:
        spec = template.format(mid=mid, on=on)
        out = work / spec.replace(":", "_").replace("=", "")
        run_demo(out, injections=(spec,), steps=steps, checkpoint_every=every)
        evidence = bool(triage_trace(Trace.open(out / "trace")).findings)
        result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
        injected_step = int(spec.split("step=")[1].split(":")[0])
        rows.append(
            {
                "spec": spec,
                "trace_evidence": evidence,
                "found_step": result.first_divergent_step,
                "correct": result.first_divergent_step == injected_step,
                "steps_replayed": result.replayed.steps_replayed,
                "windows": [(w.start, w.last) for w in result.replayed.windows],
                "interval": every,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=None, help="interleaved repetitions (default 5; --quick 3)")
    parser.add_argument(
        "--demo-steps", type=int, default=None, help="steps of the demo model's run (default 12; --quick 6)"
    )
    parser.add_argument(
        "--wide-steps", type=int, default=None, help="steps of the 11 M-parameter model's run (default 4; --quick 3)"
    )
    parser.add_argument("--world-size", type=int, default=4, help="W of the demo model's run")
    parser.add_argument(
        "--wide-world-size", type=int, default=None, help="W of the 11 M model's run (default 4; --quick 2)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps and repetitions, W = 2 for the wide model (about a minute)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document on stdout")
    parser.add_argument("--incident-steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval of the incident runs")
    parser.add_argument("--skip-incidents", action="store_true")
    args = parser.parse_args()
    quick = args.quick
    repeat = args.repeat or (3 if quick else 5)
    models = [
        Model(name="demo", recipe_args=None, world_size=args.world_size, steps=args.demo_steps or (6 if quick else 12)),
        Model(
            name="10m",
            recipe_args=WIDE,
            world_size=args.wide_world_size or (2 if quick else 4),
            steps=args.wide_steps or (3 if quick else 4),
        ),
    ]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        figures = ratios(work, models, repeat)
        rows = [] if quick or args.json or args.skip_incidents else incidents(work, args.incident_steps, args.every)
    machine = f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}".strip()
    for name, f in figures.items():
        print(
            f"{name}: {f['params']:,} params, W={f['world_size']}, {f['steps']} steps, median of {f['repeat']}: replay "
            f"{f['replay_s_per_step'] * 1e3:.1f} ms/step, train one rank {f['train_s_per_step'] * 1e3:.1f} ms/step (recorder on) "
            f"-> {f['value']:.3f} x W (goal <= {GOAL}: {'met' if f['met'] else 'NOT met'}), comparison {f['comparison']}; "
            f"vs bare compute (no DDP, no recorder: {f['bare_train_s_per_step'] * 1e3:.1f} ms/step) {f['vs_bare_compute']:.3f} x W",
            file=sys.stderr,
        )
    for row in rows:
        print(
            f"{row['spec']:<40} evidence={'yes' if row['trace_evidence'] else 'no ':<3} found={row['found_step']} "
            f"correct={row['correct']} replayed={row['steps_replayed']} (interval {row['interval']}) windows={row['windows']}",
            file=sys.stderr,
        )
    print(f"{machine}; {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    else:
        print(json.dumps({"machine": machine, "figures": figures, "incidents": rows}, default=str, sort_keys=True))


if __name__ == "__main__":
    main()
