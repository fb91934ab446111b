"""Host synchronisations per recorded step on a GPU (issue 37), counted by CUDA's sync debug mode.

One process, one GPU (NCCL, world size 1), a DDP transformer-sized MLP with AdamW; each step
after the warm-up runs under ``torch.cuda.set_sync_debug_mode("warn")`` and every warning it
raises is a host synchronisation. The recorder's design (docs/recorder.md, "Deferred checks";
docs/benchmarks.md, the cost model) says what a step may cost:

* at once (the default): the step's fingerprints and input digests in one transfer, the summed
  loss, the words table, the weights digest and the vote table: at most 5;
* ``deferred_checks=True``: the two tables leave the step (resolved behind an event at the next
  step): at most 3.

The bare step (no recorder) is counted alike and subtracted. Skipped without CUDA (CPU CI);
``benchmarks/gpu_check.sh`` runs it (``pytest -m cuda``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 6


def _syncs(step_fn) -> int:
    """Host synchronisations ``step_fn()`` makes (warnings of the sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("deferred, most", [(False, 5), (True, 3)], ids=["at-once", "deferred"])
def test_a_recorded_step_syncs_the_host_only_where_the_design_says(tmp_path, deferred, most):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sdc_forensics.recorder import Recorder, RecorderOptions
    from tests.factories import free_port

    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        torch.manual_seed(0)
        device = torch.device("cuda", 0)

        def build():
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
            ddp = DistributedDataParallel(model.to(device), device_ids=[0])
            return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)

        bare, bare_opt = build()
        recorded, rec_opt = build()
        rec = Recorder(tmp_path / "trace", recorded, rec_opt, options=RecorderOptions(deferred_checks=deferred))
        x = torch.randn(64, 256, device=device)

        def bare_step():
            loss = bare(x).square().mean()
            loss.backward()
            bare_opt.step()
            bare_opt.zero_grad()

        def recorded_step(step):
            def run():
                with rec.step(step, microbatch_ids=[step]) as handle:
                    loss = recorded(handle.input(x)).square().mean()
                    handle.loss(loss)
                    loss.backward()
                    rec_opt.step()
                    rec_opt.zero_grad()

            return run

        counts = []
        for step in range(STEPS):
            base = _syncs(bare_step)
            found = _syncs(recorded_step(step))
            if step >= 2:
                counts.append(found - base)
        rec.close()
        print(
            f"host syncs per recorded step beyond the bare step's ({'deferred' if deferred else 'at once'}): {counts}"
        )
        assert max(counts) <= most, counts
    finally:
        dist.destroy_process_group()
