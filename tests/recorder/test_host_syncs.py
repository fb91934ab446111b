"""Host syncs of the recorder: the comm hook resolves every bucket's fingerprints once per step.

Counting real device-to-host transfers means nothing on CPU, so ``resolve`` (the only way the
hook's pending fingerprints reach the host) is wrapped and its calls counted per step, in one
in-process gloo group of world size 1 with several DDP buckets. The values are held to the
synchronous :func:`fingerprint` of the same tensors taken at the same moment, and to the trace.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.fingerprint import core as fp_core
from sdc_forensics.fingerprint.core import combine
from sdc_forensics.statedict import weights_digest
from sdc_forensics.trace.reader import Trace
from tests.factories import num_threads

STEPS = 3


def _run(tmp_path, monkeypatch, *, microbatches: int = 2):
    from torch.nn.parallel import DistributedDataParallel

    from sdc_forensics.recorder import Recorder

    calls: list[tuple[int | None, str, int]] = []  # (step, caller, pending items)
    sync_values: list[list] = []  # per resolve call from the hook: the synchronous fingerprints of its items
    shadow: dict[int, object] = {}  # id(pending) -> synchronous fingerprint taken when it started
    real_async, real_resolve = fp_core.fingerprint_async, fp_core.resolve
    current = {"step": None}

    def counting_async(tensor, **kwargs):
        pending = real_async(tensor, **kwargs)
        shadow[id(pending)] = real_resolve([real_async(tensor, **kwargs)])[
            0
        ]  # same moment: before the in-place all-reduce
        return pending

    def counting_resolve(pending):
        caller = inspect.stack()[1].function
        calls.append((current["step"], caller, len(pending)))
        if caller == "fingerprints":
            sync_values.append([shadow[id(p)] for p in pending])
        return real_resolve(pending)

    monkeypatch.setattr(fp_core, "fingerprint_async", counting_async)
    monkeypatch.setattr(fp_core, "resolve", counting_resolve)

    with num_threads(1):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 1024),
                torch.nn.Tanh(),
                torch.nn.Linear(1024, 512),
                torch.nn.Tanh(),
                torch.nn.Linear(512, 4),
            )  # 2.4 MB of gradient: over DDP's 1 MB first bucket
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.5)  # then 0.5 MB buckets: several every step
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            results = []
            with Recorder(tmp_path / "trace", ddp, optimizer) as rec:
                for step in range(STEPS):
                    current["step"] = step
                    with rec.step(
                        step, microbatch_ids=list(range(step * microbatches, (step + 1) * microbatches))
                    ) as s:
                        for m in range(microbatches):
                            gen = torch.Generator().manual_seed(step * 10 + m)
                            x, y = s.input((torch.randn(8, 64, generator=gen), torch.randn(8, 4, generator=gen)))
                            if m < microbatches - 1:
                                with ddp.no_sync():
                                    loss = torch.nn.functional.mse_loss(ddp(x), y)
                                    loss.backward()
                            else:
                                loss = torch.nn.functional.mse_loss(ddp(x), y)
                                loss.backward()
                            s.loss(loss)
                        optimizer.step()
                        results.append((rec._state.local, rec._state.reduced, rec._state.weights))
                        optimizer.zero_grad()
                    results[-1] += (weights_digest(model.named_parameters()),)
        finally:
            dist.destroy_process_group()
    return calls, sync_values, results, tmp_path / "trace"


def test_the_hook_resolves_all_buckets_once_per_step_and_values_are_the_synchronous_ones(tmp_path, monkeypatch):
    calls, sync_values, results, trace_dir = _run(tmp_path, monkeypatch)
    from_hook = [(step, n) for step, caller, n in calls if caller == "fingerprints"]
    assert [step for step, _ in from_hook] == list(range(STEPS)), calls  # exactly one per step
    buckets = [len(values) // 2 for values in sync_values]
    assert [n for _, n in from_hook] == [2 * b for b in buckets]  # every bucket, local and reduced, in one call
    assert max(buckets) >= 2, buckets  # one bucket in step 0 (DDP's first layout), several once rebuilt
    trace = Trace.open(trace_dir)
    for step, ((local, reduced, weights, digest_now), values) in enumerate(zip(results, sync_values)):
        half = len(values) // 2
        expected_local, expected_reduced = combine(values[:half]), combine(values[half:])
        assert local.digest == expected_local.digest and reduced.digest == expected_reduced.digest
        np.testing.assert_array_equal(local.sketch, expected_local.sketch)
        np.testing.assert_array_equal(reduced.sketch, expected_reduced.sketch)
        assert local.norm == expected_local.norm and local.nonfinite == expected_local.nonfinite == 0
        assert weights[0] == digest_now and weights[2] == 0 and weights[1] > 0  # one resolve: the same digest
        row = next(trace.step_windows(start=step, stop=step)).records[0][0]
        assert int(row["local_digest"]) == local.digest % (1 << 64)
        assert int(row["reduced_digest"]) == reduced.digest % (1 << 64)
        assert int(row["weights_digest"]) == digest_now % (1 << 64)


def test_resolve_calls_per_step_are_the_documented_ones(tmp_path, monkeypatch):
    calls, _, _, _ = _run(tmp_path, monkeypatch, microbatches=3)
    for step in range(STEPS):
        callers = sorted(caller for s, caller, _ in calls if s == step)
        # the hook's (with the input digests, on a device) and at most one for the weights (digest,
        # norm, NaN/Inf in one pass: core.weights_summary, whose compiled CPU path has nothing pending)
        assert callers.count("fingerprints") == 1, (step, callers)
        assert set(callers) <= {"fingerprints", "weights_summary"} and len(callers) <= 2, (step, callers)


def test_losses_are_summed_as_before(tmp_path):
    from sdc_forensics.recorder.recorder import Recorder, _StepState

    state = _StepState(step=0, ids=None)
    losses = [
        torch.tensor(0.1, dtype=torch.float32),
        torch.tensor([0.3], dtype=torch.float32),
        torch.tensor(1e-8, dtype=torch.bfloat16),
    ]
    state.losses.extend(losses)
    assert Recorder._loss_value(state) == float(sum(float(loss) for loss in losses))
    state.losses.append(torch.tensor(2.5))
    assert Recorder._loss_value(state) == float(sum(float(loss) for loss in state.losses))
