"""The reduce-scatter check's one table (``fsdp_monitor.step_table`` / ``findings_of``), without processes.

Four ranks of an HSDP 2 x 2 job are simulated: each rank's chunk sketches, its reduce-scatter
output (the mean of its group's chunks for it) and its replica all-reduce output (the mean of the
replicas' outputs). Each rank's part of the table is built as the monitor builds it, the parts
are summed (what the world all-reduce does) and judged: a clean step has no finding, a wrong
output names its rank alone, a NaN input names its rank, and the vectorised judgement agrees
with the scalar ``sum_check`` row by row.
"""

from __future__ import annotations

import numpy as np
import pytest

from sdc_forensics.fingerprint import cpu_kernel
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checks import Check

K = 8
SHARDS = ((0, 1), (2, 3))
REPLICAS = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}


def _row(sketch: np.ndarray, norm: float, nonfinite: int = 0) -> list[float]:
    return [*sketch.tolist(), norm, float(nonfinite)]


def _step(seed: int = 0):
    """Per rank: its calls (one reduce-scatter, all-reduced) and their numbers."""
    rng = np.random.default_rng(seed)
    chunks = {r: [rng.standard_normal(K) for _ in range(2)] for r in range(4)}
    group_of = {r: g for g in SHARDS for r in g}
    outputs = {d: 0.5 * sum(chunks[r][group_of[d].index(d)] for r in group_of[d]) for d in range(4)}
    ar_outputs = {d: 0.5 * sum(outputs[p] for p in REPLICAS[d]) for d in range(4)}
    per_rank = {}
    for r in range(4):
        call = fm._Call(
            group=group_of[r], dtype="float32", scale=0.5, ar_scale=0.5, inputs=[], ar_group=REPLICAS[r], ar_inputs=(0,)
        )
        numbers = {
            "inputs": [_row(c, 4.0) for c in chunks[r]],
            "output": _row(outputs[r], 2.0),
            "ar_output": _row(ar_outputs[r], 2.0),
        }
        per_rank[r] = ([call], [numbers])
    return per_rank


def _findings(per_rank, *, order=(0, 1, 2, 3)):
    cols = fm._Columns(K, hsdp=True)
    total = sum(fm.step_table(*per_rank[r], cols, r, 4).numpy() for r in order)
    return fm.findings_of(total, 1, 4, cols, paired=True)


def test_a_clean_step_has_no_finding():
    assert _findings(_step()) == []


def test_a_wrong_reduce_scatter_output_names_its_rank_alone():
    per_rank = _step()
    per_rank[1][1][0]["output"][3] += 1e-3
    found = _findings(per_rank)
    assert [(f.check, f.rank) for f in found] == [(Check.REDUCE_SCATTER, 1)]
    assert (
        found[0].detail.startswith("its output differs from 0.5 x the sum of its inputs") and "(W=2)" in found[0].detail
    )


def test_a_wrong_replica_all_reduce_output_names_its_rank_alone():
    per_rank = _step()
    per_rank[2][1][0]["ar_output"][0] -= 1e-3
    found = _findings(per_rank)
    assert [(f.check, f.rank) for f in found] == [(Check.REPLICA_ALL_REDUCE, 2)]
    assert "(2 replicas)" in found[0].detail


def test_a_nan_input_names_its_rank_and_no_output_of_its_group():
    per_rank = _step()
    per_rank[3][1][0]["inputs"][0][K + 1] = 1.0
    per_rank[3][1][0]["inputs"][0][0] = float("nan")
    found = _findings(per_rank)
    assert [(f.check, f.rank) for f in found] == [(Check.NONFINITE_BEFORE, 3)]


def test_every_rank_reaches_the_same_findings_whatever_order_the_parts_are_added_in():
    per_rank = _step(seed=3)
    per_rank[0][1][0]["output"][1] *= 1.01
    lists = [_findings(per_rank, order=order) for order in ((0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2))]
    assert lists[0] == lists[1] == lists[2] and [f.rank for f in lists[0]] == [0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_vectorised_judgement_is_sum_check_row_by_row(dtype):
    rng = np.random.default_rng(7)
    rows = 400
    total = np.abs(rng.standard_normal((rows, K + 3)))
    total[:, :K] = rng.standard_normal((rows, K))
    scale = rng.choice([0.5, 0.25, 1.0], rows)
    out = np.empty((rows, K + 2))
    # near the tolerance: residuals from 0 to a few tolerances
    out[:, :K] = scale[:, None] * total[:, :K] + rng.standard_normal((rows, K)) * 10.0 ** rng.uniform(-9, -1, (rows, 1))
    out[:, K] = np.abs(rng.standard_normal(rows))
    out[:, K + 1] = 0
    count = rng.integers(2, 9, rows)
    failing = fm._failing(total, count, scale, out, [dtype] * rows, K)
    scalar = [
        bool(fm.sum_check(total[i], int(count[i]), float(scale[i]), out[i, :K], out[i, K], dtype, K))
        for i in range(rows)
    ]
    assert failing.tolist() == scalar
    assert 0 < sum(scalar) < rows


@pytest.mark.skipif(not cpu_kernel.available()[0], reason="the compiled CPU kernel is off or unavailable")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_table_from_one_array_of_chunk_rows_is_the_table_from_each_chunks_fingerprint(dtype):
    """``chunk_sketches`` on the CPU kernel: one ``(W, k + 2)`` array instead of ``W`` pending
    fingerprints; the monitor's numbers and its part of the table are the same bits either way."""
    import torch

    from sdc_forensics.fingerprint import constants as C
    from sdc_forensics.fingerprint import core

    world, seed = 16, C.DEFAULT_SEED
    grads = [
        torch.randn(world * 300, generator=torch.Generator().manual_seed(i)).to(getattr(torch, dtype)) for i in range(3)
    ]
    grads[1][5] = float("nan")
    tables = []
    for as_rows in (True, False):
        calls = []
        for grad in grads:
            call = fm._Call(group=tuple(range(world)), dtype=dtype, scale=1 / world, ar_scale=1.0, inputs=[])
            if as_rows:
                call.inputs = fm.chunk_sketches(grad, world, K, seed)
                assert isinstance(call.inputs, np.ndarray), "the CPU kernel takes the chunks in one call"
            else:
                call.inputs = core.fingerprints_async(grad.chunk(world), k=K, seed=seed, with_digest=False)
            call.output = core.fingerprint_async(grad[:300], k=K, seed=seed, with_digest=False)
            calls.append(call)
        monitor = fm.FsdpMonitor(sketch_k=K, seed=seed)
        tables.append(fm.step_table(calls, monitor._numbers(calls), fm._Columns(K, hsdp=False), 3, world).numpy())
    assert tables[0].view(np.int64).tolist() == tables[1].view(np.int64).tolist()
    cols = fm._Columns(K, hsdp=False)
    own = tables[0][1:].reshape(3, world, cols.width)[:, 3]
    assert own[1, cols.OWN_NAN] == 1 and own[0, cols.OWN_NAN] == 0
