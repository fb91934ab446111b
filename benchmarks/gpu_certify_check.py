"""Issue 21, item 7: a GPU job certified by an exact replay on its own GPU, never by a CPU replay.

Trains the BatchNorm conv net (``sdc_forensics.demo.batchnorm:recipe``) with 4 DDP ranks on one
device, twice over: with PyTorch's default settings and with ``replayable()`` (deterministic
kernels, the ordered reduction); each way a clean run and one fault at each of ``grad``,
``weights``, ``allreduce-all`` and ``update``. On a GPU the 4 ranks share ``cuda:0`` (gloo over
CUDA tensors: NCCL refuses two ranks on one GPU). Then ``certify`` judges every run:

* replayed on the training device: ``exact`` (with default settings on a GPU, where CUDA may pick
  non-deterministic kernels: exact, or tolerant and certifying nothing); a clean run has every checkpoint certified; a fault
  is found at its step and rank (no rank for ``allreduce-all``), nothing after it certified;
* on a GPU, the same traces replayed on the CPU: never ``exact``, no checkpoint after 0 certified,
  and no rank named but the fault's.

Without a GPU the runs train and replay on the CPU: that checks this script's plumbing (the
training device's expectations on CPU), and the summary says that the CUDA parts were skipped.
Prints one line per check and writes ``gpu_certify.json`` (every check, expected and found) to
``--out`` (default: ``$RESULTS`` of gpu_check.sh, else a temporary directory). Exit 0 when every
check passed, 1 otherwise.

    python benchmarks/gpu_certify_check.py [--out DIR] [--modes default replayable]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

RECIPE = "sdc_forensics.demo.batchnorm:recipe"
STEPS, EVERY, WORLD_SIZE = 6, 3, 4
FAULTS = (
    None,
    "grad:step=4:rank=2:bit=30",
    "weights:step=4:rank=3:bit=30",
    "allreduce-all:step=4:rank=0:bit=30",
    "update:step=4:rank=1:bit=30",
)


def _certify(out: Path, device: str) -> dict:
    """What ``certify`` concluded, as plain values."""
    from sdc_forensics.forensics.certify import certify
    from sdc_forensics.replay.options import AnalysisOptions

    # the 4 ranks share this machine's one GPU, so a fault's suspect GPU is the only CUDA device
    # there is: the replay on it is forced (a real job replays on a GPU no suspect used)
    cert = certify(
        out / "trace",
        AnalysisOptions(checkpoints_dir=out / "checkpoints", device=device, force_device=device.startswith("cuda")),
    )
    result = cert.analysis
    return {
        "verdict": result.verdict.value,
        "first_divergent_step": result.first_divergent_step,
        "ranks": sorted({s.rank for s in result.suspects if s.rank is not None}),
        "named_no_rank": any(s.rank is None for s in result.suspects),
        "comparison": result.replayed.comparison if result.replayed is not None else None,
        "statuses": {c.step: c.status.value for c in cert.checkpoints},
    }


def expect_exact(fault, found: dict) -> list[str]:
    """What is wrong with ``found`` for a replay on the training device (empty: nothing)."""
    from sdc_forensics.inject import parse_spec

    wrong = [] if found["comparison"] == "exact" else [f"comparison {found['comparison']}, not exact"]
    statuses = found["statuses"]
    if fault is None:
        if found["verdict"] != "clean" or set(statuses.values()) != {"clean"}:
            wrong.append(f"clean run: verdict {found['verdict']}, checkpoints {statuses}")
        return wrong
    spec = parse_spec(fault)
    want = [] if spec.location == "allreduce-all" else [spec.rank]
    if (found["verdict"], found["first_divergent_step"], found["ranks"]) != ("corruption", spec.step, want):
        wrong.append(f"found {found['verdict']} at step {found['first_divergent_step']} ranks {found['ranks']}")
    if any(s != "clean" for n, s in statuses.items() if n <= spec.step) or any(
        s == "clean" for n, s in statuses.items() if n > spec.step
    ):
        wrong.append(f"checkpoints {statuses}")
    return wrong


def expect_tolerant(fault, found: dict) -> list[str]:
    """What is wrong with ``found`` for a CPU replay of a GPU trace (empty: nothing)."""
    from sdc_forensics.inject import parse_spec

    wrong = ["comparison exact on another device class"] if found["comparison"] == "exact" else []
    certified = [n for n, s in found["statuses"].items() if n > 0 and s == "clean"]
    if certified:
        wrong.append(f"checkpoint(s) {certified} certified by a tolerant replay")
    allowed = [] if fault is None or parse_spec(fault).location == "allreduce-all" else [parse_spec(fault).rank]
    if not set(found["ranks"]) <= set(allowed):
        wrong.append(f"named rank(s) {found['ranks']}")
    return wrong


def expect_safe(fault, found: dict) -> list[str]:
    """A default-settings GPU job replayed on its GPU: exact (then judged so), or tolerant certifying nothing."""
    return expect_exact(fault, found) if found["comparison"] == "exact" else expect_tolerant(fault, found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where gpu_certify.json and the runs go")
    parser.add_argument("--modes", nargs="+", choices=("default", "replayable"), default=["default", "replayable"])
    args = parser.parse_args(argv)
    import torch

    from sdc_forensics.demo.run import run_demo
    from sdc_forensics.errors import SdcError

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    out_dir = args.out or Path(os.environ.get("RESULTS") or tempfile.mkdtemp(prefix="gpu-certify-"))
    runs_dir = Path(tempfile.mkdtemp(prefix="gpu-certify-runs-"))
    checks, skipped = [], []
    if not cuda:
        skipped.append(
            "no CUDA device: trained and replayed on the CPU (plumbing only); the GPU training, the exact "
            "GPU replay and the tolerant CPU replay of a GPU trace were skipped"
        )
        print(f"gpu_certify_check: {skipped[0]}")
    started = time.monotonic()
    for mode in args.modes:
        for index, fault in enumerate(FAULTS):
            out = runs_dir / f"{mode}-{index}"
            t0 = time.monotonic()
            run_demo(
                out,
                injections=(fault,) if fault else (),
                steps=STEPS,
                checkpoint_every=EVERY,
                world_size=WORLD_SIZE,
                recipe=RECIPE,
                device=device,
                replayable=mode == "replayable",
            )
            train_s = time.monotonic() - t0
            # PyTorch's default settings let CUDA pick non-deterministic kernels (cuDNN's, atomics):
            # a replay of such a job on its own GPU may be tolerant, and then must certify nothing
            on_device = expect_exact if (mode == "replayable" or not cuda) else expect_safe
            replays = [(device, on_device)] + ([("cpu", expect_tolerant)] if cuda else [])
            for replay_device, expect in replays:
                try:
                    found = _certify(out, replay_device)
                except SdcError as error:  # one check failed: record it, go on with the rest
                    found = {
                        "verdict": f"error: {error}",
                        "first_divergent_step": None,
                        "ranks": [],
                        "named_no_rank": False,
                        "comparison": None,
                        "statuses": {},
                    }
                wrong = expect(fault, found)
                checks.append(
                    {
                        "mode": mode,
                        "fault": fault,
                        "trained_on": device,
                        "replayed_on": replay_device,
                        "expected": expect.__name__.removeprefix("expect_"),
                        "found": found,
                        "wrong": wrong,
                        "train_s": round(train_s, 1),
                    }
                )
                print(
                    f"{'ok  ' if not wrong else 'FAIL'} {mode:10s} {fault or 'clean':38s} {device} -> {replay_device}: "
                    f"{found['verdict']} {found['comparison']} {found['statuses']}"
                    + (f"  {'; '.join(wrong)}" if wrong else "")
                )
    failed = sum(1 for c in checks if c["wrong"])
    summary = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "checks": len(checks),
        "failed": failed,
        "skipped": skipped,
        "seconds": round(time.monotonic() - started, 1),
        "rows": checks,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_certify.json").write_text(
        json.dumps(summary, indent=1, sort_keys=True, default=str), encoding="utf-8"
    )
    print(
        f"gpu_certify_check: {len(checks) - failed}/{len(checks)} checks passed in {summary['seconds']} s"
        + (" (CUDA parts skipped: no GPU)" if not cuda else "")
        + f"; {out_dir / 'gpu_certify.json'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
