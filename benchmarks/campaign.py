"""Fault campaign: injected faults at every location, bit class and kind of step, judged by the CLI.

Each run trains the conv net recipe (``sdc_forensics.demo.convnet``, a seeded variant per clean
run) with 4-process ``gloo`` DDP on CPU, clean or with one bit flip. Faults cycle through every
(location, bit class) pair in a seeded order:

* locations: every one ``sdc_forensics.inject`` knows (``grad``, ``allreduce``, ``allreduce-all``,
  ``weights``, ``update``, ``input``, ``checkpoint-file``);
* bit classes: sign (31), exponent (30..23), high mantissa (22..16), low mantissa (7..0);
* steps: on a checkpoint, right after one, mid-interval (cycling); ranks 0..3 drawn.

Then the three commands judge every run, in the run's own process (``click``'s test runner on
``sdc_forensics.cli.main``, so torch is imported once per run, not once per command), after the
online checks' own answer, ``bisect --trace-only`` (the trace alone: no replay, no file read)::

    sdc-forensics bisect TRACE --json --trace-only
    sdc-forensics bisect TRACE --json
    sdc-forensics certify TRACE --json
    sdc-forensics verify-checkpoint CKPT --trace TRACE --json     (every checkpoint)

Faulted runs are replayed as recorded (bitwise). Every other clean run is replayed with
``--threads 2`` (training uses 1), so the tolerant path is measured too: there a clean run must
be ``inconclusive`` (a tolerant comparison certifies nothing), never ``corruption``.

A fault is *effective* when it changed the training state beyond tolerance, measured against the
clean twin (the clean run of the same variant, bitwise identical before the fault, checked):
the faulted rank's recorded local and reduced sketches at the fault step and the next, in units
of ``relative_tolerance(dtype, W) * norm``, above 1; for ``checkpoint-file``, the file's bytes
differ from the twin's checkpoint. Ineffective faults are counted apart, with their effect on
the final loss; ``changed_nothing`` counts those whose run recorded the twin's every gradient and weights digest
(the flip reached nothing the training computed): a checkpoint after one called clean is clean, and
is not counted in ``false_clean_ineffective``.

Tallies over effective faults: ``detected`` (verdict ``corruption``), ``exact_step_rank`` (the
first divergent step is the fault step and the suspects are exactly the fault's rank; for
``allreduce-all`` no single rank, for ``checkpoint-file`` checkpoint N is the one corrupt file
and the suspect is the rank that wrote it), ``location_correct`` (every suspect's location is
the injection's: grad -> ``local_compute``, weights -> ``state_at_rest``, allreduce/allreduce-all -> ``collective``,
update -> ``optimizer_update``, input -> ``input_data``, checkpoint-file -> ``storage``),
``false_clean_certificates`` (some command calls a checkpoint clean that holds the fault's
effect: ``N > s`` for a training fault, ``N = s`` for a checkpoint file), and over clean runs
``false_alarms`` (verdict ``corruption``, a checkpoint ``corrupt``/``tainted``, or a
verify-checkpoint exit 1).

The trace-only answer is judged by the same code (``_exact``): ``trace_only_detected`` (verdict
``corruption``), ``trace_only_exact`` (the exact rule above, its own checkpoint statuses standing
for the commands'), ``trace_only_wrong_rank`` (a ``corruption`` answer naming a rank the fault did
not touch) and, over clean runs, ``trace_only_false_alarms`` (``corruption``, or a checkpoint
``corrupt``/``tainted``). The tables per location and per bit class put them next to the replay's;
``--rates FILE`` writes that summary with the machine and command as a small JSON file
(``sdc_forensics/measured/trace_only_rates.json``) for other code to quote. A ``--rejudge`` of a
campaign.json from before these fields says "not measured".

    python benchmarks/campaign.py --faults 200 --clean 20 --seed 1 [--json] [--jobs 2] [--out DIR]
        [--steps 12] [--checkpoint-every 4]
    python benchmarks/campaign.py --rejudge campaign.json [--rates FILE]    # re-tally an earlier --json output

``--locations a,b`` draws the faults from those of the job's locations only (``--locations input``:
the input-only campaigns of docs/benchmarks.md).

The job's collective (issue 21): ``--comm-hook MODULE:ATTR`` trains every run through that DDP comm
hook (``sdc_forensics.demo.hooks:reversed_mean`` sums in an order the replay does not know) and
``--reduction ordered`` records with the ordered reduction composed with it; ``--tolerant-threads 0``
replays every clean run as recorded. ``clean_runs_certified`` counts the clean runs whose every
checkpoint ``certify`` calls clean, ``certified_after_0`` the runs (clean or not) in which it calls
any checkpoint after 0 clean::

    python benchmarks/campaign.py --faults 21 --clean 10 --steps 8 --checkpoint-every 4 --tolerant-threads 0 \
        --comm-hook sdc_forensics.demo.hooks:reversed_mean --reduction native    # then --reduction ordered

Tensor parallelism (issue 36): ``--parallel tp`` trains ``demo/tp.py``'s job (TP 2 with sequence
parallel x FSDP2 DP 2, 4 gloo processes, AdamW, DCP checkpoints) and judges it as a user would:
``bisect`` and ``certify`` each under ``torchrun --nproc-per-node 2 -m sdc_forensics`` (the exact
TP replay; the exit code kept is process 0's), ``bisect --trace-only`` and ``verify-checkpoint
--trace`` in the run's process (the latter reuses the intervals the exact replay certified, from the
trace's ledger, and replays the rest on one process, tolerant: it certifies none of them). Its locations: a TP rank's local gradient, its DP reduce-scatter output, its
all-gathered parameter copy, its weight shard at rest, its update, and the demo's ``tp-collective``
drill (a TP reduce-scatter's output in the forward), and ``input`` (a token id; the drill keeps it a valid id,
``inject.flip_id_``). A fault in one rank's
forward (``tp-collective``, ``all-gather-output``) reaches its TP peers through TP's collectives:
the right answer names every rank of its DP coordinate::

    python benchmarks/campaign.py --parallel tp --faults 60 --clean 4 --seed 1 --steps 9 --checkpoint-every 4 \
        --jobs 2 --json

Pipeline parallelism: ``--parallel pp`` trains ``demo/pp.py``'s job (PP 2 x FSDP2 DP 2, 4 gloo
processes, Schedule1F1B, AdamW; rank r is stage r // 2, DP coordinate r % 2) and judges it with the
one-process exact replay, ``bisect`` and ``certify`` in the run's process as the DDP campaign does.
Its locations are TP's with the demo's ``pp-activation`` drill (the activation a stage-0 rank, 0 or 1,
sends) for ``tp-collective``. A fault in one stage's forward (``pp-activation``, ``all-gather-output``)
reaches the other stage of its pipeline: the right answer names ranks of that DP coordinate only,
among them the corrupted rank (``all-gather-output``) or the receiving rank r + 2 (``pp-activation``)::

    python benchmarks/campaign.py --parallel pp --faults 60 --clean 3 --seed 1 --steps 9 --checkpoint-every 4 \
        --jobs 2 --out DIR --json    # each run's row is also DIR/NNN-LOCATION/row.json

The 3-D job: ``--parallel 3d`` trains ``demo/pp.py``'s job with ``tp=2`` (PP 2 x FSDP2 DP 2 x TP 2, 8 gloo
processes; rank r is stage r // 4, DP coordinate r // 2 % 2, TP coordinate r % 2), judged as the TP job is
(``bisect`` and ``certify`` under torchrun, 2 processes). Its locations are both demos' (``tp-collective``
and ``pp-activation`` among them, the latter from ranks 0 to 3). A fault in one rank's forward reaches
the four ranks of its DP coordinate: the right answer names ranks among those only, the corrupted rank
(or, for ``pp-activation``, the receiving rank r + 4) among them::

    python benchmarks/campaign.py --parallel 3d --faults 30 --clean 2 --seed 1 --steps 9 --checkpoint-every 4 \
        --jobs 1 --out DIR --json

``--at-layout`` (``pp``, ``3d``): ``bisect`` and ``certify`` replay the job at its layout, one stage per
process under torchrun (PP x TP processes: 2 for PP, 4 for 3-D; ``replay/pp_exact.py``), not the whole
model; the judging is the same.

Over 400 lines on purpose: the plan, the run, the judge and the tally of one campaign share its row
format; the scoring tests (tests/demo/test_campaign.py, test_campaign_tp.py) load this one file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tolerant_campaign import checkpoint_statuses, measure_effect, normalise_status, run_children, weak_candidate  # noqa: E402

from sdc_forensics.inject import LOCATIONS  # noqa: E402

WORLD_SIZE = 4
BIT_CLASSES = {
    "sign": (31,),
    "exponent": (30, 29, 28, 27, 26, 25, 24, 23),
    "high_mantissa": (22, 21, 20, 19, 18, 17, 16),
    "low_mantissa": (7, 6, 5, 4, 3, 2, 1, 0),
}
STEP_KINDS = ("on_checkpoint", "after_checkpoint", "mid_interval")
#: The suspect location each injection location should be blamed on (docs/bisect.md).
EXPECTED_LOCATION = {
    "grad": "local_compute",
    "weights": "state_at_rest",
    "allreduce": "collective",
    "allreduce-all": "collective",
    "update": "optimizer_update",
    "input": "input_data",
    "checkpoint-file": "storage",
    # a sharded job's (--parallel fsdp|hsdp)
    "local-gradient": "local_compute",
    "reduce-scatter-output": "collective",
    "all-reduce-output": "collective",
    "all-gather-output": "local_compute",
    # a TP job's (--parallel tp): a corrupted TP collective's output is read by the forward of its DP coordinate's
    # ranks alone, so the replay sees their local compute differ (tests/replay/test_tp_collective_fault.py)
    "tp-collective": "local_compute",
    # a PP job's (--parallel pp): a corrupted activation stage 0 sends is read by the receiving stage's forward, so
    # the replay sees its local compute (and what it hands back) differ (tests/replay/test_pp_replay.py)
    "pp-activation": "local_compute",
}
#: --job: the sharded job's model, optimizer and clipping (demo/sharded.py's train): clipped-lm's gradient norm is several
#: times MAX_NORM on every step, so every update is clipped (tests/recorder/test_fsdp_clipping.py checks it engages)
SHARDED_JOBS = {"mlp": {}, "clipped-lm": {"model": "tied-lm", "optimizer": "adamw", "max_norm": 0.05}}

#: the FSDP2 locations of a TP or PP job's rank, before its demo's own drills and the input
_MODEL_PARALLEL = ("local-gradient", "reduce-scatter-output", "all-gather-output", "weights", "update")
#: --parallel: the locations a sharded job's faults are drawn from (its checkpoints are DCP
#: directories: a flipped file there is verify-checkpoint's own test, tests/checkpoint/test_dcp_sharded.py)
SHARDED_LOCATIONS = {
    "fsdp": ("local-gradient", "reduce-scatter-output", "all-gather-output", "weights", "update", "input"),
    "hsdp": (
        "local-gradient",
        "reduce-scatter-output",
        "all-reduce-output",
        "all-gather-output",
        "weights",
        "update",
        "input",
    ),
    # TP 2 x FSDP2 DP 2 (demo/tp.py): its input is token ids (the drill keeps a flipped id valid), and the TP demo's
    # own drill
    "tp": (*_MODEL_PARALLEL, "tp-collective", "input"),
    # PP 2 x FSDP2 DP 2 (demo/pp.py): token ids again, and the PP demo's own drill (stage 0's sent activation)
    "pp": (*_MODEL_PARALLEL, "pp-activation", "input"),
    # PP 2 x FSDP2 DP 2 x TP 2 (demo/pp.py with tp=2, 8 gloo processes): both demos' drills
    "3d": (*_MODEL_PARALLEL, "tp-collective", "pp-activation", "input"),
}
#: a TP job's faults in one rank's forward: its TP peers compute from what it computed (``_expected_ranks``)
TP_FORWARD = ("tp-collective", "all-gather-output")
#: a PP job's faults in one stage's forward: the other stage of its pipeline (same dp coordinate) computes from it
PP_FORWARD = ("pp-activation", "all-gather-output")
#: --parallel pp and 3d: the demos' DP size; rank = (pp * PP_DP + dp) * tp_degree + tp (PP: rank r has pp = r // 2,
#: dp = r % 2; 3-D: pp = r // 4, dp = r // 2 % 2, tp = r % 2)
PP_DP = 2
#: --mixed-precision: where a fault flips a bfloat16 (the all-gathered parameters, cast before the
#: all-gather); every other location holds float32 (the gradient is reduced in float32)
SIXTEEN_BIT = ("all-gather-output",)
#: checkpoint-file: the rank that writes checkpoints (the demo saves on rank 0).
WRITER_RANK = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """What the campaign runs (the command line, validated)."""

    faults: int
    clean: int
    seed: int
    out_dir: Path
    steps: int = 12
    checkpoint_every: int = 4
    jobs: int = 1
    tolerant_threads: int = 2
    comm_hook: str | None = None
    reduction: str = "native"
    # ddp (the conv net), fsdp (FSDP2 over 4 ranks) or hsdp (2 x 2): demo/sharded.py; tp (TP 2 x FSDP2 DP 2): demo/tp.py
    parallel: str = "ddp"
    mixed_precision: bool = False  # a sharded job computes in bfloat16 and reduces in float32 (torchtitan's default)
    job: str = "mlp"  # a sharded job's model: the MLP with SGD, or clipped-lm (the tied-head transformer, AdamW, clipping that engages)
    locations: tuple[str, ...] = ()  # --locations: draw faults from these of the job's locations only (empty: all)
    at_layout: bool = False  # --at-layout: a pipeline job replayed one stage per process (PP x TP, replay/pp_exact.py)

    def __post_init__(self) -> None:
        if self.faults < 0 or self.clean < 1:
            raise SystemExit("--faults must be >= 0 and --clean >= 1 (every fault needs a clean twin)")
        if self.checkpoint_every < 3 or self.steps < 2 * self.checkpoint_every:
            raise SystemExit("need --checkpoint-every >= 3 and --steps >= 2 intervals")
        if not 1 <= self.jobs <= 2:
            raise SystemExit("--jobs must be 1 or 2 (runs share 2 cores)")
        if self.parallel != "ddp" and (self.comm_hook or self.reduction != "native"):
            raise SystemExit(
                "--comm-hook and --reduction are DDP's; a sharded job records with the ordered reduce-scatter"
            )
        known = LOCATIONS if self.parallel == "ddp" else SHARDED_LOCATIONS[self.parallel]
        if set(self.locations) - set(known):
            raise SystemExit(f"--locations: {self.parallel}'s locations are {', '.join(known)}")
        if self.job not in SHARDED_JOBS:
            raise SystemExit(f"--job must be one of {', '.join(SHARDED_JOBS)}")
        if self.job != "mlp" and self.parallel == "ddp":
            raise SystemExit("--job is the sharded job's model: pass --parallel fsdp or hsdp")
        if self.mixed_precision and self.parallel == "ddp":
            raise SystemExit("--mixed-precision is a sharded job's MixedPrecisionPolicy: pass --parallel fsdp or hsdp")
        if self.at_layout and self.parallel not in ("pp", "3d"):
            raise SystemExit("--at-layout replays a pipeline job one stage per process: pass --parallel pp or 3d")
        if self.parallel in ("tp", "pp", "3d") and (self.job != "mlp" or self.mixed_precision):
            raise SystemExit(
                f"--parallel {self.parallel} trains demo/{self.parallel}.py's job as it is: no --job, no --mixed-precision"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """One run: its variant, its fault (None: clean), how it is replayed."""

    index: int
    variant: int
    fault: str | None = None
    location: str = ""
    bit_class: str = ""
    step_kind: str = ""
    replay_threads: int = 0  # 0: as recorded (bitwise)

    @property
    def name(self) -> str:
        return f"{self.index:03d}-{'clean' if self.fault is None else self.location}"


# ---------------------------------------------------------------------------------- planning
def plan_runs(options: Options) -> list[Plan]:
    """Clean runs (one variant each; every other one replayed at another thread count), then the
    faults on the clean runs' variants, cycling through (location, bit class) pairs in a seeded
    order and, independently, through the step kinds (28 pairs, 3 kinds: every pair meets every
    kind within 84 faults)."""
    rng = random.Random(options.seed)
    plans = [
        Plan(index=i, variant=rng.randrange(1, 100_000), replay_threads=options.tolerant_threads if i % 2 else 0)
        for i in range(options.clean)
    ]
    locations = LOCATIONS if options.parallel == "ddp" else SHARDED_LOCATIONS[options.parallel]
    if options.locations:
        locations = tuple(loc for loc in locations if loc in options.locations)
    pairs = [(location, bits) for location in locations for bits in BIT_CLASSES]
    rng.shuffle(pairs)
    checkpoints = list(range(0, options.steps + 1, options.checkpoint_every))
    for j in range(options.faults):
        location, bits = pairs[j % len(pairs)]
        kind = STEP_KINDS[j % len(STEP_KINDS)] if location != "checkpoint-file" else "on_checkpoint"
        step = _draw_step(rng, options, kind, checkpoints, location)
        bit = rng.choice(BIT_CLASSES[bits])
        if options.mixed_precision and location in SIXTEEN_BIT:  # the same class of bfloat16's bits
            bit = bit - 16 if bit >= 16 else bit % 4
        # pp-activation: the activation a stage-0 rank sends (ranks 0 and 1; 0 to 3 in the 3-D job)
        world = 2 * WORLD_SIZE if options.parallel == "3d" else WORLD_SIZE
        rank = rng.randrange(world // 2 if location == "pp-activation" else world)
        spec = f"{location}:step={step}:rank={rank}:bit={bit}"
        plans.append(
            Plan(
                index=len(plans),
                variant=plans[j % options.clean].variant,
                fault=spec,
                location=location,
                bit_class=bits,
                step_kind=kind,
            )
        )
    return plans


def _draw_step(rng: random.Random, options: Options, kind: str, checkpoints: list[int], location: str) -> int:
    """A step of ``kind`` with a later step to see the effect on (a checkpoint after 0 for files)."""
    if location == "checkpoint-file":
        return rng.choice(checkpoints[1:])
    while True:
        base = rng.choice(checkpoints)
        step = (
            base
            + {"on_checkpoint": 0, "after_checkpoint": 1, "mid_interval": rng.randrange(2, options.checkpoint_every)}[
                kind
            ]
        )
        if step <= options.steps - 2:
            return step


# ---------------------------------------------------------------------------------- one run (child)
def _cli(runner, cli, args: list[str]) -> dict:
    started = time.monotonic()
    result = runner.invoke(cli, args, catch_exceptions=True)
    crashed = result.exception is not None and not isinstance(result.exception, SystemExit)
    return _kept(result.stdout, result.stderr, result.exit_code, started, result.exception if crashed else None)


def _kept(stdout: str, stderr: str, exit_code: int | None, started: float, exception: BaseException | None) -> dict:
    """What the campaign keeps of one command: its exit code, its JSON document, an error line, seconds."""
    doc, error = None, None
    try:
        doc = json.loads(stdout) if stdout.strip() else None
    except json.JSONDecodeError:
        error = "stdout is not JSON"
    if exception is not None:
        error = f"{type(exception).__name__}: {exception}"[:300]
    elif doc is None:
        error = error or (stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {"exit_code": exit_code, "doc": doc, "error": error, "seconds": round(time.monotonic() - started, 2)}


def _bisect_answer(result: dict) -> dict:
    """What the campaign keeps of a ``bisect --json`` run (with or without ``--trace-only``)."""
    doc = result.pop("doc") or {}
    return result | {
        "verdict": doc.get("verdict"),
        "first_divergent_step": doc.get("first_divergent_step"),
        "suspects": [{"rank": s.get("rank"), "location": s.get("location")} for s in doc.get("suspects") or []],
        "comparison": (doc.get("replayed") or {}).get("comparison"),
        "weak_candidate": weak_candidate(doc),
        "statuses": checkpoint_statuses(doc),
    }


def _train(plan: Plan, options: Options) -> dict:
    """Train one run: the row's training part (trace, checkpoints, what fired online)."""
    out = options.out_dir / plan.name
    started = time.monotonic()
    if options.parallel in ("tp", "pp", "3d"):
        if options.parallel == "tp":
            from sdc_forensics.demo import tp as demo

            degree, extra = {"tp_degree": demo.TP}, {}
        else:
            from sdc_forensics.demo import pp as demo

            tp = 2 if options.parallel == "3d" else 1
            degree, extra = {"pp_degree": demo.PP} | ({"tp_degree": tp} if tp > 1 else {}), {"tp": tp}
        found = demo.run_demo(
            out,
            (plan.fault,) if plan.fault else (),
            steps=options.steps,
            checkpoint_every=options.checkpoint_every,
            seed=plan.variant,
            **extra,
        )
        ranks = [json.loads(path.read_text()) for path in sorted((out / "demo").glob("rank-*.json"))]
        return degree | {
            "recipe": f"{demo.SEEDED_REFERENCE} seed={plan.variant}",
            "trace": str(out / "trace"),
            "train_s": round(time.monotonic() - started, 2),
            # the tp-collective / pp-activation drill's flips (the recorder's own drills are not reported by the demo)
            "fired": [f for doc in ranks for f in doc.get("fired", [])],
            "online_alarms": sorted({a["check"] for a in found["alarms"]}),
            "checkpoints": {
                str(n): str(out / "checkpoints" / f"step-{n:08d}")
                for n in range(0, options.steps, options.checkpoint_every)
            },
        }
    if options.parallel != "ddp":
        from sdc_forensics.demo import sharded

        found = sharded.run_demo(
            out,
            options.parallel,
            (plan.fault,) if plan.fault else (),
            steps=options.steps,
            checkpoint_every=options.checkpoint_every,
            seed=plan.variant,
            **SHARDED_JOBS[options.job],
            **({"param_dtype": "bfloat16", "reduce_dtype": "float32"} if options.mixed_precision else {}),
        )
        steps = range(0, options.steps, options.checkpoint_every)
        return {
            "recipe": f"{sharded.SEEDED_REFERENCE} seed={plan.variant}",
            "trace": str(out / "trace"),
            "train_s": round(time.monotonic() - started, 2),
            "fired": [],
            "online_alarms": sorted({a["check"] for a in found["alarms"]}),
            "checkpoints": {str(n): str(out / "checkpoints" / f"step-{n:08d}") for n in steps},
        }
    from sdc_forensics.demo.convnet import variant_reference
    from sdc_forensics.demo.run import DemoConfig, run_config
    from sdc_forensics.inject import parse_specs

    config = DemoConfig(
        out_dir=out,
        injections=parse_specs([plan.fault]) if plan.fault else (),
        steps=options.steps,
        checkpoint_every=options.checkpoint_every,
        world_size=WORLD_SIZE,
        audit_every=0,
        policy="continue",
        recipe=variant_reference(plan.variant),
        threads=(1,) * WORLD_SIZE,
        comm_hook=options.comm_hook,
        reduction=options.reduction,
    )
    result = run_config(config)
    return {
        "recipe": config.recipe,
        "trace": str(config.trace_dir),
        "train_s": round(result.wall_s, 2),
        "fired": [dict(f) for f in result.fired],
        "online_alarms": sorted({a["check"] for a in result.alarms}),
        "checkpoints": {str(n): str(config.checkpoint_path(n)) for n in result.checkpoints},
    }


#: --parallel tp: the replays run as a user runs them, one torchrun of TP_PROCESSES processes per command
#: (docs/recorder.md: the exact TP replay needs as many processes as the job's TP degree)
TP_PROCESSES = 2
TP_TIMEOUT_S = 900


def _torchrun_cli(args: list[str], processes: int = TP_PROCESSES) -> dict:
    """``torchrun --nproc-per-node PROCESSES -m sdc_forensics ARGS``, kept as :func:`_cli` keeps a command. torchrun
    exits 1 whenever a worker does not exit 0; the exit code kept is process 0's (the one that writes the
    output), read from torchrun's failure summary."""
    import os
    import re
    import subprocess

    from sdc_forensics.demo.ports import free_port

    started = time.monotonic()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--rdzv-endpoint=localhost:{free_port()}",
    ]
    command += [f"--nproc-per-node={processes}", "-m", "sdc_forensics", *args]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=env | {"OMP_NUM_THREADS": "1"}, timeout=TP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return {
            "exit_code": None,
            "doc": None,
            "error": f"torchrun timed out after {TP_TIMEOUT_S} s",
            "seconds": TP_TIMEOUT_S,
        }
    exit_code = proc.returncode
    if exit_code:
        # torchelastic's summary: one block per failed worker, "rank : R (local_rank: R)" then "exitcode : N (pid: P)"
        codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", proc.stderr))
        exit_code = int(codes.get("0", next(iter(codes.values()), exit_code)))
    return _kept(proc.stdout, proc.stderr, exit_code, started, None)


def run_one(plan: Plan, options: Options) -> dict:
    """Train one run, then judge it with the three commands (a TP job's under torchrun: ``TP_PROCESSES``; a PP
    job's on one process, as the DDP and FSDP jobs')."""
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    started = time.monotonic()
    row = dataclasses.asdict(plan) | _train(plan, options)
    result = argparse.Namespace(wall_s=row["train_s"])
    runner, trace = CliRunner(), row["trace"]
    # the online checks' answer first: it reads the trace alone (no files, no ledger), so the order does not matter
    row["trace_only"] = _bisect_answer(_cli(runner, cli, ["bisect", trace, "--json", "--trace-only"]))
    replay = ["--threads", str(plan.replay_threads)] if plan.replay_threads else []
    in_process = lambda args: _cli(runner, cli, args)  # noqa: E731
    replayed = _torchrun_cli if options.parallel in ("tp", "3d") else in_process
    if options.at_layout:
        # one stage per process: PP x TP of them (replay/pp_exact.py)
        stages = row.get("pp_degree", 2) * row.get("tp_degree", 1)
        replayed = lambda args: _torchrun_cli(args, stages)  # noqa: E731
    row["bisect"] = _bisect_answer(replayed(["bisect", trace, "--json", *replay]))
    certify = replayed(["certify", trace, "--json", *replay])
    row["certify"] = certify | {"statuses": checkpoint_statuses(certify.pop("doc") or {})}
    row["verify"] = {}
    for step, path in row["checkpoints"].items():
        # in this process: what the replays above examined exactly is in the trace's ledger, reused (a TP job's
        # steps that no exact replay certified get the one-process replay, tolerant: never a certificate)
        res = in_process(["verify-checkpoint", path, "--trace", trace, "--json", *replay])
        status = ((res.pop("doc") or {}).get("certification") or {}).get("status")
        row["verify"][step] = res | {"status": normalise_status(status)}
    row["cli_s"] = round(time.monotonic() - started - result.wall_s, 2)
    row["seconds"] = round(time.monotonic() - started, 2)
    return row


# ---------------------------------------------------------------------------------- effect (parent)
def effect(row: dict, twin: dict) -> dict:
    """Whether the fault changed the training state beyond tolerance (see the module docstring)."""
    from sdc_forensics.inject import ALL_LOCATIONS, PP_LOCATIONS, TP_LOCATIONS, parse_spec

    if row["location"] != "checkpoint-file":
        fault = row["fault"]
        if row["location"] in TP_LOCATIONS + PP_LOCATIONS:
            # measure_effect reads the spec's step and rank only, and parses the recorders' locations: the faulted
            # rank's recorded local and reduced sketches are what a flip inside its forward moves
            spec = parse_spec(fault, TP_LOCATIONS + PP_LOCATIONS)
            if row["location"] in PP_LOCATIONS:  # stage 0's sent activation moves the receiving rank's gradient
                spec = dataclasses.replace(spec, rank=spec.rank + PP_DP * row.get("tp_degree", 1))
            fault = str(dataclasses.replace(spec, location="local-gradient"))
        measured = measure_effect(Path(row["trace"]), Path(twin["trace"]), fault)
        return measured | {"changed_nothing": _same_run(Path(row["trace"]), Path(twin["trace"]))}
    step = str(parse_spec(row["fault"], ALL_LOCATIONS).step)
    mine = np.fromfile(row["checkpoints"][step], dtype=np.uint8)
    theirs = np.fromfile(twin["checkpoints"][step], dtype=np.uint8)
    common = min(mine.size, theirs.size)
    differing = int((mine[:common] != theirs[:common]).sum()) + abs(mine.size - theirs.size)
    return {
        "effect": differing,
        "effective": differing > 0,
        "where": f"checkpoint {step}: {differing} byte(s) differ",
        "identical_before_fault": True,
        "final_loss_change": 0.0,
        "changed_nothing": differing == 0,
    }


def _same_run(faulted_trace: Path, twin_trace: Path) -> bool:
    """Whether the faulted run recorded the twin's every gradient and weights digest, every rank and step: the
    flip changed nothing the model holds (a bit of an embedding row no token of the step looked up, say), so a
    checkpoint after it that is called clean is clean, not a false-clean certificate. The logged loss is left
    out: a token id flipped on one TP rank where both ids lie outside its vocabulary shard changes that rank's
    loss and no gradient (docs/decisions.md, "Input faults in model-parallel jobs")."""
    from sdc_forensics.trace.reader import Trace

    faulted, twin = Trace.open(faulted_trace), Trace.open(twin_trace)
    (first, last), span = twin.step_range(), faulted.step_range()
    if span != (first, last):
        return False
    mine, theirs = (next(t.step_windows(last - first + 1, first, last)).records for t in (faulted, twin))
    return mine.shape == theirs.shape and all(
        np.array_equal(mine[key], theirs[key]) for key in ("local_digest", "reduced_digest", "weights_digest")
    )


# ---------------------------------------------------------------------------------- judging
def _all_statuses(row: dict) -> dict[str, dict[str, str | None]]:
    return {
        "bisect": row["bisect"]["statuses"],
        "certify": row["certify"]["statuses"],
        "verify": {n: v["status"] for n, v in row["verify"].items()},
    }


def judge(row: dict) -> dict:
    """The outcome of one run (see the module docstring for each rule); the trace-only answer
    (``row["trace_only"]``) is judged by the same rules, its own statuses standing for every command's.
    A row from before trace-only answers were kept has its ``trace_only_*`` outcomes None: not measured."""
    from sdc_forensics.inject import ALL_LOCATIONS, PP_LOCATIONS, TP_LOCATIONS, parse_spec

    statuses = _all_statuses(row)
    steps = sorted({int(n) for by in statuses.values() for n in by})
    disagreeing = [n for n in steps if len({by.get(str(n)) for by in statuses.values()}) > 1]
    errors = [f"{c}: {r['error']}" for c, r in (("bisect", row["bisect"]), ("certify", row["certify"])) if r["error"]]
    errors += [
        f"verify {n}: {v['error']}" for n, v in row["verify"].items() if v["error"] and v["exit_code"] not in (0, 1, 4)
    ]
    trace_only = row.get("trace_only")
    if trace_only is not None and trace_only["error"]:
        errors.append(f"bisect --trace-only: {trace_only['error']}")
    verdict = row["bisect"]["verdict"]
    outcome = {
        "verdict": verdict,
        "inconclusive": verdict == "inconclusive",
        "disagreements": disagreeing,
        "errors": errors,
        "trace_only_verdict": None if trace_only is None else trace_only["verdict"],
    }
    if row["fault"] is None:
        bad = [f"{c} {n}: {s}" for c, by in statuses.items() for n, s in by.items() if s in ("corrupt", "tainted")]
        bad += [f"verify {n}: exit 1" for n, v in row["verify"].items() if v["exit_code"] == 1]
        return outcome | {
            "false_alarm": verdict == "corruption" or bool(bad),
            "bad_statuses": bad,
            "trace_only_false_alarm": None if trace_only is None else _alarmed(trace_only),
        }
    spec = parse_spec(row["fault"], ALL_LOCATIONS + TP_LOCATIONS + PP_LOCATIONS)
    if row["location"] == "checkpoint-file":
        held = [f"{c} {n}" for c, by in statuses.items() for n, s in by.items() if int(n) == spec.step and s == "clean"]
    else:
        held = [f"{c} {n}" for c, by in statuses.items() for n, s in by.items() if int(n) > spec.step and s == "clean"]
    candidate = row["bisect"]["weak_candidate"]
    locations = {s["location"] for s in row["bisect"]["suspects"]}
    expected = _expected_ranks(row["location"], spec, row.get("tp_degree", 1), row.get("pp_degree", 1))
    return outcome | {
        "detected": verdict == "corruption",
        "missed": verdict == "clean",
        "exact_step_rank": _exact(row["bisect"], row["location"], spec, expected, _required(row, spec)),
        "location_correct": verdict == "corruption" and locations == {EXPECTED_LOCATION[row["location"]]},
        "false_clean": held,
        "weak_candidate_matches": None
        if verdict != "inconclusive" or candidate is None
        else candidate["step"] == spec.step and candidate["ranks"] == [spec.rank],
        "trace_only_detected": None if trace_only is None else trace_only["verdict"] == "corruption",
        "trace_only_exact": None
        if trace_only is None
        else _exact(trace_only, row["location"], spec, expected, _required(row, spec)),
        "trace_only_wrong_ranks": None if trace_only is None else _wrong_ranks(trace_only, expected),
    }


def _ranks(answer: dict) -> list[int]:
    return sorted({s["rank"] for s in answer["suspects"] if s["rank"] is not None})


def _expected_ranks(location: str, spec, tp_degree: int = 1, pp_degree: int = 1) -> list[int]:
    """The ranks a right answer names: none for ``allreduce-all`` (the collective), the writer for a file, and
    in a TP job (``tp_degree`` > 1) for a fault in one rank's forward (:data:`TP_FORWARD`) every rank of its DP
    coordinate: TP's collectives hand the rank's wrong activations to its TP peers (the row-parallel layers'
    reduce-scatter, the head's all-gather), so all of them compute their loss and local gradients from them
    (tests/replay/test_tp_collective_fault.py)."""
    if pp_degree > 1 and (location in PP_FORWARD or (tp_degree > 1 and location in TP_FORWARD)):
        # a PP job's forward fault: the ranks of its pipeline (same dp coordinate; with TP, every TP rank of it),
        # any of which may be named
        dp = spec.rank // tp_degree % PP_DP
        return [(stage * PP_DP + dp) * tp_degree + t for stage in range(pp_degree) for t in range(tp_degree)]
    if tp_degree > 1 and location in TP_FORWARD:
        # the (dp, tp) mesh is row-major: rank = dp * tp_degree + tp
        return [spec.rank // tp_degree * tp_degree + t for t in range(tp_degree)]
    return {"allreduce-all": [], "checkpoint-file": [WRITER_RANK]}.get(location, [spec.rank])


def _required(row: dict, spec) -> int | None:
    """A PP job's forward fault (:data:`PP_FORWARD`): the rank a right answer must name among its pipeline's
    (``_expected_ranks``): the corrupted rank for all-gather-output, the receiving rank r+2 for pp-activation
    (tests/replay/test_pp_replay.py); None: the answer must name exactly the expected ranks."""
    tp_degree = row.get("tp_degree", 1)
    forward = PP_FORWARD + (TP_FORWARD if tp_degree > 1 else ())
    if row.get("pp_degree", 1) <= 1 or row["location"] not in forward:
        return None
    return spec.rank + PP_DP * tp_degree if row["location"] == "pp-activation" else spec.rank


def _exact(answer: dict, location: str, spec, expected: list[int], required: int | None = None) -> bool:
    """The exact step-and-rank rule (module docstring) on one bisect answer: the replay's or the trace-only one.
    With ``required`` (a PP forward fault) the answer's ranks lie within ``expected`` and include ``required``."""
    if answer["verdict"] != "corruption":
        return False
    ranks = _ranks(answer)
    if required is None and ranks != expected:
        return False
    if required is not None and (required not in ranks or not set(ranks) <= set(expected)):
        return False
    if location == "checkpoint-file":  # no divergent step: the flipped checkpoint is the one corrupt file
        return {int(n) for n, s in answer["statuses"].items() if s == "corrupt"} == {spec.step}
    return answer["first_divergent_step"] == spec.step


def _wrong_ranks(answer: dict, expected: list[int]) -> list[int]:
    """The ranks a ``corruption`` answer names that the fault did not touch (empty: none, or no corruption)."""
    if answer["verdict"] != "corruption":
        return []
    return sorted(set(_ranks(answer)) - set(expected))


def _alarmed(answer: dict) -> bool:
    """A clean run's false alarm by one bisect answer: ``corruption``, or a checkpoint ``corrupt``/``tainted``."""
    return answer["verdict"] == "corruption" or any(s in ("corrupt", "tainted") for s in answer["statuses"].values())


_REPLAY_KEYS = ("detected", "exact_step_rank", "location_correct", "inconclusive", "missed", "false_clean")
_TRACE_ONLY_KEYS = ("trace_only_detected", "trace_only_exact")


def _cell(rows: list[dict], keys: tuple[str, ...]) -> dict[str, int]:
    """Faults, effective faults, and each of ``keys`` counted over the effective ones."""
    cell = Counter({"faults": len(rows), "effective": 0} | {key: 0 for key in keys})
    for r in rows:
        if r["effect"]["effective"]:
            cell["effective"] += 1
            for key in keys:
                cell[key] += bool(r["outcome"].get(key))
    return dict(cell)


def _grouped(rows: list[dict], name, keys: tuple[str, ...]) -> dict[str, dict[str, int]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(name(r), []).append(r)
    return {k: _cell(v, keys) for k, v in sorted(groups.items())}


def trace_only_rates(faulted: list[dict], clean: list[dict]) -> dict:
    """What the online checks alone caught (``bisect --trace-only``), next to the replay: the
    summary ``--rates`` writes (docs/benchmarks.md, "What the online checks alone catch").
    A rate is over the effective faults of its group (None where a group has none)."""

    def rates(rows: list[dict]) -> dict:
        cell = _cell(rows, ("detected", "exact_step_rank") + _TRACE_ONLY_KEYS)
        n = cell["effective"]
        return {
            "faults": cell["faults"],
            "effective": n,
            "replay_detected": cell["detected"],
            "replay_exact": cell["exact_step_rank"],
            "trace_only_detected": cell["trace_only_detected"],
            "trace_only_exact": cell["trace_only_exact"],
            "trace_only_detection_rate": round(cell["trace_only_detected"] / n, 4) if n else None,
            "trace_only_exact_rate": round(cell["trace_only_exact"] / n, 4) if n else None,
        }

    by = lambda key: {k: rates([r for r in faulted if r[key] == k]) for k in sorted({r[key] for r in faulted})}  # noqa: E731
    return {
        "schema_version": 1,
        "overall": rates(faulted),
        # the coverage question is about the steps before a checkpoint: faults in training, not in a file at rest
        "training_faults": rates([r for r in faulted if r["location"] != "checkpoint-file"]),
        "by_location": by("location"),
        "by_bit_class": by("bit_class"),
        "clean_runs": len(clean),
        "trace_only_false_alarms": sum(1 for r in clean if r["outcome"]["trace_only_false_alarm"]),
    }


def tally(rows: list[dict], seconds: float) -> dict:
    """The campaign's totals (the keys the issue asks for, and the per location / bit class tables).
    The ``trace_only_*`` totals are None when some row has no trace-only answer (an older campaign)."""
    clean = [r for r in rows if r["fault"] is None]
    faulted = [r for r in rows if r["fault"] is not None]
    effective = [r for r in faulted if r["effect"]["effective"]]
    ineffective = [r for r in faulted if not r["effect"]["effective"]]
    count = lambda rs, key: sum(1 for r in rs if r["outcome"].get(key))  # noqa: E731
    measured = all(r.get("trace_only") is not None for r in rows)  # False: rows of a campaign.json from before
    keys = _REPLAY_KEYS + (_TRACE_ONLY_KEYS if measured else ())
    table_keys = ("detected", "exact_step_rank") + (_TRACE_ONLY_KEYS if measured else ())
    trace_only = (
        {
            "trace_only_measured": measured,
            "trace_only_detected": count(effective, "trace_only_detected"),
            "trace_only_exact": count(effective, "trace_only_exact"),
            "trace_only_inconclusive": sum(
                1 for r in effective if r["outcome"]["trace_only_verdict"] == "inconclusive"
            ),
            "trace_only_detected_ineffective": count(ineffective, "trace_only_detected"),
            "trace_only_wrong_rank": count(faulted, "trace_only_wrong_ranks"),
            "trace_only_false_alarms": count(clean, "trace_only_false_alarm"),
            "trace_only_rates": trace_only_rates(faulted, clean),
            "trace_only_not_exact": [
                {
                    "fault": r["fault"],
                    "verdict": r["trace_only"]["verdict"],
                    "first_divergent_step": r["trace_only"]["first_divergent_step"],
                    "suspects": r["trace_only"]["suspects"],
                }
                for r in effective
                if r["outcome"]["trace_only_detected"] and not r["outcome"]["trace_only_exact"]
            ],
        }
        if measured
        else {"trace_only_measured": False}
        | dict.fromkeys(
            (
                "trace_only_detected",
                "trace_only_exact",
                "trace_only_inconclusive",
                "trace_only_detected_ineffective",
                "trace_only_wrong_rank",
                "trace_only_false_alarms",
                "trace_only_rates",
                "trace_only_not_exact",
            )
        )
    )
    return {
        "faults": len(faulted),
        "effective": len(effective),
        "ineffective": len(ineffective),
        "detected": count(effective, "detected"),
        "missed": count(effective, "missed"),
        "exact_step_rank": count(effective, "exact_step_rank"),
        "location_correct": count(effective, "location_correct"),
        "false_clean_certificates": count(effective, "false_clean"),
        # a checkpoint after a flip that changed nothing (the run bitwise its twin's) is clean: no false certificate
        "false_clean_ineffective": count(
            [r for r in ineffective if not r["effect"].get("changed_nothing")], "false_clean"
        ),
        "changed_nothing": sum(1 for r in ineffective if r["effect"].get("changed_nothing")),
        "detected_ineffective": count(ineffective, "detected"),
        "clean_runs": len(clean),
        "clean_runs_tolerant": sum(1 for r in clean if r["replay_threads"]),
        "clean_runs_certified": sum(1 for r in clean if set(r["certify"]["statuses"].values()) == {"clean"}),
        "certified_after_0": sum(
            1 for r in rows if any(int(n) > 0 and s == "clean" for n, s in r["certify"]["statuses"].items())
        ),
        "false_alarms": count(clean, "false_alarm"),
        "inconclusive": count(rows, "inconclusive"),
        "inconclusive_clean_bitwise": count([r for r in clean if not r["replay_threads"]], "inconclusive"),
        "inconclusive_effective": count(effective, "inconclusive"),
        "disagreements": count(rows, "disagreements"),
        "errors": count(rows, "errors"),
        "twins_valid": all(r["effect"]["identical_before_fault"] for r in faulted),
        "seconds": round(seconds, 1),
        "train_s_mean": round(float(np.mean([r["train_s"] for r in rows])), 2) if rows else None,
        "cli_s_mean": round(float(np.mean([r["cli_s"] for r in rows])), 2) if rows else None,
        "by_location_bits": _grouped(faulted, lambda r: f"{r['location']} / {r['bit_class']}", keys),
        "by_location": _grouped(faulted, lambda r: r["location"], table_keys),
        "by_bit_class": _grouped(faulted, lambda r: r["bit_class"], table_keys),
        "not_exact": [
            {
                "fault": r["fault"],
                "step_kind": r["step_kind"],
                "verdict": r["outcome"]["verdict"],
                "first_divergent_step": r["bisect"]["first_divergent_step"],
                "suspects": r["bisect"]["suspects"],
                "effect": r["effect"]["effect"],
            }
            for r in effective
            if not r["outcome"]["exact_step_rank"]
        ],
        # how many ranks each effective fault in one rank's forward named: {location: {count: faults}}
        "forward_named": _forward_named(effective),
        "ineffective_faults": [
            {
                "fault": r["fault"],
                "effect": r["effect"]["effect"],
                "changed_nothing": r["effect"].get("changed_nothing"),
                "verdict": r["outcome"]["verdict"],
                "final_loss_change": r["effect"].get("final_loss_change"),
            }
            for r in ineffective
        ],
    } | trace_only


def _forward_named(effective: list[dict]) -> dict:
    """``{location: {ranks named: faults}}`` of the effective faults in a rank's forward (the model-parallel
    campaigns: one rank named is the stage or TP rank itself, more the ranks its forward reached)."""
    out: dict[str, dict[str, int]] = {}
    for r in effective:
        if r["location"] in PP_FORWARD + TP_FORWARD and r["fault"] is not None:
            named = str(len(r["bisect"].get("suspects") or ()))
            counts = out.setdefault(r["location"], {})
            counts[named] = counts.get(named, 0) + 1
    return {location: dict(sorted(counts.items())) for location, counts in sorted(out.items())}


# ---------------------------------------------------------------------------------- main
def finish(rows: list[dict], seconds: float) -> dict:
    """Measure each fault against its twin, judge every row, tally."""
    twins = {r["variant"]: r for r in rows if r["fault"] is None}
    for row in rows:
        row["outcome"] = judge(row)
        if row["fault"] is not None and "effect" not in row:
            row["effect"] = effect(row, twins[row["variant"]])
    return tally(rows, seconds)


def campaign(options: Options, progress=print) -> dict:
    """Plan, run (``jobs`` at a time: clean runs first, they are the twins), judge and tally."""
    started = time.monotonic()
    rows = run_children(
        __file__,
        plan_runs(options),
        options,
        options.jobs,
        lambda row: progress(
            f"{row['index']:3d} {row.get('fault') or 'clean':40s} "
            + (
                row.get("error")
                or f"{row['bisect']['verdict']} (trace-only {row['trace_only']['verdict']}) {row['seconds']} s"
            )
        ),
    )
    summary = finish(rows, time.monotonic() - started)
    return summary | {
        "settings": dataclasses.asdict(options) | {"out_dir": str(options.out_dir)},
        "measured_on": machine(),
        "rows": rows,
    }


def machine() -> dict:
    """Where and when a campaign ran (kept in its --json output and in the --rates file)."""
    import os
    import platform
    import subprocess

    import torch

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
            ).stdout.strip()
            or None
        )
    except OSError:  # no git: a copy of the script outside a checkout
        commit = None
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(pages / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "command": " ".join(["python", "benchmarks/campaign.py", *sys.argv[1:]])
        if Path(sys.argv[0]).name == "campaign.py"
        else None,
    }


def write_rates(result: dict, path: Path) -> None:
    """``--rates PATH``: the trace-only summary with where it was measured, as one small JSON file."""
    if not result["trace_only_measured"]:
        raise SystemExit(
            f"--rates {path}: these runs have no bisect --trace-only answer (a campaign.json from before it was "
            "measured); run the campaign again to measure it"
        )
    doc = result["trace_only_rates"] | {
        "measured_on": result.get("measured_on"),
        "settings": result.get("settings"),
        "source": "benchmarks/campaign.py (docs/benchmarks.md, fault campaign)",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--faults", type=int, default=20, help="runs with one injected fault each")
    parser.add_argument(
        "--clean", type=int, default=3, help="clean runs (the twins; every other one replayed at --threads 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws variants and faults")
    parser.add_argument("--json", action="store_true", help="print the summary and rows as one JSON object on stdout")
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for the runs (default: a temporary one, removed)"
    )
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--checkpoint-every", type=int, default=4, help="checkpoint interval")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (1 or 2)")
    parser.add_argument(
        "--tolerant-threads",
        type=int,
        default=2,
        help="every other clean run's replay threads (0: all replayed as recorded)",
    )
    parser.add_argument("--comm-hook", default=None, help="MODULE:ATTR of the DDP comm hook every run trains with")
    parser.add_argument(
        "--reduction", choices=("native", "ordered"), default="native", help="the recorder's all-reduce mechanism"
    )
    parser.add_argument(
        "--parallel",
        choices=("ddp", "fsdp", "hsdp", "tp", "pp", "3d"),
        default="ddp",
        help="the job: DDP (the conv net), the sharded job of demo/sharded.py (FSDP2 over 4 ranks, HSDP 2 x 2), "
        "or demo/tp.py's TP 2 x FSDP2 DP 2 transformer (replayed under torchrun, 2 processes)",
    )
    parser.add_argument(
        "--job",
        choices=tuple(SHARDED_JOBS),
        default="mlp",
        help="the sharded job's model: the MLP with SGD, or clipped-lm (a tied-head transformer with AdamW and "
        "clip_grad_norm_ engaging on every step, as nanoGPT trains)",
    )
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="sharded jobs compute in bfloat16 and reduce in float32 (MixedPrecisionPolicy, torchtitan's default)",
    )
    parser.add_argument(
        "--locations",
        default="",
        help="comma-separated: draw the faults from these of the job's locations only (default: all of them)",
    )
    parser.add_argument(
        "--at-layout",
        action="store_true",
        help="--parallel pp or 3d: replay one stage per process (torchrun, PP x TP processes) instead of the whole model",
    )
    parser.add_argument(
        "--rejudge", type=Path, default=None, help="re-judge and re-tally the rows of an earlier --json output"
    )
    parser.add_argument(
        "--rates",
        type=Path,
        default=None,
        help="also write the trace-only detection rates to this JSON file (sdc_forensics/measured/trace_only_rates.json)",
    )
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_options", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


_NOT_SCALAR = (
    "rows",
    "settings",
    "measured_on",
    "by_location_bits",
    "by_location",
    "by_bit_class",
    "not_exact",
    "ineffective_faults",
    "trace_only_rates",
    "trace_only_not_exact",
)


def _table(title: str, cells: dict[str, dict], keys: tuple[str, ...], measured: bool = True) -> None:
    """One markdown table; the trace-only columns say "not measured" for an older campaign."""
    shown = keys + (() if measured else _TRACE_ONLY_KEYS)
    print(f"\n| {title} | " + " | ".join(shown) + " |")
    print("| --- |" + " ---: |" * len(shown))
    for name, cell in cells.items():
        print(f"| {name} | " + " | ".join(str(cell.get(k, 0)) if k in keys else "not measured" for k in shown) + " |")


def _print(result: dict) -> None:
    for key, value in result.items():
        if key not in _NOT_SCALAR:
            print(f"{key:32s} {'not measured' if value is None and key.startswith('trace_only') else value}")
    measured = result["trace_only_measured"]
    to = _TRACE_ONLY_KEYS if measured else ()
    _table("location", result["by_location"], ("faults", "effective", "detected", "exact_step_rank") + to, measured)
    _table("bit class", result["by_bit_class"], ("faults", "effective", "detected", "exact_step_rank") + to, measured)
    _table("location / bit class", result["by_location_bits"], ("faults", "effective") + _REPLAY_KEYS + to, measured)
    for miss in result["not_exact"]:
        print(f"not exact: {miss}")
    for miss in result["trace_only_not_exact"] or ():
        print(f"trace-only detected, not exact: {miss}")
    for fault in result["ineffective_faults"]:
        print(f"ineffective: {fault}")


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args._child:
        options = json.loads(args._options)
        options = Options(**options | {"out_dir": Path(options["out_dir"]), "locations": tuple(options["locations"])})
        row = run_one(Plan(**json.loads(args._child)), options)
        # also beside the run's files: a campaign stopped early can still be re-judged from the rows that finished
        (options.out_dir / Plan(**json.loads(args._child)).name / "row.json").write_text(json.dumps(row))
        print(json.dumps(row))
        return
    if args.rejudge is not None:
        earlier = json.loads(args.rejudge.read_text(encoding="utf-8"))
        result = finish(earlier["rows"], earlier.get("seconds", 0.0)) | {
            "settings": earlier.get("settings"),
            "measured_on": earlier.get("measured_on"),
            "rows": earlier["rows"],
        }
    else:
        with tempfile.TemporaryDirectory(prefix="sdc-campaign-") as tmp:
            options = Options(
                faults=args.faults,
                clean=args.clean,
                seed=args.seed,
                out_dir=(args.out or Path(tmp)).resolve(),
                steps=args.steps,
                checkpoint_every=args.checkpoint_every,
                jobs=args.jobs,
                tolerant_threads=args.tolerant_threads,
                comm_hook=args.comm_hook,
                reduction=args.reduction,
                parallel=args.parallel,
                mixed_precision=args.mixed_precision,
                job=args.job,
                locations=tuple(loc for loc in args.locations.split(",") if loc),
                at_layout=args.at_layout,
            )
            options.out_dir.mkdir(parents=True, exist_ok=True)
            result = campaign(options, progress=lambda line: print(line, file=sys.stderr))
    if args.rates is not None:
        write_rates(result, args.rates)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True, default=str))
    else:
        _print(result)


if __name__ == "__main__":
    main()
