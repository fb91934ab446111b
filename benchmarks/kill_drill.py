"""Kill drills: SIGKILL one rank of a recorded DDP run at a chosen point of a step, then judge
the trace it left with the CLI.

Each drill trains the demo recipe (4 ``gloo`` processes on CPU, one thread each, ``--steps`` steps,
a checkpoint every ``--checkpoint-every``, no fault injected) and SIGKILLs one rank at a
deterministic point of one step (``sdc_forensics/demo/kill.py``): ``forward``, ``backward`` (DDP's
all-reduce in flight), ``record-write`` (half-way through writing its STEP record: a torn record
of a random length), ``checkpoint`` (while a checkpoint is saved: half a file from rank 0, the
saver), ``after-record``. Points cycle through a seeded order; the rank, the step and the torn
length are drawn with ``--seed``. The demo's launcher then ends the other ranks (as torchrun
would) and the whole run has a timeout, so a drill never hangs. Then, as subprocesses with
timeouts::

    sdc-forensics inspect TRACE --json
    sdc-forensics bisect TRACE --json                      (replays from the run's checkpoints)
    sdc-forensics report TRACE --trace-only -o review.md

A drill passes when ``inspect`` reads every rank to the last complete step the kill leaves (the
step killed for ``after-record``, the one before it otherwise, ``N - 1`` for checkpoint ``N``: an
expectation from the kill plan, not from the trace), names the killed rank among those where the
run stopped, finds no damage but the torn record; ``bisect`` answers (a verdict and its exit
code: ``clean``, 0, for these fault-free runs) and says the run stopped early at that last
complete step; and the review says the same.

    python benchmarks/kill_drill.py --kills 10 --seed 1 [--json] [--out DIR] [--steps 8] [--checkpoint-every 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POINTS = ("forward", "backward", "record-write", "checkpoint", "after-record")
WORLD_SIZE = 4
EXIT_BY_VERDICT = {"clean": 0, "corruption": 1, "inconclusive": 4}
CLI_TIMEOUT_S = 300
UNEXPECTED_DAMAGE = {"bad_checksum", "bad_header", "missing_rank", "missing_steps"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """One drill: where to kill."""

    index: int
    point: str
    rank: int
    step: int  # for ``checkpoint``: the checkpoint N (written after step N - 1)
    cut: int | None = None  # ``record-write``: bytes of the STEP record that reach the file

    @property
    def expected_last_complete(self) -> int | None:
        """The last step every rank recorded, from the kill plan alone."""
        last = self.step if self.point == "after-record" else self.step - 1
        return last if last >= 0 else None


@dataclasses.dataclass(kw_only=True)
class Outcome:
    """What the CLI said about one drill's trace."""

    plan: Plan
    read_last_complete: int | None = None
    stopped_ranks: tuple[int, ...] = ()
    inspect_ok: bool = False
    bisect_verdict: str = "-"
    bisect_exit: int | None = None
    bisect_ok: bool = False
    report_ok: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.inspect_ok and self.bisect_ok and self.report_ok

    def to_json(self) -> dict:
        return {
            **dataclasses.asdict(self.plan),
            "expected_last_complete": self.plan.expected_last_complete,
            "read_last_complete": self.read_last_complete,
            "stopped_ranks": list(self.stopped_ranks),
            "inspect_ok": self.inspect_ok,
            "bisect_verdict": self.bisect_verdict,
            "bisect_exit": self.bisect_exit,
            "bisect_ok": self.bisect_ok,
            "report_ok": self.report_ok,
            "ok": self.ok,
            "problems": self.problems,
            "seconds": round(self.seconds, 1),
        }


def plans(kills: int, seed: int, steps: int, checkpoint_every: int) -> list[Plan]:
    """``kills`` drills: the points in a seeded cycle, rank, step and cut drawn from ``seed``."""
    from sdc_forensics.trace import format as F

    rng = random.Random(seed)
    order = list(POINTS)
    rng.shuffle(order)
    checkpoints = [n for n in range(checkpoint_every, steps + 1, checkpoint_every)]
    out = []
    for index in range(kills):
        point = order[index % len(order)]
        step = rng.choice(checkpoints) if point == "checkpoint" else rng.randrange(1, steps - 1)
        rank = rng.randrange(WORLD_SIZE)
        cut = rng.randrange(1, F.record_size(8)) if point == "record-write" else None
        out.append(Plan(index=index, point=point, rank=rank, step=step, cut=cut))
    return out


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sdc-forensics", *args], capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def drill(plan: Plan, out_dir: Path, steps: int, checkpoint_every: int) -> Outcome:
    """Run one drill and judge its trace."""
    from sdc_forensics.demo.run import run_demo

    started = time.monotonic()
    outcome = Outcome(plan=plan)
    run_dir = out_dir / f"drill-{plan.index:02d}-{plan.point}"
    run_demo(
        run_dir,
        injections=(),
        steps=steps,
        checkpoint_every=checkpoint_every,
        world_size=WORLD_SIZE,
        kill_rank=plan.rank,
        kill_step=plan.step,
        kill_point=plan.point,
        kill_bytes=plan.cut,
        timeout_s=180,
    )
    trace = run_dir / "trace"
    expected = plan.expected_last_complete
    problems = outcome.problems

    inspected = _cli("inspect", str(trace), "--json")
    if inspected.returncode != 0:
        problems.append(f"inspect exited {inspected.returncode}: {inspected.stderr.strip()[:200]}")
    else:
        doc = json.loads(inspected.stdout)
        end = doc["end"]
        outcome.read_last_complete = end["last_complete_step"]
        outcome.stopped_ranks = tuple(end["stopped_ranks"])
        torn = {r["rank"]: r["torn_bytes"] for r in end["ranks"]}
        damage = {d["kind"] for d in doc["damage"]}
        checks = {
            "says the run stopped early": end["stopped_early"],
            f"last complete step {expected}": end["last_complete_step"] == expected,
            f"rank {plan.rank} among the stopped ranks": plan.rank in end["stopped_ranks"],
            "no damage but a torn tail": not damage & UNEXPECTED_DAMAGE,
            "not finalised": end["finalised"] is False,
        }
        if plan.point == "record-write":
            checks[f"rank {plan.rank}'s torn record of {plan.cut} bytes"] = torn.get(plan.rank) == plan.cut
        problems += [f"inspect: not {name}" for name, ok in checks.items() if not ok]
        outcome.inspect_ok = all(checks.values())

    bisected = _cli("bisect", str(trace), "--json")
    try:
        result = json.loads(bisected.stdout)
        outcome.bisect_verdict, outcome.bisect_exit = result["verdict"], bisected.returncode
        said = [line for line in result["trace"]["damage"] if line.startswith("the run stopped early")]
        checks = {
            "a clean verdict with its exit code": result["verdict"] == "clean"
            and bisected.returncode == EXIT_BY_VERDICT["clean"],
            "says the run stopped early": bool(said),
            f"says last complete step {expected}": any(f"last complete step {expected} " in line for line in said),
        }
        problems += [f"bisect: not {name}" for name, ok in checks.items() if not ok]
        outcome.bisect_ok = all(checks.values())
    except (json.JSONDecodeError, KeyError):
        outcome.bisect_exit = bisected.returncode
        problems.append(f"bisect exited {bisected.returncode} without a JSON verdict: {bisected.stderr.strip()[-300:]}")

    review_path = run_dir / "review.md"
    reported = _cli("report", str(trace), "--trace-only", "-o", str(review_path))
    review = review_path.read_text(encoding="utf-8") if review_path.is_file() else ""
    where = "every rank" if len(outcome.stopped_ranks) == WORLD_SIZE else f"rank {plan.rank} (host"
    checks = {
        "exit 0 (clean)": reported.returncode == 0,
        "a section 'The run stopped early'": "## The run stopped early" in review,
        f"'Last complete step: {expected}'": f"**Last complete step: {expected}**" in review,
        f"names {where}": where in review,
    }
    problems += [f"report: not {name}" for name, ok in checks.items() if not ok]
    outcome.report_ok = all(checks.values())
    outcome.seconds = time.monotonic() - started
    return outcome


def table(outcomes: list[Outcome]) -> str:
    """The Markdown table of ``docs/benchmarks.md``."""
    yes = {True: "yes", False: "**no**"}
    rows = [
        "| # | kill point | rank | step | last complete step: expected / read | stopped ranks read | inspect ok | "
        "bisect verdict (exit) | bisect says stopped early | report says it | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        p = o.plan
        point = p.point + (f" ({p.cut} B)" if p.cut is not None else "")
        step = f"ckpt {p.step}" if p.point == "checkpoint" else str(p.step)
        stopped = "all" if len(o.stopped_ranks) == WORLD_SIZE else ", ".join(map(str, o.stopped_ranks)) or "-"
        rows.append(
            f"| {p.index} | {point} | {p.rank} | {step} | {p.expected_last_complete} / {o.read_last_complete} | {stopped} | "
            f"{yes[o.inspect_ok]} | {o.bisect_verdict} ({o.bisect_exit}) | {yes[o.bisect_ok]} | {yes[o.report_ok]} | "
            f"{o.seconds:.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=10, help="number of drills (default 10)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    args = parser.parse_args(argv)
    import torch

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill-drill-") as tmp:
        out_dir = args.out or Path(tmp)
        outcomes = []
        for plan in plans(args.kills, args.seed, args.steps, args.checkpoint_every):
            outcome = drill(plan, out_dir, args.steps, args.checkpoint_every)
            outcomes.append(outcome)
            status = "ok" if outcome.ok else "FAILED: " + "; ".join(outcome.problems)
            print(
                f"drill {plan.index}: {plan.point} rank {plan.rank} step {plan.step}: {status} ({outcome.seconds:.0f} s)",
                file=sys.stderr,
            )
    passed = sum(o.ok for o in outcomes)
    machine = f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    if args.json:
        print(
            json.dumps(
                {
                    "schema_version": 1,
                    "seed": args.seed,
                    "kills": args.kills,
                    "steps": args.steps,
                    "checkpoint_every": args.checkpoint_every,
                    "world_size": WORLD_SIZE,
                    "machine": machine,
                    "passed": passed,
                    "seconds": round(time.monotonic() - started, 1),
                    "drills": [o.to_json() for o in outcomes],
                },
                indent=2,
                sort_keys=True,
            )
        )
    else:
        print(table(outcomes))
        print(f"\n{passed}/{len(outcomes)} drills passed in {time.monotonic() - started:.0f} s ({machine})")
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
