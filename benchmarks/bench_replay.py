"""Replay cost and bisection efficiency on real demo runs (4-process gloo DDP on CPU).

Two figures:

1. **Replay vs training, same device.** A clean demo run of ``--steps`` steps is recorded; then,
   side by side and interleaved (repetition *i* of each contender, then *i + 1*), median of
   ``--repeat``:

   * *train*: one rank's share of those steps on this device, as the job does it: the recipe's
     microbatches, forward/backward with accumulation, ``optimizer.step()`` (no collective: on
     one device a rank's compute is the baseline a replay is compared with);
   * *replay*: ``replay_window`` over the same steps from checkpoint 0: all ``W`` ranks'
     recomputation, the fingerprints of every rank's gradient, the average in gloo's ring order,
     the optimizer step, the weights digest and every comparison with the trace.

   The ratio replay / train; replay recomputes all ``W`` ranks, so the goal is ``<= 1.2 x W``.

2. **Steps replayed per localised incident.** Demo runs with one injected fault each (the
   locations of the recorder issue, and one fault the trace cannot see), then ``bisect``; the
   number of steps it replayed against the checkpoint interval (goal: at most one interval when
   the trace has evidence).

    python benchmarks/bench_replay.py [--steps 12] [--repeat 3] [--incident-steps 20 --every 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sdc_forensics.demo.recipe import recipe as demo_recipe
from sdc_forensics.demo.run import run_demo
from sdc_forensics.forensics.bisect import BisectOptions, bisect
from sdc_forensics.forensics.replay import ReplayOptions, replay_window
from sdc_forensics.forensics.triage import triage_trace
from sdc_forensics.recipe import after_step, before_step, load_trace_recipe
from sdc_forensics.trace.checkpoints import read_checkpoint_notes
from sdc_forensics.trace.reader import Trace


def train_one_rank(checkpoint: Path, steps: int, world_size: int, rank: int = 0) -> float:
    """Seconds to train ``steps`` steps of one rank's share, from a checkpoint, on this device."""
    model, optimizer, scheduler = demo_recipe.build("cpu")
    demo_recipe.load_checkpoint(checkpoint, model, optimizer, scheduler)
    start = time.perf_counter()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for mb_id in demo_recipe.microbatch_ids(step, rank, world_size):
            demo_recipe.loss(model, demo_recipe.fetch_microbatch(mb_id)).backward()
        before_step(demo_recipe, model, optimizer)
        optimizer.step()
        after_step(demo_recipe, model, optimizer, scheduler)
    return time.perf_counter() - start


def replay_steps(trace_dir: Path, checkpoint: Path, steps: int) -> tuple[float, str]:
    trace = Trace.open(trace_dir)
    note = read_checkpoint_notes(trace_dir)[0]
    options = ReplayOptions(start_step=0, stop_step=steps - 1, checkpoint_path=checkpoint, expected_weights_digest=note.weights_digest)
    recipe = load_trace_recipe(trace.manifest)
    start = time.perf_counter()
    result = replay_window(trace, recipe, options)
    elapsed = time.perf_counter() - start
    assert result.first_divergent_step is None and result.last_step == steps - 1, result
    return elapsed, result.comparison


def ratio(work: Path, steps: int, repeat: int, world_size: int) -> dict:
    out = work / "clean"
    run_demo(out, injections=("none",), steps=steps, checkpoint_every=steps, world_size=world_size)
    checkpoint = out / "checkpoints/step-00000000.pt"
    threads = json.loads((out / "trace/manifest.json").read_text())["attempts"][0]["determinism"].get("num_threads")
    torch.set_num_threads(int(threads or torch.get_num_threads()))
    train_s, replay_s, comparison = [], [], ""
    for _ in range(repeat):
        train_s.append(train_one_rank(checkpoint, steps, world_size))
        seconds, comparison = replay_steps(out / "trace", checkpoint, steps)
        replay_s.append(seconds)
    t, r = statistics.median(train_s), statistics.median(replay_s)
    return {"steps": steps, "world_size": world_size, "threads": torch.get_num_threads(), "train_s": t, "replay_s": r,
            "ratio": r / t, "ratio_per_rank": r / t / world_size, "goal": 1.2 * world_size, "comparison": comparison}


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
    rows = []
    mid, on = 2 * every + every // 2, 2 * every
    for template in INCIDENTS:
        spec = template.format(mid=mid, on=on)
        out = work / spec.replace(":", "_").replace("=", "")
        run_demo(out, injections=(spec,), steps=steps, checkpoint_every=every)
        evidence = bool(triage_trace(Trace.open(out / "trace")).findings)
        result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
        injected_step = int(spec.split("step=")[1].split(":")[0])
        rows.append({"spec": spec, "trace_evidence": evidence, "found_step": result.first_divergent_step,
                     "correct": result.first_divergent_step == injected_step, "steps_replayed": result.replayed.steps_replayed,
                     "windows": [(w.start, w.last) for w in result.replayed.windows], "interval": every})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps replayed and trained for the ratio")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--incident-steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="checkpoint interval of the incident runs")
    parser.add_argument("--skip-incidents", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        figures = {"machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}".strip(),
                   "ratio": ratio(work, args.steps, args.repeat, args.world_size)}
        if not args.skip_incidents:
            figures["incidents"] = incidents(work, args.incident_steps, args.every)
    r = figures["ratio"]
    print(f"replay {r['steps']} steps: {r['replay_s']:.3f} s; train one rank's {r['steps']} steps: {r['train_s']:.3f} s; "
          f"ratio {r['ratio']:.2f} (= {r['ratio_per_rank']:.2f} x W, goal <= {r['goal']:.1f}); comparison {r['comparison']}")
    for row in figures.get("incidents", []):
        print(f"{row['spec']:<40} evidence={'yes' if row['trace_evidence'] else 'no ':<3} found={row['found_step']} "
              f"correct={row['correct']} replayed={row['steps_replayed']} (interval {row['interval']}) windows={row['windows']}")
    print(json.dumps(figures, default=str))


if __name__ == "__main__":
    main()
