"""The ledger and the follower (issue 22): replayed steps at incident time with and without the
ledger, and how far ``certify --follow`` lags behind training.

Two demo jobs (4 ``gloo`` processes on CPU, one thread each, ``--steps`` steps, a checkpoint every
``--checkpoint-every``), each with ``sdc-forensics certify --follow`` started beside it as its own
process (``--poll 0.2``), as it would run on a spare node:

* **clean job**: while training runs, the number of ledger records is sampled every 0.1 s; when
  training exits, the follower's lag is the closed intervals without a record; then the seconds
  until the follower has every interval (``--until-step`` the last checkpoint). Then ``certify``
  twice by hand, without the ledger (``--no-ledger``) and with it: replayed steps and seconds.
* **faulty job** (``--fault``, a bit flip in one rank's local gradient): the follower stops with
  the incident; the interval that alarmed and the step and rank it names. Then the incident-time
  ``bisect``: without the ledger, and with the ledger the follower left: replayed steps, seconds,
  and whether both name the same step, rank and last clean checkpoint.

Also: per interval the follower's replay seconds over training's (the 4 ranks replayed by one
process), the largest lag while training ran (closed intervals without a record, sampled every
0.1 s once the follower's first record is there), and the alarm latency: the last step training
had recorded when the follower's alarm came.

    python benchmarks/bench_ledger.py [--steps 200] [--checkpoint-every 10] [--fault grad:step=145:rank=2:bit=31] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMEOUT_S = 1200


def _train(out: Path, steps: int, every: int, injections: tuple[str, ...]) -> subprocess.Popen:
    code = (
        "import sys; from sdc_forensics.demo.run import run_demo; "
        f"run_demo(sys.argv[1], injections={injections!r}, steps={steps}, checkpoint_every={every})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _follower(trace: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "sdc_forensics", "certify", "--follow", str(trace), "--poll", "0.2", "--json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _records(trace: Path) -> int:
    from sdc_forensics.ledger import read_ledger

    return len(read_ledger(trace / "ledger.jsonl").records)


def _cli(*args: str) -> tuple[dict, float, int]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sdc_forensics", *args, "--json"], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    return json.loads(done.stdout), time.monotonic() - started, done.returncode


def _answer(doc: dict) -> tuple:
    last = doc.get("last_clean_checkpoint")
    return doc["first_divergent_step"], [s["rank"] for s in doc["suspects"]], None if last is None else last["step"]


def clean_job(root: Path, steps: int, every: int) -> dict:
    out = root / "clean"
    trace = out / "trace"
    intervals = steps // every
    started = time.monotonic()
    training = _train(out, steps, every, ())
    follower = _follower(trace, "--until-step", str(steps), "--idle-timeout", "600")
    lags = []  # (closed intervals - records) while training runs, once the follower's first record is there
    while training.poll() is None:
        count = _records(trace) if (trace / "ledger.jsonl").exists() else 0
        if count:
            lags.append(max(0, _closed(trace) - count))
        time.sleep(0.1)
    train_s = time.monotonic() - started
    at_end = _records(trace) if (trace / "ledger.jsonl").exists() else 0
    stdout, _ = follower.communicate(timeout=TIMEOUT_S)
    caught_up_s = time.monotonic() - started - train_s
    follow = json.loads(stdout)
    costs = _interval_costs(trace)
    no_ledger, no_ledger_s, _ = _cli("certify", str(trace), "--no-ledger")
    with_ledger, with_ledger_s, _ = _cli("certify", str(trace))
    return {
        "training_s": round(train_s, 1),
        "intervals": intervals,
        "interval_costs": costs,
        "replay_over_training": _ratios(costs),
        "max_lag_while_training": max(lags, default=None),
        "lag_samples": len(lags),
        "lag_at_training_end": intervals - at_end,
        "follower_done_after_training_s": round(caught_up_s, 1),
        "follower_exit": follower.returncode,
        "follower_statuses": sorted({c["status"] for c in follow["checkpoints"]}),
        "certify_steps_replayed_without_ledger": _steps(no_ledger, "exact_now"),
        "without_ledger_s": round(no_ledger_s, 1),
        "certify_steps_from_ledger": _steps(with_ledger, "exact_ledger"),
        "certify_exact_now_with_ledger": _steps(with_ledger, "exact_now"),
        "statuses_equal": [c["status"] for c in no_ledger["checkpoints"]]
        == [c["status"] for c in with_ledger["checkpoints"]],
        "with_ledger_s": round(with_ledger_s, 1),
    }


def _closed(trace: Path) -> int:
    """Checkpoint intervals closed so far (noted checkpoints after the first)."""
    notes = trace / "checkpoints"
    return max(0, len(list(notes.glob("step-*.json"))) - 1) if notes.is_dir() else 0


def _last_step(trace: Path) -> int | None:
    from sdc_forensics.errors import SdcError
    from sdc_forensics.trace.reader import Trace

    try:
        bounds = Trace.open(trace).step_range()
    except (SdcError, OSError):
        return None
    return None if bounds is None else bounds[1]


def _ratios(costs: list[dict]) -> dict:
    """The follower's replay seconds over training's, per interval (the first, with the model built and torch
    warmed up, apart): median and range. Training ran W processes; the follower replays all W ranks in one."""
    import statistics

    later = [c["replay_s"] / c["training_s"] for c in costs[1:] if c["training_s"] > 0]
    if not later:
        return {}
    return {
        "median": round(statistics.median(later), 3),
        "min": round(min(later), 3),
        "max": round(max(later), 3),
        "intervals": len(later),
    }


def _interval_costs(trace: Path) -> list[dict]:
    """Per interval: training seconds (between the two checkpoint notes' save times) and the
    follower's replay seconds (its ledger record), all 4 ranks replayed in one process."""
    from sdc_forensics.ledger import read_ledger
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes

    saved = {n.step: n.saved_ns for n in read_checkpoint_notes(trace)}
    out = []
    for r in sorted(read_ledger(trace / "ledger.jsonl").records, key=lambda r: r.start_step):
        train_s = (saved[r.stop_step] - saved[r.start_step]) / 1e9
        out.append(
            {"interval": [r.start_step, r.stop_step], "training_s": round(train_s, 3), "replay_s": round(r.wall_s, 3)}
        )
    return out


def _steps(certify_doc: dict, kind: str) -> int:
    """Steps before the last checkpoint examined as ``kind`` (``exact_now``, ``exact_ledger``)."""
    return sum(b - a + 1 for a, b in certify_doc["coverage"][-1][kind])


def faulty_job(root: Path, steps: int, every: int, fault: str) -> dict:
    out = root / "faulty"
    trace = out / "trace"
    training = _train(out, steps, every, (fault,))
    follower = _follower(trace, "--idle-timeout", "600")
    alarm_step = None  # the last step training had recorded when the follower's alarm came (it exits with it)
    while follower.poll() is None:
        if training.poll() is None:
            alarm_step = _last_step(trace)
        time.sleep(0.1)
    stdout, _ = follower.communicate(timeout=TIMEOUT_S)
    training_ended_first = training.poll() is not None and alarm_step is None
    training.wait(timeout=TIMEOUT_S)
    follow = json.loads(stdout)["follow"]
    alarm = follow["intervals"][-1]
    spare = root / "faulty-no-ledger"
    shutil.copytree(out, spare, ignore=shutil.ignore_patterns("ledger.jsonl"))
    without, without_s, code_without = _cli(
        "bisect", str(spare / "trace"), "--no-ledger", "--checkpoints", str(spare / "checkpoints")
    )
    with_ledger, with_s, code_with = _cli("bisect", str(trace))
    return {
        "fault": fault,
        "follower_exit": follower.returncode,
        "alarm_interval": [alarm["from"], alarm["last"]],
        "training_step_at_alarm": alarm_step,
        "training_over_before_alarm": training_ended_first,
        "follower_names": _answer(follow["incident"]) if follow["incident"] else None,
        "bisect_without_ledger": {
            "steps_replayed": without["replayed"]["steps_replayed"],
            "seconds": round(without_s, 1),
            "answer": _answer(without),
            "exit": code_without,
        },
        "bisect_with_ledger": {
            "steps_replayed": with_ledger["replayed"]["steps_replayed"],
            "seconds": round(with_s, 1),
            "steps_reused": with_ledger["replayed"].get("ledger", {}).get("steps_reused"),
            "answer": _answer(with_ledger),
            "exit": code_with,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--fault", default="grad:step=145:rank=2:bit=31")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        root = Path(tmp)
        result = {
            "machine": f"{platform.processor() or platform.machine()}, {platform.python_version()}, torch {torch.__version__}",
            "clean": clean_job(root, args.steps, args.checkpoint_every),
            "faulty": faulty_job(root, args.steps, args.checkpoint_every, args.fault),
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    clean, faulty = result["clean"], result["faulty"]
    print(f"machine: {result['machine']}")
    print(
        f"clean job: training {clean['training_s']} s, {clean['intervals']} intervals; follower lag when training ended: "
        f"{clean['lag_at_training_end']} interval(s); follower done {clean['follower_done_after_training_s']} s after training "
        f"(exit {clean['follower_exit']}, statuses {clean['follower_statuses']})"
    )
    for row in clean["interval_costs"]:
        print(f"  interval {row['interval']}: training {row['training_s']} s, follower's replay {row['replay_s']} s")
    print(
        f"  certify without ledger: {clean['certify_steps_replayed_without_ledger']} steps replayed, {clean['without_ledger_s']} s; "
        f"with the follower's ledger: {clean['certify_exact_now_with_ledger']} replayed, {clean['certify_steps_from_ledger']} "
        f"from the ledger, {clean['with_ledger_s']} s; same statuses: {clean['statuses_equal']}"
    )
    print(
        f"  follower replay / training per interval (after the first): {clean['replay_over_training']} (W = 4 ranks replayed "
        f"by one process); largest lag while training: {clean['max_lag_while_training']} interval(s) over {clean['lag_samples']} samples"
    )
    print(
        f"faulty job ({faulty['fault']}): follower alarmed on interval {faulty['alarm_interval']}, naming {faulty['follower_names']}; "
        f"training was at step {faulty['training_step_at_alarm']} then"
        + (" (training was over)" if faulty["training_over_before_alarm"] else "")
    )
    for name in ("bisect_without_ledger", "bisect_with_ledger"):
        row = faulty[name]
        print(
            f"  {name}: {row['steps_replayed']} steps replayed, {row['seconds']} s, answer {row['answer']}, exit {row['exit']}"
        )


if __name__ == "__main__":
    main()
