"""The sharded check's host work per step at a large world, in one process: what grows with ``W``.

An FSDP2 rank's reduce-scatter check (``recorder/fsdp_monitor.py``) sketches each of a call's
``W`` chunks (one kernel call over the list), resolves them, writes them into the step's table
(``step_table``: ``C x W`` rows) and, once the table is summed over the world, judges every row
(``findings_of``). The collective itself is not here (``cost_model.py`` models its bytes); this
times the host work around it, one rank's, for ``C`` calls of ``W`` chunks of ``--chunk``
float32 elements each (small: what is timed is the per-chunk work, not the bytes), the median
of ``--runs`` runs, one thread, for the two ways a call's chunks are sketched, alternating:
``rows`` (``core.chunk_rows``: one compiled call giving a ``(W, k + 2)`` array, what the check
does on the CPU kernel) and ``list`` (``core.fingerprints_async`` of the ``W`` chunk views, a
pending fingerprint each: the CUDA path, and the CPU path before ``chunk_rows``)::

    python benchmarks/bench_step_table.py --world 8 64 1024 --calls 40 --chunk 256 --runs 5
    git worktree add /tmp/base 3a836a9   # before: stop 49's last commit, its check and kernel
    PYTHONPATH=/tmp/base python benchmarks/bench_step_table.py --paths list

The summed table it judges is made consistent (every rank's own columns as this rank's, every
output the scaled sum of its inputs), so every row is judged and none is found.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core
from sdc_forensics.recorder import fsdp_monitor as fm


def _calls(world: int, calls: int, chunk: int) -> list[fm._Call]:
    generator = torch.Generator().manual_seed(world)
    out = []
    for _ in range(calls):
        grad = torch.randn(world * chunk, generator=generator)
        out.append(
            fm._Call(
                group=tuple(range(world)),
                dtype="float32",
                scale=1.0 / world,
                ar_scale=1.0,
                inputs=[],
                device=grad.device,
            )
        )
        out[-1].inputs = grad  # sketched in the timed part
    return out


def _consistent(table: np.ndarray, cols: fm._Columns, calls: int, world: int) -> np.ndarray:
    """``table`` (rank 0's) as if summed over a clean world: every row holds its rank's own numbers."""
    rows = table[1:].reshape(calls, world, cols.width).copy()
    k = cols.k
    own = rows[:, 0:1, :]
    for column in (cols.HAS_OUT, cols.SCALE, cols.HAS_SCALE, cols.SIZE, cols.FIRST, cols.DTYPE):
        rows[:, :, column] = own[:, :, column]
    rows[:, :, cols.OUT.start : cols.OUT.start + k] = (
        rows[:, :, cols.SCALE, None] * rows[:, :, cols.IN.start : cols.IN.start + k]
    )
    rows[:, :, cols.OUT.start + k] = rows[:, :, cols.SCALE] * np.sqrt(rows[:, :, cols.IN.start + k])
    rows[:, :, cols.OUT.start + k + 1] = 0
    return np.concatenate([[0.0], rows.reshape(-1)])


def one_step(world: int, calls: int, chunk: int, k: int, rows: bool = True) -> dict[str, float]:
    made = _calls(world, calls, chunk)
    times = {}
    start = time.perf_counter()
    for call in made:
        call.inputs = (
            fm.chunk_sketches(call.inputs, world, k, C.DEFAULT_SEED)
            if rows
            else core.fingerprints_async(call.inputs.chunk(world), k=k, with_digest=False)
        )
        call.output = core.fingerprint_async(torch.zeros(chunk), k=k, with_digest=False)
    times["sketch"] = time.perf_counter() - start
    start = time.perf_counter()
    monitor = fm.FsdpMonitor(sketch_k=k)
    numbers = monitor._numbers(made)
    times["resolve"] = time.perf_counter() - start
    cols = fm._Columns(k, hsdp=False)
    start = time.perf_counter()
    table = fm.step_table(made, numbers, cols, 0, world).numpy()
    times["table"] = time.perf_counter() - start
    summed = _consistent(table, cols, calls, world)
    start = time.perf_counter()
    found = fm.findings_of(summed, calls, world, cols, paired=True)
    times["judge"] = time.perf_counter() - start
    assert not found, found[:3]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=["rows", "list"],
        default=["rows", "list"],
        help="which ways to time (list alone runs on a checkout from before chunk_rows, on PYTHONPATH)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    core.warm_up()
    one_step(4, 2, args.chunk, args.k, rows="rows" in args.paths)
    results = []
    for world in args.world:
        # the two ways of sketching a call's chunks, alternating run by run
        runs = {path: [] for path in args.paths}
        for _ in range(args.runs):
            for path in runs:
                runs[path].append(one_step(world, args.calls, args.chunk, args.k, rows=path == "rows"))
        for path, timed in runs.items():
            row = {"world": world, "calls": args.calls, "chunk": args.chunk, "chunks": path}
            for part in timed[0]:
                row[f"{part}_ms"] = round(1e3 * statistics.median(r[part] for r in timed), 2)
            row["total_ms"] = round(sum(row[f"{part}_ms"] for part in timed[0]), 2)
            row["per_row_us"] = round(1e3 * row["total_ms"] / (world * args.calls), 2)
            results.append(row)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(
        f"{'W':>6} {'chunks':>6} {'sketch':>9} {'resolve':>9} {'table':>9} {'judge':>9} {'total ms':>9} {'us/row':>7}"
    )
    for row in results:
        print(
            f"{row['world']:>6} {row['chunks']:>6} {row['sketch_ms']:>9} {row['resolve_ms']:>9} {row['table_ms']:>9} "
            f"{row['judge_ms']:>9} {row['total_ms']:>9} {row['per_row_us']:>7}"
        )


if __name__ == "__main__":
    main()
