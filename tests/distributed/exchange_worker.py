"""One process of ``test_exchange.py``'s 3-process gloo runs (started by torchrun): exercises
``replay.distributed`` on its own, with a stand-in replayer, and writes one JSON file
(``OUT_DIR/RANK.json``). Arguments: ``MODE TIMEOUT_S OUT_DIR``.

``MODE`` (argv[1], parts joined by ``+``): ``exchange`` (5 original ranks over 3 processes, mixed dtypes and sizes, every
result compared bit for bit with a local recomputation), ``recompute`` (the second recomputation of
original rank 4, owned by process 1, is computed by process 2 alone and arrives bit for bit), ``placement`` (a suspect GPU's node is this
host: every process refuses alike; ``--force-device`` passes).
"""

from __future__ import annotations

import json
import socket
import sys
import types
from pathlib import Path

import torch

from sdc_forensics.replay import distributed

WORLD = 5  # original ranks: 2 processes own 2, one owns 1


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [
        torch.randn(37, generator=gen),
        torch.randn(5, generator=gen).to(torch.bfloat16),
        torch.randn(1, generator=gen).double(),
    ]


class _Step:
    def __init__(self, rank: int, step: int) -> None:
        self.buckets = _grads(rank, step)
        self.loss = 0.1 * rank + step / 3.0
        self.digest = (0xF0F0F0F0F0F0F0F0 + rank) & (2**64 - 1)  # above 2**63: the uint64 round trip
        self.input_digest = 12345 + rank


class _Replayer:
    world_size = WORLD
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.step, self.calls = 0, []

    def local_step(self, model, record, layout, slot=None):
        self.calls.append(int(record))
        return _Step(int(record), self.step)

    def fp_of(self, buckets):
        return ("fp", sum(float(b.double().sum()) for b in buckets))


def main() -> None:
    mode = sys.argv[1]
    group = distributed.start("cpu", timeout_s=float(sys.argv[2]))
    out = {"rank": group.rank, "size": group.size, "backend": group.backend}
    replayer = _Replayer()
    try:
        if "exchange" in mode:
            ok = True
            for step in range(3):
                replayer.step = step
                ranks = distributed.local_steps(replayer, None, list(range(WORLD)), None, step)
                for r, rs in enumerate(ranks):
                    want = _Step(r, step)
                    ok &= all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(rs.buckets, want.buckets))
                    ok &= (rs.loss, rs.digest, rs.input_digest) == (want.loss, want.digest, want.input_digest)
                    if isinstance(rs, distributed.SharedRankStep):  # received: its fingerprint is computed here
                        ok &= rs.fp == replayer.fp_of(want.buckets)
            out.update(bitwise=bool(ok), computed=sorted(set(replayer.calls)))
        if "recompute" in mode:
            replayer.step, replayer.calls = 7, []
            second = distributed.recompute(replayer, None, 4, None, 4, _Step(4, 0))  # the template: dtypes and sizes
            want = _Step(4, 7)
            same = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(second.buckets, want.buckets))
            same &= (second.loss, second.digest, second.input_digest) == (want.loss, want.digest, want.input_digest)
            out.update(recomputed_bitwise=bool(same), recomputed_here=replayer.calls == [4])
        if "placement" in mode:
            trace = types.SimpleNamespace(
                manifest=types.SimpleNamespace(
                    identity=lambda rank: types.SimpleNamespace(host=socket.gethostname(), gpu_uuid="GPU-bad")
                )
            )
            distributed.check_placement(torch.device("cpu"), trace, {"GPU-bad": 2}, force=True)
            out["forced"] = "passed"
            try:
                distributed.check_placement(torch.device("cpu"), trace, {"GPU-bad": 2}, force=False)
                out["refused"] = None
            except distributed.PlacementRefused as exc:
                out["refused"] = str(exc)
    finally:
        (Path(sys.argv[3]) / f"{group.rank}.json").write_text(json.dumps(out))  # one pipe would interleave them
        distributed.finish(completed=True)


if __name__ == "__main__":
    main()
