"""Tolerant replay campaign: clean and faulted conv net runs, replayed at another thread count.

Each run trains the conv net recipe (``sdc_forensics.demo.convnet``, a seeded variant per run)
with 4-process ``gloo`` DDP on CPU at ``--train-threads`` intra-op threads, clean or with one
bit flip drawn with ``--seed`` (location ``grad``/``allreduce`` (one rank)/``allreduce-all``
(inside the collective, every rank)/``weights``/``update``/``input`` and the step on a
checkpoint, right after one, mid-interval or just before the next, cycling through the pairs;
a bit from 16 to 31; rank 0..3). Then the CLI judges it, as subprocesses, replaying at ``--replay-threads``
so that the replay is *not* bitwise the training::

    sdc-forensics bisect TRACE --json --threads R
    sdc-forensics certify TRACE --json --threads R
    sdc-forensics verify-checkpoint CKPT --trace TRACE --json --threads R   (every checkpoint)

A fault is *effective* when it moved training beyond the sketch tolerance: the faulted rank's
recorded local and reduced sketches at the fault step and the next, against a clean twin run of
the same variant (the clean run of that variant, else a twin trained for the purpose), in units
of ``relative_tolerance(dtype, W) * norm``. Ineffective faults are reported apart.

Tallies (``--json`` prints them with one row per run): false alarms (a clean run called
``corruption``, or any of its checkpoints ``corrupt``/``tainted``), false-clean certificates (an
effective fault at step ``s`` and some command calling a checkpoint ``N > s`` clean), exact
step+rank (``corruption`` at ``s`` with suspects exactly the fault's rank), inconclusive
verdicts (and whether the earliest weak evidence names the fault), healthy ranks named (a
suspect rank that is not the faulted one, or any rank for a fault inside the collective or a
clean run: issue 19, which this campaign did not count before), wrong-step verdicts
(``corruption`` at another step than the fault's), disagreements between the three commands'
checkpoint statuses, seconds.

    python benchmarks/tolerant_campaign.py --clean 10 --faulted 30 --seed 1 [--json] [--out DIR]
        [--steps 40] [--checkpoint-every 10] [--train-threads 1] [--replay-threads 2]
        [--tolerant] [--jobs 1]
    python benchmarks/tolerant_campaign.py --quick --seed 1 --json

``--replay-threads 0`` omits ``--threads`` (replay at the recorded count: the bitwise control).
Runs go ``--jobs`` at a time (at most 2; each run is a subprocess of this script).

Over 400 lines on purpose: one campaign (plan, runs, judge, tally) whose parts share the row
format; split, the scoring rules would be read apart from the rows they score.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LOCATIONS = ("grad", "allreduce", "allreduce-all", "weights", "update", "input")
#: Bits drawn (float32): 31 sign, 23..30 exponent, 16..22 the high mantissa (a lower bit moves an
#: element by less than 2**-7 of itself: below the sketch tolerance of any realistic gradient).
BITS = tuple(range(16, 32))
#: Faults that hit every rank alike: the answer names the collective, no rank.
EVERY_RANK = ("allreduce-all",)
STEP_KINDS = ("on_checkpoint", "after_checkpoint", "mid_interval", "before_checkpoint")
WORLD_SIZE = 4
CLEAN = "clean"
_CLEAN_ALIASES = {
    "clean",
    "clean-replay-verified",
    "clean-trace-consistent",
    "clean_replay_verified",
    "clean_trace_consistent",
}
QUICK = {"clean": 2, "faulted": 2, "steps": 12, "checkpoint_every": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CampaignOptions:
    """What the campaign runs (the command line, validated)."""

    clean: int
    faulted: int
    seed: int
    out_dir: Path
    steps: int = 40
    checkpoint_every: int = 10
    train_threads: int = 1
    replay_threads: int = 2
    tolerant: bool = False
    jobs: int = 1
    verify: str = "all"
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.clean < 0 or self.faulted < 0 or self.clean + self.faulted == 0:
            raise SystemExit("--clean and --faulted must be >= 0 and not both 0")
        if self.checkpoint_every < 4 or self.steps < 2 * self.checkpoint_every:
            raise SystemExit(
                "need --checkpoint-every >= 4 and --steps >= 2 intervals (faults go mid-interval and before checkpoints)"
            )
        if not 1 <= self.jobs <= 2:
            raise SystemExit("--jobs must be 1 or 2 (runs share 2 cores)")
        if self.verify not in ("all", "around"):
            raise SystemExit("--verify must be 'all' or 'around'")
        if self.train_threads < 1 or self.replay_threads < 0:
            raise SystemExit("--train-threads must be >= 1 and --replay-threads >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
    """One run: its variant, its fault (None: clean) and whether the CLI judges it (twins are not)."""

    index: int
    kind: str  # clean | faulted | twin
    variant: int
    fault: str | None = None
    step_kind: str = ""

    @property
    def name(self) -> str:
        return f"{self.index:03d}-{self.kind}"


# ---------------------------------------------------------------------------------- planning
def draw_fault(rng: random.Random, steps: int, every: int, location: str, kind: str) -> str:
    """A fault spec ``LOCATION:step=S:rank=R:bit=B`` at a step of ``kind``, ``S <= steps - 2``."""
    intervals = math.ceil(steps / every)
    while True:
        base = rng.randrange(intervals) * every
        offset = {
            "on_checkpoint": 0,
            "after_checkpoint": 1,
            "mid_interval": rng.randrange(2, every - 1),
            "before_checkpoint": every - 1,
        }[kind]
        step = base + offset
        if step <= steps - 2:  # a later step exists to measure the effect on (and replay to see it)
            break
    rank = rng.randrange(
        WORLD_SIZE
    )  # drawn for every location, so that the draws after it do not depend on the location
    return f"{location}:step={step}:{'' if location in EVERY_RANK else f'rank={rank}:'}bit={rng.choice(BITS)}"


def plan_runs(options: CampaignOptions) -> list[RunPlan]:
    """Clean runs (one variant each), faulted runs on the clean runs' variants, and twins where none.

    Faults cycle through the (location, step kind) pairs in a seeded order, so that even a small
    campaign covers different ones; rank and bit are drawn.
    """
    rng = random.Random(options.seed)
    plans = [RunPlan(index=i, kind="clean", variant=rng.randrange(1, 100_000)) for i in range(options.clean)]
    pool = [p.variant for p in plans] or [rng.randrange(1, 100_000)]
    pairs = [(location, kind) for location in LOCATIONS for kind in STEP_KINDS]
    rng.shuffle(pairs)
    for j in range(options.faulted):
        location, kind = pairs[j % len(pairs)]
        fault = draw_fault(rng, options.steps, options.checkpoint_every, location, kind)
        plans.append(
            RunPlan(index=len(plans), kind="faulted", variant=pool[j % len(pool)], fault=fault, step_kind=kind)
        )
    if not options.clean and options.faulted:
        plans.append(RunPlan(index=len(plans), kind="twin", variant=pool[0]))
    return plans


# ---------------------------------------------------------------------------------- one run (child)
def _cli(args: list[str], timeout_s: float) -> dict:
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sdc_forensics.cli.main", *args], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {
            "exit_code": None,
            "doc": None,
            "error": f"timed out after {timeout_s:.0f} s",
            "seconds": round(time.monotonic() - started, 2),
        }
    doc, error = None, None
    try:
        doc = json.loads(proc.stdout) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        error = "stdout is not JSON"
    if doc is None:
        error = error or (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {"exit_code": proc.returncode, "doc": doc, "error": error, "seconds": round(time.monotonic() - started, 2)}


def normalise_status(status: str | None) -> str | None:
    """``clean`` for every spelling of a clean checkpoint; other statuses as they are."""
    if status is None:
        return None
    return CLEAN if status in _CLEAN_ALIASES else status


def checkpoint_statuses(doc: dict) -> dict[str, str | None]:
    """``{"N": status}`` of a bisect or certify JSON document, clean spellings normalised."""
    return {str(c["step"]): normalise_status(c.get("status")) for c in doc.get("checkpoints") or []}


def weak_candidate(doc: dict) -> dict | None:
    """The earliest weak evidence of a bisect document: ``{"step", "ranks"}`` (ranks at that step), or None."""
    records = list(doc.get("evidence") or []) + list(doc.get("hints") or [])
    for suspect in doc.get("suspects") or []:
        records += suspect.get("evidence") or []
    # a statistical hint (kind "outlier") is weak too, but never a candidate: it never carries a verdict
    weak = [
        e
        for e in records
        if isinstance(e, dict)
        and e.get("strength") == "weak"
        and e.get("kind") != "outlier"
        and e.get("step") is not None
    ]
    if not weak:
        return None
    step = min(int(e["step"]) for e in weak)
    ranks = sorted({int(r) for e in weak if int(e["step"]) == step for r in e.get("ranks") or []})
    return {"step": step, "ranks": ranks}


def _summarise_bisect(result: dict) -> dict:
    doc = result.pop("doc") or {}
    replayed = doc.get("replayed") or {}
    return result | {
        "verdict": doc.get("verdict"),
        "first_divergent_step": doc.get("first_divergent_step"),
        "suspect_ranks": sorted({s["rank"] for s in doc.get("suspects") or [] if s.get("rank") is not None}),
        "suspect_recommendations": sorted({s.get("recommendation", "") for s in doc.get("suspects") or []}),
        "suspect_locations": sorted({s.get("location", "") for s in doc.get("suspects") or []}),
        "comparison": replayed.get("comparison"),
        "steps_replayed": replayed.get("steps_replayed"),
        "max_residual_ratio": max(
            (w.get("max_residual_ratio") or 0.0 for w in replayed.get("windows") or []), default=0.0
        ),
        "weak_candidate": weak_candidate(doc),
        "statuses": checkpoint_statuses(doc),
    }


def _summarise_certify(result: dict) -> dict:
    doc = result.pop("doc") or {}
    return result | {"first_divergent_step": doc.get("first_divergent_step"), "statuses": checkpoint_statuses(doc)}


def _verify_status(result: dict) -> str | None:
    doc = result.get("doc") or {}
    certification = doc.get("certification") or {}
    if certification.get("status"):
        return normalise_status(certification["status"])
    if result["exit_code"] == 0:
        return CLEAN
    return "not-certifiable" if result["exit_code"] == 1 else None


def run_one(plan: RunPlan, options: CampaignOptions) -> dict:
    """Train one run and, unless it is a twin, judge it with the three commands."""
    from sdc_forensics.demo.convnet import variant_reference
    from sdc_forensics.demo.run import DemoConfig, run_config
    from sdc_forensics.inject import parse_specs

    out = options.out_dir / plan.name
    config = DemoConfig(
        out_dir=out,
        injections=parse_specs([plan.fault]) if plan.fault else (),
        steps=options.steps,
        checkpoint_every=options.checkpoint_every,
        world_size=WORLD_SIZE,
        audit_every=0,
        policy="continue",
        recipe=variant_reference(plan.variant),
        threads=(options.train_threads,) * WORLD_SIZE,
    )
    started = time.monotonic()
    result = run_config(config)
    row = dataclasses.asdict(plan) | {
        "recipe": config.recipe,
        "trace": str(config.trace_dir),
        "train_s": round(result.wall_s, 2),
        "fired": bool(result.fired),
        "online_alarms": sorted({a["check"] for a in result.alarms}),
        "checkpoints": list(result.checkpoints),
    }
    if plan.kind == "twin":
        return row | {"seconds": round(time.monotonic() - started, 2)}
    replay = ["--threads", str(options.replay_threads)] if options.replay_threads else []
    replay += ["--tolerant"] if options.tolerant else []
    trace = str(config.trace_dir)
    row["bisect"] = _summarise_bisect(_cli(["bisect", trace, "--json", *replay], options.timeout_s))
    row["certify"] = _summarise_certify(_cli(["certify", trace, "--json", *replay], options.timeout_s))
    row["verify"] = {}
    for step in _checkpoints_to_verify(plan, list(result.checkpoints), options.verify):
        res = _cli(
            ["verify-checkpoint", str(config.checkpoint_path(step)), "--trace", trace, "--json", *replay],
            options.timeout_s,
        )
        row["verify"][str(step)] = {
            "exit_code": res["exit_code"],
            "status": _verify_status(res),
            "error": res["error"],
            "seconds": res["seconds"],
        }
    row["cli_s"] = round(time.monotonic() - started - result.wall_s, 2)
    row["seconds"] = round(time.monotonic() - started, 2)
    return row


def _checkpoints_to_verify(plan: RunPlan, checkpoints: list[int], mode: str) -> list[int]:
    """Every checkpoint, or (``around``) the ones that decide the run: the first and the last, and
    for a faulted run the last one at or before the fault step and the first one after it (each
    ``verify-checkpoint --trace`` runs the whole analysis again, so ``all`` costs one analysis per
    checkpoint)."""
    if mode == "all" or not checkpoints:
        return checkpoints
    chosen = {checkpoints[0], checkpoints[-1]}
    if plan.fault is not None:
        from sdc_forensics.inject import parse_spec

        step = parse_spec(plan.fault).step
        chosen |= {
            max((n for n in checkpoints if n <= step), default=checkpoints[0]),
            min((n for n in checkpoints if n > step), default=checkpoints[-1]),
        }
    return sorted(chosen)


# ---------------------------------------------------------------------------------- effect (parent)
def measure_effect(faulted_trace: Path, twin_trace: Path, fault: str) -> dict:
    """How far the fault moved the faulted rank's recorded sketches from the clean twin's.

    ``effect`` is the largest ``max_m |sketch_m - twin_m| / (relative_tolerance(dtype, W) * ||twin||)``
    over the local and reduced sketches of the fault's rank at the fault step and the next;
    above 1 the fault is beyond the sketch tolerance (effective). Also: whether the two runs were
    bitwise identical before the fault (the twin is a valid reference), and the final loss of both.
    """
    from sdc_forensics.fingerprint.tolerance import relative_tolerance
    from sdc_forensics.inject import ALL_LOCATIONS, parse_spec
    from sdc_forensics.trace.reader import Trace

    spec = parse_spec(fault, ALL_LOCATIONS)
    faulted, twin = Trace.open(faulted_trace), Trace.open(twin_trace)
    rel = relative_tolerance(twin.manifest.fingerprint.grad_dtype, twin.world_size)
    last = twin.step_range()[1]
    hi = min(spec.step + 1, last)
    fw, tw = (
        next(faulted.step_windows(hi - spec.step + 1, spec.step, hi)),
        next(twin.step_windows(hi - spec.step + 1, spec.step, hi)),
    )
    effect, where = 0.0, None
    for row, step in enumerate(tw.steps.tolist()):
        for sketch, norm in (("local_sketch", "local_norm"), ("reduced_sketch", "reduced_norm")):
            a = fw.records[row, spec.rank][sketch].astype(np.float64)
            b = tw.records[row, spec.rank][sketch].astype(np.float64)
            residual = float(np.abs(a - b).max())
            ratio = (
                residual / (rel * max(float(tw.records[row, spec.rank][norm]), 1e-30))
                if np.isfinite(residual)
                else math.inf
            )
            if ratio > effect or where is None:
                effect, where = max(ratio, effect), f"step {step} {sketch.split('_')[0]}"
    identical_before = True
    if spec.step > 0:
        fb, tb = (
            next(faulted.step_windows(spec.step, 0, spec.step - 1)),
            next(twin.step_windows(spec.step, 0, spec.step - 1)),
        )
        identical_before = bool(
            (fb.records["local_digest"] == tb.records["local_digest"]).all()
            and (fb.records["weights_digest"] == tb.records["weights_digest"]).all()
        )
    f_last, t_last = next(faulted.step_windows(1, last, last)), next(twin.step_windows(1, last, last))
    loss_f, loss_t = float(f_last.records["loss"].mean()), float(t_last.records["loss"].mean())
    return {
        "effect": effect if math.isfinite(effect) else "inf",
        "effective": effect > 1.0,
        "where": where,
        "identical_before_fault": identical_before,
        "final_loss": loss_f if math.isfinite(loss_f) else str(loss_f),
        "twin_final_loss": loss_t,
        "final_loss_change": (loss_f - loss_t) / loss_t if math.isfinite(loss_f) and loss_t else None,
    }


# ---------------------------------------------------------------------------------- tally
def judge(row: dict) -> dict:
    """The outcome of one judged run (see the module docstring for each tally's rule)."""
    statuses = {
        "bisect": row["bisect"]["statuses"],
        "certify": row["certify"]["statuses"],
        "verify": {n: v["status"] for n, v in row["verify"].items()},
    }
    steps = sorted({int(n) for s in statuses.values() for n in s})
    # a checkpoint verify-checkpoint did not look at (--verify around) is no disagreement
    disagreeing = [n for n in steps if len({by[str(n)] for by in statuses.values() if str(n) in by}) > 1]
    verdict = row["bisect"]["verdict"]
    outcome = {"verdict": verdict, "inconclusive": verdict == "inconclusive", "disagreements": disagreeing}
    named = row["bisect"]["suspect_ranks"]
    drains = [r for r in row["bisect"].get("suspect_recommendations", []) if "drain node" in r]
    if row["kind"] == "clean":
        bad = [f"{c} {n}: {s}" for c, by in statuses.items() for n, s in by.items() if s in ("corrupt", "tainted")]
        outcome |= {
            "false_alarm": verdict == "corruption" or bool(bad),
            "bad_statuses": bad,
            "healthy_ranks_named": named,
            "drain_advice": bool(drains),
        }
        return outcome
    from sdc_forensics.inject import ALL_LOCATIONS, parse_spec

    spec = parse_spec(row["fault"], ALL_LOCATIONS)
    faulty = [] if spec.location in EVERY_RANK else [spec.rank]
    clean_after = [f"{c} {n}" for c, by in statuses.items() for n, s in by.items() if int(n) > spec.step and s == CLEAN]
    candidate = row["bisect"]["weak_candidate"]
    first = row["bisect"]["first_divergent_step"]
    outcome |= {
        "false_clean": clean_after,
        "exact_step_rank": verdict == "corruption"
        and first == spec.step
        and named == faulty
        and (faulty or "collective" in row["bisect"].get("suspect_locations", [])),
        "missed": verdict == "clean",
        "weak_candidate_matches": None
        if verdict != "inconclusive" or candidate is None
        else candidate["step"] == spec.step and candidate["ranks"] == faulty,
        "healthy_ranks_named": [r for r in named if r not in faulty],
        "wrong_step": verdict == "corruption" and first is not None and first != spec.step,
        "drain_advice": bool(drains) and len(named) > 1,
    }
    return outcome


def tally(rows: list[dict], seconds: float) -> dict:
    """The campaign's totals over judged rows (each carrying ``outcome`` and, if faulted, ``effect``)."""
    judged = [r for r in rows if r["kind"] != "twin"]
    clean = [r for r in judged if r["kind"] == "clean"]
    faulted = [r for r in judged if r["kind"] == "faulted"]
    effective = [r for r in faulted if r["effect"]["effective"]]
    ineffective = [r for r in faulted if not r["effect"]["effective"]]
    count = lambda rs, key: sum(1 for r in rs if r["outcome"].get(key))  # noqa: E731
    return {
        "runs": len(judged),
        "clean_runs": len(clean),
        "faulted_runs": len(faulted),
        "effective": len(effective),
        "ineffective": len(ineffective),
        "false_alarms": count(clean, "false_alarm"),
        "false_clean_certificates": count(effective, "false_clean"),
        "false_clean_ineffective": count(ineffective, "false_clean"),
        "exact_step_rank": count(effective, "exact_step_rank"),
        "missed": count(effective, "missed"),
        "inconclusive": count(judged, "inconclusive"),
        "inconclusive_clean": count(clean, "inconclusive"),
        "inconclusive_faulted": count(faulted, "inconclusive"),
        "weak_candidate_matches": count(faulted, "weak_candidate_matches"),
        # issue 19: a healthy rank named as a suspect, a verdict at another step, "drain" advice for several nodes
        "runs_naming_healthy_ranks": count(judged, "healthy_ranks_named"),
        "healthy_ranks_named": sum(len(r["outcome"].get("healthy_ranks_named") or []) for r in judged),
        "wrong_step": count(faulted, "wrong_step"),
        "drain_advice_for_several_nodes": count(faulted, "drain_advice"),
        "disagreements": count(judged, "disagreements"),
        "twins_valid": all(r["effect"]["identical_before_fault"] for r in faulted),
        # the largest tolerant residual / tolerance bisect's replay met on a clean run: the clean artefact
        # that grading must stay far above (replay_compare.CLEAN_ARTEFACT_MAX)
        "clean_max_residual_ratio": max((r["bisect"].get("max_residual_ratio") or 0.0 for r in clean), default=0.0),
        "seconds": round(seconds, 1),
        "train_s_mean": round(float(np.mean([r["train_s"] for r in judged])), 2) if judged else None,
        "cli_s_mean": round(float(np.mean([r["cli_s"] for r in judged])), 2) if judged else None,
        "ineffective_faults": [{"fault": r["fault"], **r["effect"]} for r in ineffective],
    }


# ---------------------------------------------------------------------------------- main
def run_children(script: str, plans: list, options, jobs: int, describe) -> list[dict]:
    """Run each plan in a fresh interpreter of ``script`` (``--_child PLAN --_options OPTIONS``:
    its own fork server and torch threads), ``jobs`` at a time; report each row with
    ``describe(row)``. Raises SystemExit naming the first run that failed."""

    def child(plan) -> dict:
        args = [
            sys.executable,
            script,
            "--_child",
            json.dumps(dataclasses.asdict(plan)),
            "--_options",
            json.dumps(dataclasses.asdict(options) | {"out_dir": str(options.out_dir)}),
        ]
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            return dataclasses.asdict(plan) | {"error": f"run failed (exit {proc.returncode}): {tail}"}
        return json.loads(proc.stdout.strip().splitlines()[-1])

    rows: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for row in pool.map(child, plans):
            rows.append(row)
            describe(row)
    failed = [r for r in rows if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed; first: {failed[0]['error']}")
    return rows


def _check_cli(options: CampaignOptions) -> None:
    flags = (["--threads"] if options.replay_threads else []) + (["--tolerant"] if options.tolerant else [])
    for command in ("bisect", "certify", "verify-checkpoint"):
        text = subprocess.run(
            [sys.executable, "-m", "sdc_forensics.cli.main", command, "--help"], capture_output=True, text=True
        ).stdout
        missing = [f for f in flags if f not in text]
        if missing:
            raise SystemExit(
                f"sdc-forensics {command} has no {', '.join(missing)} option yet; "
                "run with --replay-threads 0 (bitwise control) or update the package"
            )


def campaign(options: CampaignOptions, progress=print) -> dict:
    """Plan, run (``jobs`` at a time), measure each fault against its twin, and tally."""
    _check_cli(options)
    started = time.monotonic()
    rows = run_children(
        __file__,
        plan_runs(options),
        options,
        options.jobs,
        lambda row: progress(
            f"{row['index']:3d} {row['kind']:7s} {row.get('fault') or '':36s} "
            + (row.get("error") or f"{row.get('bisect', {}).get('verdict', '')} {row.get('seconds', '')} s")
        ),
    )
    twins = {r["variant"]: r["trace"] for r in rows if r["kind"] in ("clean", "twin")}
    for row in rows:
        if row["kind"] != "twin":
            row["outcome"] = judge(row)
        if row["kind"] == "faulted":
            row["effect"] = measure_effect(Path(row["trace"]), Path(twins[row["variant"]]), row["fault"])
    summary = tally(rows, time.monotonic() - started)
    settings = dataclasses.asdict(options) | {"out_dir": str(options.out_dir)}
    return summary | {"settings": settings, "rows": rows}


def bit_class(bit: int) -> str:
    """sign (31), exponent (23..30), high mantissa (16..22), low mantissa (below 16)."""
    return "sign" if bit == 31 else "exponent" if bit >= 23 else "high mantissa" if bit >= 16 else "low mantissa"


def markdown(result: dict) -> str:
    """The summary and the per (location, bit class) table of a campaign result, as Markdown."""
    from sdc_forensics.inject import ALL_LOCATIONS, parse_spec

    lines = ["| | count |", "| --- | ---: |"]
    rows = (
        ("runs (clean + faulted)", f"{result['runs']} ({result['clean_runs']} + {result['faulted_runs']})"),
        ("effective faults (ineffective, listed apart)", f"{result['effective']} ({result['ineffective']})"),
        (
            "healthy ranks named as suspects (runs)",
            f"{result['healthy_ranks_named']} ({result['runs_naming_healthy_ranks']})",
        ),
        ("`corruption` at another step than the fault's", result["wrong_step"]),
        ('"drain" advice for several nodes', result["drain_advice_for_several_nodes"]),
        ("false alarms (clean run called `corruption`, or a checkpoint `corrupt`/`tainted`)", result["false_alarms"]),
        (
            "false-clean certificates (a checkpoint `N > s` called clean after an effective fault at `s`)",
            result["false_clean_certificates"],
        ),
        (
            "exact step and rank (`corruption`, `s*` = fault step, suspects = fault rank or the collective)",
            f"{result['exact_step_rank']} of {result['effective']}",
        ),
        (
            "`inconclusive` faulted runs whose weak candidate names the fault's step and rank",
            f"{result['weak_candidate_matches']} of {result['inconclusive_faulted']}",
        ),
        ("missed (verdict `clean` on an effective fault)", result["missed"]),
        (
            "inconclusive clean runs (a tolerant replay certifies nothing)",
            f"{result['inconclusive_clean']} of {result['clean_runs']}",
        ),
        ("runs where bisect, certify and verify-checkpoint disagree on a checkpoint", result["disagreements"]),
        ("largest clean tolerant residual / replay tolerance", result["clean_max_residual_ratio"]),
        ("seconds per run, mean (training; the three commands)", f"{result['train_s_mean']}; {result['cli_s_mean']}"),
    )
    lines += [f"| {name} | {value} |" for name, value in rows]
    table: dict[tuple[str, str], dict[str, int]] = {}
    for row in result["rows"]:
        if row["kind"] != "faulted" or not row["effect"]["effective"]:
            continue
        spec = parse_spec(row["fault"], ALL_LOCATIONS)
        cell = table.setdefault(
            (spec.location, bit_class(spec.bit)),
            dict.fromkeys(("runs", "exact", "inconclusive", "named", "healthy"), 0),
        )
        outcome = row["outcome"]
        cell["runs"] += 1
        cell["exact"] += bool(outcome["exact_step_rank"])
        cell["inconclusive"] += bool(outcome["inconclusive"])
        cell["named"] += bool(outcome["weak_candidate_matches"])
        cell["healthy"] += len(outcome.get("healthy_ranks_named") or [])
    lines += [
        "",
        "| location | bit class | effective runs | exact step+rank | inconclusive (candidate named) | healthy ranks named |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {loc} | {cls} | {c['runs']} | {c['exact']} | {c['inconclusive']} ({c['named']}) | {c['healthy']} |"
        for (loc, cls), c in sorted(table.items())
    ]
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clean", type=int, default=None, help="clean runs")
    parser.add_argument("--faulted", type=int, default=None, help="runs with one injected fault each")
    parser.add_argument("--seed", type=int, default=0, help="draws variants and faults")
    parser.add_argument("--quick", action="store_true", help=f"preset: {QUICK}")
    parser.add_argument("--json", action="store_true", help="print the summary and rows as one JSON object on stdout")
    parser.add_argument(
        "--out", type=Path, default=None, help="directory for the runs (default: a temporary one, removed)"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 40; 12 with --quick)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=None, help="checkpoint interval (default 10; 4 with --quick)"
    )
    parser.add_argument("--train-threads", type=int, default=1, help="intra-op threads of every rank in training")
    parser.add_argument(
        "--replay-threads", type=int, default=2, help="the CLI's --threads (0: omit it, replay as recorded)"
    )
    parser.add_argument(
        "--tolerant", action="store_true", help="pass --tolerant to the CLI (force the tolerant comparison)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (1 or 2)")
    parser.add_argument(
        "--verify",
        choices=("all", "around"),
        default="all",
        help="verify-checkpoint --trace on every checkpoint, or around the fault (first, last, and either side of it)",
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the summary and the per location / bit class table as Markdown"
    )
    parser.add_argument(
        "--rejudge",
        type=Path,
        default=None,
        help="re-judge and re-tally the rows of an earlier --json output (no run is made)",
    )
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_options", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args._child:
        options = json.loads(args._options)
        options = CampaignOptions(**options | {"out_dir": Path(options["out_dir"])})
        print(json.dumps(run_one(RunPlan(**json.loads(args._child)), options)))
        return
    if args.rejudge is not None:
        earlier = json.loads(args.rejudge.read_text(encoding="utf-8"))
        rows = earlier["rows"]
        for row in rows:
            if row["kind"] != "twin":
                row["outcome"] = judge(row)
        result = tally(rows, earlier.get("seconds", 0.0)) | {"settings": earlier.get("settings"), "rows": rows}
        print(markdown(result) if args.markdown else json.dumps(result, indent=1, sort_keys=True))
        return
    preset = QUICK if args.quick else {"clean": None, "faulted": None, "steps": 40, "checkpoint_every": 10}
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
    if pick("clean") is None or pick("faulted") is None:
        raise SystemExit("give --clean N --faulted M, or --quick")
    with tempfile.TemporaryDirectory(prefix="sdc-campaign-") as tmp:
        options = CampaignOptions(
            clean=pick("clean"),
            faulted=pick("faulted"),
            seed=args.seed,
            out_dir=(args.out or Path(tmp)).resolve(),
            steps=pick("steps"),
            checkpoint_every=pick("checkpoint_every"),
            train_threads=args.train_threads,
            replay_threads=args.replay_threads,
            tolerant=args.tolerant,
            jobs=args.jobs,
            verify=args.verify,
        )
        options.out_dir.mkdir(parents=True, exist_ok=True)
        result = campaign(options, progress=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
    else:
        for key, value in result.items():
            if key not in ("rows", "settings", "ineffective_faults"):
                print(f"{key:26s} {value}")
        for fault in result["ineffective_faults"]:
            print(f"ineffective: {fault['fault']} (effect {fault['effect']} x tolerance at {fault['where']})")


if __name__ == "__main__":
    main()
