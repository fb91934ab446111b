"""Deep fuzzing of every hostile input: the properties of ``tests/fuzz`` with many more examples.

Runs each in-process property of ``tests/fuzz/test_fuzz_*.py`` (the CLI ones excepted: each of
their examples is a whole CLI run, and they check the same inputs through the exit codes) with
``--examples`` examples in all, split evenly, randomised from ``--seed``, and prints per input
kind: the inputs read, how many were refused (the documented error: exit 3), failures (0
expected: hypothesis stops a property at its first failure and prints the minimal input), the
slowest example and the mean. Every example is bounded in time (``SDC_FUZZ_HANG_S``, default 20 s)
and address space (``SDC_FUZZ_MEMORY_BYTES``, default 4 GiB) by ``tests/fuzz/harness.py``.

    python benchmarks/fuzz.py [--examples 20000] [--seed N] [--only pt,trace] [--json]

The same properties run in CI with a few thousand examples (``python -m pytest tests/fuzz``,
profile ``ci``); ``SDC_FUZZ_PROFILE=deep`` runs the folder with this depth under pytest instead.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ("pt", "safetensors", "dcp", "hf_index", "folder", "trace", "notes", "certificate")


def _properties(only: set[str] | None):
    """``(module name, test name, test)`` of every in-process property."""
    for name in MODULES:
        if only and name not in only:
            continue
        module = importlib.import_module(f"tests.fuzz.test_fuzz_{name}")
        for attr in sorted(vars(module)):
            test = getattr(module, attr)
            if attr.startswith("test_") and hasattr(test, "hypothesis"):
                yield name, attr, test


def _describe(exc: BaseException) -> list[str]:
    """One text per distinct failure (hypothesis groups several): the exception, where it was
    raised, and hypothesis's notes (the minimal input)."""
    # BaseExceptionGroup is Python 3.11's; hypothesis groups failures with it only there
    if sys.version_info >= (3, 11) and isinstance(exc, BaseExceptionGroup):  # noqa: F821 - a 3.11 builtin
        return [text for sub in exc.exceptions for text in _describe(sub)]
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:1500]
    at = f" at {where.filename}:{where.lineno}" if where else ""
    notes = "\n".join(getattr(exc, "__notes__", []))[:3000]
    return [f"{text}{at}\n{notes}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--examples", type=int, default=20_000, help="examples in all, split evenly over the properties"
    )
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a random one, printed)")
    parser.add_argument("--only", default="", help=f"comma-separated modules among {', '.join(MODULES)}")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of the table")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    only = {name.strip() for name in args.only.split(",") if name.strip()} or None

    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("SDC_FUZZ_PROFILE", "deep")
    from datetime import timedelta

    from hypothesis import HealthCheck, Phase
    from hypothesis import seed as hypothesis_seed
    from hypothesis import settings

    from tests.fuzz import harness

    properties = list(_properties(only))
    per_property = max(1, args.examples // max(1, len(properties)))
    bench = settings(
        max_examples=per_property,
        derandomize=False,
        database=None,
        deadline=timedelta(seconds=5),
        print_blob=True,
        suppress_health_check=list(HealthCheck),
        phases=list(Phase),
    )
    failures: dict[str, list[str]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sdc-fuzz-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index, (module, name, test) in enumerate(properties):
            runnable = hypothesis_seed(seed + index)(settings(bench)(test))
            t0 = time.perf_counter()
            try:
                runnable(scratch=harness.Scratch(Path(tmp) / name))
                status = "ok"
            except Exception as exc:  # noqa: BLE001 - a failing property is the finding to report
                failures.setdefault(module, []).extend(f"{name}: {text}" for text in _describe(exc))
                status = "FAILED"
            print(
                f"[{time.perf_counter() - started:7.1f} s] {module}.{name}: {status} ({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
            )
    command = " ".join(
        shlex.quote(a)
        for a in [sys.executable, "benchmarks/fuzz.py", "--examples", str(args.examples), "--seed", str(seed)]
        + (["--only", args.only] if args.only else [])
    )
    rows = {
        kind: {
            "inputs_read": s.examples,
            "refused": s.refused,
            "max_s": round(s.max_s, 3),
            "mean_s": round(s.total_s / s.examples, 4) if s.examples else 0.0,
        }
        for kind, s in sorted(harness.STATS.items())
    }
    failed = sum(len(v) for v in failures.values())
    if args.json:
        print(
            json.dumps(
                {
                    "command": command,
                    "seed": seed,
                    "examples_per_property": per_property,
                    "properties": len(properties),
                    "wall_s": round(time.perf_counter() - started, 1),
                    "kinds": rows,
                    "failures": failures,
                },
                indent=2,
                sort_keys=True,
            )
        )
    else:
        print(f"{'kind':<12} {'inputs read':>11} {'refused':>8} {'failures':>8} {'max s/example':>13} {'mean s':>8}")
        for kind, row in rows.items():
            module = {"hf-index": "hf_index", "manifest": "trace"}.get(kind, kind)
            print(
                f"{kind:<12} {row['inputs_read']:>11} {row['refused']:>8} {len(failures.get(module, [])) if kind != 'manifest' else '':>8} "
                f"{row['max_s']:>13.3f} {row['mean_s']:>8.4f}"
            )
        print(
            f"\n{len(properties)} properties x {per_property} examples, {failed} failing, "
            f"{time.perf_counter() - started:.0f} s wall; inputs read include hypothesis's shrinking and replayed examples"
        )
        for module, found in failures.items():
            for text in found:
                print(f"\nFAILED {module}: {text}")
        print(f"\n{command}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
