"""Measure which single-bit flips each fingerprint detects, in float32 and bfloat16 gradients.

Scenario: a ``W = 4`` all-reduce of gradient-like tensors (``gradsim``: heavy-tailed, ranks
half correlated, ring order, rounded in the gradient dtype); one bit of one element of the
reduced gradient flips (a wrong number out of the collective). Each fingerprint then compares
what a verifier would compare:

* exact digest: corrupted vs. the clean reduced tensor (a bitwise-reproducible recomputation);
* sketch: the all-reduce check of the trace, ``|S(reduced) - mean_r S(local_r)|`` against
  ``tolerance.allreduce_tolerance`` at the calibrated ``KAPPA``;
* stats: NaN/Inf count changed, or norm / max |x| moved by more than their own noise, measured
  as twice their spread over eight valid reductions of the same gradients (other ring
  rotations, pre- and post-division), and at least one rounding of the gradient dtype.

Elements are drawn uniformly over the tensor (most are small: a flip there is small too) and,
separately, from the 1% largest magnitudes. Prints Markdown tables of detection rates.

Usage::

    .venv/bin/python benchmarks/bitflip_table.py --trials 4 --elements 100
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsim  # noqa: E402

from sdc_forensics.fingerprint import core, tolerance  # noqa: E402

#: bit class -> bit position, per dtype (IEEE layout: sign | exponent | mantissa).
BITS = {
    "float32": {"sign": 31, "exponent high": 30, "exponent low": 23, "mantissa high": 22, "mantissa low": 0},
    "bfloat16": {"sign": 15, "exponent high": 14, "exponent low": 7, "mantissa high": 6, "mantissa low": 0},
}
COLUMNS = ("digest", "sketch", "stats", "nonfinite", "norm", "max_abs")
WORLD_SIZE = 4


def _stats_noise(grads: list[torch.Tensor], u_grad: float) -> tuple[float, float]:
    """Thresholds for norm and max |x|: 2x their spread over valid reductions, >= one rounding."""
    fps = [
        core.fingerprint(gradsim.ring_allreduce(grads, division=division, rotation=rotation), with_digest=False)
        for division in ("post", "pre")
        for rotation in range(WORLD_SIZE)
    ]
    norms = np.array([f.norm for f in fps])
    maxes = np.array([f.max_abs for f in fps])
    norm_thr = max(2 * np.ptp(norms), u_grad * norms.max())
    max_thr = max(2 * np.ptp(maxes), u_grad * maxes.max())
    return float(norm_thr), float(max_thr)


def run_trial(dtype_name: str, numel: int, num_elements: int, seed: int, counts: dict) -> None:
    """One gradient set; flips every bit class in sampled elements; adds detections to ``counts``."""
    u_grad = tolerance.UNIT_ROUNDOFF[dtype_name]
    grads = gradsim.rank_gradients(numel, WORLD_SIZE, seed=seed, dtype=gradsim.DTYPES[dtype_name])
    local = [core.fingerprint(g, with_digest=False) for g in grads]
    local_sketches = np.stack([f.sketch for f in local])  # (W, k)
    local_norms = np.array([f.norm for f in local])  # (W,)
    reduced = gradsim.ring_allreduce(grads)
    clean = core.fingerprint(reduced)
    norm_thr, max_thr = _stats_noise(grads, u_grad)
    rng = np.random.default_rng(seed)
    magnitude_order = torch.argsort(reduced.float().abs(), descending=True).numpy()
    populations = {
        "uniform": rng.choice(numel, size=num_elements, replace=False),
        "top 1%": rng.choice(magnitude_order[: numel // 100], size=num_elements, replace=False),
    }
    for population, indices in populations.items():
        for bit_class, bit in BITS[dtype_name].items():
            for index in indices:
                fp = core.fingerprint(gradsim.flip_bit(reduced, int(index), bit))
                residual = tolerance.allreduce_residual(local_sketches, fp.sketch)
                tol = tolerance.allreduce_tolerance(dtype_name, local_norms, fp.norm)
                nonfinite = fp.nonfinite != clean.nonfinite
                norm = not abs(fp.norm - clean.norm) <= norm_thr  # NaN/Inf norms count as moved
                max_abs = not abs(fp.max_abs - clean.max_abs) <= max_thr
                hits = {
                    "digest": fp.digest != clean.digest,
                    "sketch": not residual <= tol,
                    "stats": nonfinite or norm or max_abs,
                    "nonfinite": nonfinite,
                    "norm": norm,
                    "max_abs": max_abs,
                }
                row = counts[(population, dtype_name, bit_class)]
                row["n"] += 1
                for column in COLUMNS:
                    row[column] += bool(hits[column])


def render(counts: dict) -> str:
    """Markdown tables (one per element population) of detection rates in percent."""
    out = []
    for population in ("uniform", "top 1%"):
        out.append(f"\nElements: {population}\n")
        out.append("| dtype | bit flipped | flips | " + " | ".join(COLUMNS) + " |")
        out.append("| --- | --- | ---: |" + " ---: |" * len(COLUMNS))
        for (pop, dtype_name, bit_class), row in counts.items():
            if pop != population:
                continue
            bit = BITS[dtype_name][bit_class]
            rates = " | ".join(f"{100 * row[c] / row['n']:.0f}%" for c in COLUMNS)
            out.append(f"| {dtype_name} | {bit_class} (bit {bit}) | {row['n']} | {rates} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Run the measurement and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4, help="gradient sets per dtype")
    parser.add_argument("--elements", type=int, default=100, help="elements per set, bit class and population")
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    counts: dict = collections.defaultdict(lambda: collections.Counter())
    start = time.perf_counter()
    for dtype_name in BITS:
        for trial in range(args.trials):
            run_trial(dtype_name, args.numel, args.elements, args.seed * 1000 + trial, counts)
    print(
        f"# Single-bit flips in a W={WORLD_SIZE} all-reduced gradient: {args.trials} gradient sets of "
        f"{args.numel} elements per dtype, {args.elements} elements per set and bit class, seed {args.seed}, "
        f"KAPPA {tolerance.KAPPA}, {time.perf_counter() - start:.0f} s"
    )
    print(render(counts))


if __name__ == "__main__":
    main()
