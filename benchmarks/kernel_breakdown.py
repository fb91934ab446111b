"""Where the CPU fingerprint kernel's time goes: its parts on cache-resident data vs torch.sum from memory.

Runs the compiled kernel (``fingerprint/_numba_fingerprint.run_direct``) over a 256 KiB float32
tensor that stays in L2, many times, with parts switched off: all parts, no digest, one
projection instead of ``k``, one projection and no digest. Cache-resident data costs no memory
traffic, so these are the kernel's arithmetic alone, in ns per element (best of ``--repeat``).
Next to them, ``torch.sum`` over a 256 MB float32 tensor from memory (one thread), the figure
the design brief's goal compares with.

    python benchmarks/kernel_breakdown.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import cpu_kernel


def kernel_ns_per_element(module, x: np.ndarray, k: int, digest: bool, repeat: int, inner: int = 50) -> float:
    rows = x.shape[0]
    words = x.reshape(-1).view(np.int32)
    a, b = C.digest_word_weights(), C.digest_high_weights()
    c = C.digest_block_weights(rows).view(np.uint64)
    c2 = C.digest_block_weights(rows, high=True).view(np.uint64)
    beta = C.sketch_block_signs(rows, k).astype(np.float32)
    y, y64 = np.zeros((k, C.BLOCK_ELEMS), np.float32), np.zeros((k, C.BLOCK_ELEMS))
    q, q64, mx = np.zeros(C.BLOCK_ELEMS, np.float32), np.zeros(C.BLOCK_ELEMS), np.zeros(C.BLOCK_ELEMS, np.float32)
    lanes, pairs = np.zeros(2, np.uint64), np.zeros((cpu_kernel.TILE_ROWS, C.BLOCK_ELEMS), np.float32)
    blocks = rows if digest else 0
    args = (x, words, blocks, cpu_kernel.TILE_ROWS, 0, a, b, c, c2, beta, y, y64, q, q64, mx, lanes, pairs, x.size)
    module.run_direct(*args)  # compile / load
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            module.run_direct(*args)
        best = min(best, (time.perf_counter() - start) / (inner * x.size))
    return best * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    ok, reason = cpu_kernel.available()
    if not ok:
        parser.exit(2, f"error: the compiled CPU kernel is not available here: {reason}\n")
    module, _ = cpu_kernel._loops()
    torch.set_num_threads(1)
    x = np.random.default_rng(0).standard_normal((64, C.BLOCK_ELEMS)).astype(np.float32)  # 256 KiB: in L2
    rows = {
        "all parts (digest, k=8 sketch, stats)": kernel_ns_per_element(
            module, x, C.DEFAULT_SKETCH_K, True, args.repeat
        ),
        "no digest": kernel_ns_per_element(module, x, C.DEFAULT_SKETCH_K, False, args.repeat),
        "k=1, digest": kernel_ns_per_element(module, x, 1, True, args.repeat),
        "k=1, no digest (pairs, stats, one projection)": kernel_ns_per_element(module, x, 1, False, args.repeat),
    }
    big = torch.randn(64 << 20)  # 256 MB
    torch.sum(big)
    best = float("inf")
    for _ in range(max(3, args.repeat // 3)):
        start = time.perf_counter()
        torch.sum(big)
        best = min(best, time.perf_counter() - start)
    rows["torch.sum, 256 MB from memory"] = best / big.numel() * 1e9
    if args.json:
        print(json.dumps({name: round(v, 4) for name, v in rows.items()}, indent=2))
    else:
        print("| what (float32) | ns per element |\n| --- | ---: |")
        for name, value in rows.items():
            print(f"| {name} | {value:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
