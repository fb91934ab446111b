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


def _recorded_job(rank: int, root: str, inject: tuple, resume: int = 0, last: int = 6) -> str:
    """torchtitan's loop (``step += 1``, then ``train_step``) around the sharded demo job, recorded
    with ``record``: two microbatches per step accumulated without sync, IDs from the step.
    ``resume``: load ``ckpt/step-<resume>`` first, as torchtitan's train() loads its checkpoint,
    and run steps ``resume .. last``."""
    from pathlib import Path

    from sdc_forensics.demo import sharded
    from sdc_forensics.recorder import RecorderOptions

    model = sharded.shard(sharded.build_model())
    optimizer = sharded.make_optimizer(model)
    trainer = _trainer(model_parts=[model], optimizers=optimizer)
    if resume:
        sharded.load_dcp(Path(root, "ckpt", f"step-{resume:08d}"), model, optimizer)

    def ids(trainer) -> list[int]:
        first = ((trainer.step - 1) * WORLD + rank) * 2
        return [first, first + 1]

    def train_step(trainer=trainer):
        for m, mb in enumerate(ids(trainer)):
            model.set_requires_gradient_sync(m == 1)
            sharded.loss_of(model, sharded.microbatch(mb)).backward()
        trainer.optimizers.step()
        trainer.optimizers.zero_grad()

    trainer.train_step = train_step
    with sdc.record(trainer, Path(root, "trace"), microbatch_ids=ids, recipe=sharded.REFERENCE, checkpoint_every=3,
                    checkpoint_dir=Path(root, "ckpt"), inject=inject, options=RecorderOptions(reduction="ordered")):
        for step in range(resume or 1, last + 1):
            trainer.step = step
            trainer.train_step()
    return "ok" if trainer.train_step is train_step else "closing did not give the trainer its train_step back"


@pytest.mark.parametrize("inject, expected", [((), None), (("local-gradient:step=3:rank=1:bit=20",), (3, 1))])
def test_a_recorded_torchtitan_loop_certifies_clean_and_names_a_fault(tmp_path, inject, expected):
    import json

    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    assert gloo_job(_recorded_job, WORLD, tmp_path / "results", str(tmp_path), inject) == ["ok"] * WORLD
    result = CliRunner().invoke(cli, ["certify" if expected is None else "bisect", str(tmp_path / "trace"), "--json"])
    doc = json.loads(result.stdout)
    if expected is None:
        assert result.exit_code == 0 and [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(1, "clean"), (4, "clean")], doc
    else:
        assert result.exit_code == 1 and doc["first_divergent_step"] == expected[0], doc
        assert [s["rank"] for s in doc["suspects"]] == [expected[1]], doc["suspects"]
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "trace"), "--json"])
    assert json.loads(result.stdout)["framework"]["name"] == "torchtitan"


def test_recording_without_a_train_step_or_a_checkpoint_directory_is_refused():
    with pytest.raises(UsageError, match="train_step"):
        sdc.record(_trainer(optimizers=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)), "unused")
    trainer = _trainer(optimizers=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), train_step=lambda: None)
    with pytest.raises(UsageError, match="checkpoint_dir"):
        sdc.record(trainer, "unused", checkpoint_every=5)


@pytest.mark.heavy  # two 4-process runs and a replay
def test_a_resumed_torchtitan_loop_starts_its_attempt_at_its_step_and_writes_over_no_checkpoint(tmp_path):
    """Issue 40: attempt 0 (steps 1..6, a flip at step 5, checkpoints 1 and 4); attempt 1 loads
    checkpoint 4 and runs steps 4..7. Its first step's checkpoint, step-00000004, exists: it goes
    to step-00000004-v1, attempt 0's files stay byte for byte, and attempt 1's checkpoint 7 certifies."""
    import hashlib
    import json

    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    def hashes():
        ckpt = tmp_path / "ckpt"
        return {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.rglob("*")) if p.is_file()}

    inject = ("local-gradient:step=5:rank=1:bit=20",)
    assert gloo_job(_recorded_job, WORLD, tmp_path / "results0", str(tmp_path), inject) == ["ok"] * WORLD
    before = hashes()
    assert gloo_job(_recorded_job, WORLD, tmp_path / "results1", str(tmp_path), (), 4, 7) == ["ok"] * WORLD
    after = hashes()
    assert {k: after[k] for k in before} == before
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000001", "step-00000004", "step-00000004-v1",
                                                                     "step-00000007"]
    doc = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "trace"), "--json"]).stdout)
    assert [(a["attempt"], a["start_step"]) for a in doc["attempts"]] == [(0, 1), (1, 4)]
    result = CliRunner().invoke(cli, ["bisect", str(tmp_path / "trace"), "--json"])
    doc = json.loads(result.stdout)
    statuses = {(c["step"], c["path"].rsplit("/", 1)[-1]): c["status"] for c in doc["checkpoints"]}
    assert statuses.get((7, "step-00000007")) == "clean", (statuses, result.stderr)
