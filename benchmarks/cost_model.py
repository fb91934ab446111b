"""The recorder's cost per step as a model: bytes it reads, collectives and their sizes, options.

For a DDP job of ``N`` parameters (gradients and weights ``--bytes-per-elem`` each) on ``W``
ranks, per rank and step, with the recorder's defaults (``docs/benchmarks.md``, "Cost model"):

* **reads**: the local gradient once (comm hook, before the all-reduce), the reduced gradient
  once (after it), the updated weights once (digest, norm, NaN/Inf count), and the step's inputs:
  ``2 G + P + I`` bytes, ``G = P = N * bytes``. Each read is one pass of the fingerprint kernel,
  which costs ``r`` times a ``torch.sum`` pass of the same bytes (``--kernel-ratio``, or
  ``--measure`` to time it here on ``N`` float32 elements, one thread); the recorder's compute is
  then ``(2 G + P) * r`` bytes of ``torch.sum`` traffic, independent of ``W``.
* **collectives**: one ``all_gather`` of ``2k + 6`` int64 words per rank before the update (the
  failure exchange and the checks' numbers), one of 1 word after it on voting steps (every
  ``--weights-every`` steps); each rank receives ``W`` times its own words. A ring all_gather
  takes ``W - 1`` hops: at a per-hop latency ``--hop-us`` (an assumption, printed as such:
  NCCL's is a few microseconds on NVLink or InfiniBand), ``(W - 1) * hop`` per gather while it
  blocks the step; ``deferred_checks`` takes both off the step's path.
* **checks**: numpy over the ``(W, 2k + 6)`` table and the ``W`` digests: ``O(W k)``.
* **trace**: one STEP record per rank and step (216 bytes at ``k = 8``).
* **audits**: ``audit_every = A`` adds one forward and backward of a rank's microbatches every A
  steps: about ``1 / A`` of a step.

``--layout fsdp`` or ``hsdp`` (``--reduce-scatters C`` per step, ``--microbatches M``): the reads
are the local gradient twice (the reduce-scatter check's chunk sketches and the trace's runs),
the reduced shard once, the weight shard twice (at rest and updated) and the gathered parameters
once per microbatch's forward: ``2 G + G / W + 2 P / W + M P``; the collectives are the words
gather (``2k + 6`` words and 2 of the check's; no vote where no shard has a replica) and one
``all_reduce`` of the check's table, ``1 + C W w`` float64 with ``w = 2k + 12`` columns (HSDP
``4k + 21``, the replica all-reduce's too); a ring all-reduce sends and receives about twice
the table per rank. ``deferred_checks`` takes them off the step's path.

    python benchmarks/cost_model.py --params 834304 --world 2 64 1024 [--measure] [--step-ms 100]
    python benchmarks/cost_model.py --params 2450000 --layout hsdp --reduce-scatters 40 --world 2 64 1024 --kernel-ratio 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

WORD_BYTES = 8


def measure_kernel_ratio(numel: int, runs: int = 7) -> float:
    """Median over alternating runs of ``fingerprint(x) / torch.sum(x)`` time, float32, one thread."""
    import torch

    from sdc_forensics.fingerprint.core import fingerprint

    torch.set_num_threads(1)
    x = torch.randn(max(numel, 1 << 16))
    fingerprint(x)
    ratios = []
    for _ in range(runs):
        start = time.perf_counter()
        x.sum()
        middle = time.perf_counter()
        fingerprint(x)
        end = time.perf_counter()
        ratios.append((end - middle) / max(middle - start, 1e-9))
    return statistics.median(ratios)


def table_floats(layout: str, k: int, calls: int, world: int) -> int:
    """The sharded check's table (``fsdp_monitor._Columns``): float64 numbers all-reduced per step."""
    width = 4 * k + 21 if layout == "hsdp" else 2 * k + 12
    return 1 + calls * world * width


def model(args: argparse.Namespace, world: int, ratio: float) -> dict:
    grad_bytes = weight_bytes = args.params * args.bytes_per_elem
    sharded = args.layout != "ddp"
    if sharded:
        read = 2 * grad_bytes + (grad_bytes + 2 * weight_bytes) / world + args.microbatches * weight_bytes
        passes = read
    else:
        read = 2 * grad_bytes + weight_bytes + args.input_bytes
        passes = 2 * grad_bytes + weight_bytes
    words = 2 * args.sketch_k + 6 + (2 if sharded else 0)
    votes = args.layout != "fsdp" and args.weights_every
    gathers_per_step = 1 + (1 / args.weights_every if votes else 0)
    blocking_us = gathers_per_step * (world - 1) * args.hop_us
    row = {
        "world": world,
        "read_bytes_per_rank_step": read,
        "read_as_multiple_of_grad_plus_weights": round(read / (grad_bytes + weight_bytes), 3),
        "kernel_traffic_in_sum_passes_of_grad_plus_weights": round(passes * ratio / (grad_bytes + weight_bytes), 2),
        "words_gather_bytes_sent_per_rank": words * WORD_BYTES,
        "words_gather_bytes_received_per_rank": world * words * WORD_BYTES,
        "vote_gather_bytes_received_per_rank": world * WORD_BYTES,
        "gathers_per_step": round(gathers_per_step, 3),
        "blocking_gather_latency_us_if_not_deferred": round(blocking_us, 1),
        "trace_bytes_per_step_all_ranks": world * args.record_bytes,
        "audit_fraction_of_a_step": round(1 / args.audit_every, 4) if args.audit_every else 0.0,
    }
    if sharded:
        table = table_floats(args.layout, args.sketch_k, args.reduce_scatters, world) * WORD_BYTES
        row["check_table_all_reduce_bytes"] = table
        row["check_table_ring_bytes_sent_per_rank"] = round(2 * table * (world - 1) / world)
    if args.step_ms:
        row["blocking_gathers_pct_of_step"] = round(100 * blocking_us / (1000 * args.step_ms), 3)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, required=True, help="parameters N (whole model: DDP replicas)")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 64, 1024])
    parser.add_argument("--layout", choices=("ddp", "fsdp", "hsdp"), default="ddp")
    parser.add_argument("--reduce-scatters", type=int, default=1, help="sharded: reduce-scatter calls per step")
    parser.add_argument("--microbatches", type=int, default=1, help="sharded: forwards per step (gathered digests)")
    parser.add_argument("--bytes-per-elem", type=int, default=4, help="gradient and weight bytes per element")
    parser.add_argument("--input-bytes", type=int, default=0, help="bytes of the step's inputs per rank")
    parser.add_argument("--sketch-k", type=int, default=8)
    parser.add_argument("--weights-every", type=int, default=1)
    parser.add_argument("--audit-every", type=int, default=0)
    parser.add_argument("--record-bytes", type=int, default=216, help="STEP record size (216 at k = 8)")
    parser.add_argument("--hop-us", type=float, default=5.0, help="ASSUMED latency per ring hop, microseconds")
    parser.add_argument("--step-ms", type=float, default=0.0, help="a step's time, for the gathers' share")
    parser.add_argument(
        "--kernel-ratio", type=float, default=None, help="fingerprint / torch.sum time (default: --measure)"
    )
    parser.add_argument("--measure", action="store_true", help="time the kernel ratio here on N float32 elements")
    args = parser.parse_args(argv)
    if args.kernel_ratio is None and not args.measure:
        print("cost_model.py: give --kernel-ratio R or --measure", file=sys.stderr)
        raise SystemExit(2)
    ratio = measure_kernel_ratio(args.params) if args.measure else args.kernel_ratio
    doc = {
        "kernel_ratio": round(ratio, 2),
        "kernel_ratio_source": "measured here" if args.measure else "given",
        "hop_us_assumed": args.hop_us,
        "rows": [model(args, world, ratio) for world in args.world],
    }
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
