"""The torchtitan adapter (``integrations/torchtitan.py``): refusals in one line, and the online checks
run before each optimizer step of a torchtitan-shaped trainer around a real ``fully_shard`` job
(4 gloo processes). torchtitan itself needs a PyTorch nightly to train and is not installed here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sdc_forensics.errors import UsageError
from sdc_forensics.integrations import torchtitan as sdc
from tests.factories import gloo_job

WORLD = 4


def _trainer(**overrides) -> SimpleNamespace:
    """The attributes the adapter reads from torchtitan 0.3.0's ``Trainer``."""
    fields = dict(
        config=SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=False)), device=torch.device("cpu"),
        model_parts=[torch.nn.Linear(2, 2)], parallel_dims=SimpleNamespace(pp_enabled=False),
        optimizers=SimpleNamespace(step=lambda: None), step=0,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("overrides, says", [
    ({"device": torch.device("cuda")}, "--training.disable_cuda_graphs"),
    ({"model_parts": [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]}, "pipeline parallelism"),
    ({"parallel_dims": SimpleNamespace(pp_enabled=True)}, "pipeline parallelism"),
    ({"model_parts": []}, "no model_parts"),
    ({"optimizers": object()}, "optimizers.step"),
])
def test_what_the_checks_cannot_see_is_refused_in_one_line(overrides, says):
    with pytest.raises(UsageError) as refused:
        sdc.watch(_trainer(**overrides))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_that_is_not_fully_sharded_is_refused():
    with pytest.raises(UsageError, match="fully_shard"):
        sdc.watch(_trainer())  # a plain Linear: torchtitan's replicate() or no data parallelism


def _job(rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from sdc_forensics.errors import SdcAlarm

    found = {}
    for policy in ("return", "raise"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
        fully_shard(model[0])
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = _trainer(model_parts=[model], optimizers=optimizer)

        def inject(location, call, tensor, trainer=trainer):
            if trainer.step == 2 and rank == 1 and location == "reduce-scatter-output" and call == 0:
                with torch.no_grad():
                    tensor.reshape(-1).view(torch.int32)[0] ^= 1 << 29

        sdc.watch(trainer, policy=policy, inject=inject)
        gen = torch.Generator().manual_seed(rank)
        alarm = None
        for step in range(1, 4):  # torchtitan's loop: step += 1, then train_step
            trainer.step = step
            trainer.optimizers.zero_grad()
            model(torch.randn(4, 16, generator=gen)).square().mean().backward()
            try:
                trainer.optimizers.step()
            except SdcAlarm as raised:
                alarm = [raised.step, raised.rank, raised.check]
                break
        found[policy] = {"results": [[step, [list(r.suspects) for r in results]] for step, results in trainer.sdc_results],
                         "alarm": alarm}
    return found


def test_the_checks_run_before_each_optimizer_step_and_name_the_faulty_rank(tmp_path):
    ranks = gloo_job(_job, WORLD, tmp_path)
    assert all(r == ranks[0] for r in ranks)
    returned = ranks[0]["return"]
    assert returned["alarm"] is None
    assert returned["results"] == [[1, [[], []]], [2, [[1], []]], [3, [[], []]]]  # step check, then the weights check
    assert ranks[0]["raise"]["alarm"] == [2, 1, "reduce-scatter"]
