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
        config=SimpleNamespace(training=SimpleNamespace(disable_cuda_graphs=False)),
        device=torch.device("cpu"),
        model_parts=[torch.nn.Linear(2, 2)],
        parallel_dims=SimpleNamespace(pp_enabled=False),
        optimizers=SimpleNamespace(step=lambda: None),
        step=0,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"device": torch.device("cuda")}, "--training.disable_cuda_graphs"),
        ({"model_parts": [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]}, "pipeline parallelism"),
        ({"parallel_dims": SimpleNamespace(pp_enabled=True)}, "pipeline parallelism"),
        ({"model_parts": []}, "no model_parts"),
        ({"optimizers": object()}, "optimizers.step"),
    ],
)
def test_what_the_checks_cannot_see_is_refused_in_one_line(overrides, says):
    with pytest.raises(UsageError) as refused:
        sdc.watch(_trainer(**overrides))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_that_is_not_fully_sharded_is_refused():
    with pytest.raises(UsageError, match="fully_shard"):
        sdc.watch(_trainer())  # a plain Linear: torchtitan's replicate() or no data parallelism


def test_a_compiled_model_part_is_refused_in_one_line_by_watch_and_record():
    """Issue 40: torchtitan's --compile.enable compiles the blocks of the model part: refused before
    anything is wrapped (the hooks and the replay need eager modules), in one line."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1] = torch.compile(model[1])  # a compiled submodule: its state dict keys gain "_orig_mod."
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for attach in (
        lambda t: sdc.watch(t),
        lambda t: sdc.record(t, "unused", checkpoint_every=3, checkpoint_dir="unused"),
    ):
        trainer = _trainer(model_parts=[model], optimizers=optimizer, train_step=lambda: None)
        with pytest.raises(UsageError) as refused:
            attach(trainer)
        assert "torch.compile wraps '1'" in str(refused.value) and "\n" not in str(refused.value)
        assert (
            trainer.train_step is not None
            and not hasattr(trainer, "sdc_results")
            and not hasattr(trainer, "sdc_recorder")
        )


def _titan_config(dump_folder, *, enable=True, keep_latest_k=10, folder="checkpoint"):
    """torchtitan's ``config.training``, ``config.job.dump_folder`` and ``config.checkpoint`` (enable, folder, keep_latest_k)."""
    return SimpleNamespace(
        training=SimpleNamespace(disable_cuda_graphs=True),
        job=SimpleNamespace(dump_folder=str(dump_folder)),
        checkpoint=SimpleNamespace(enable=enable, folder=folder, keep_latest_k=keep_latest_k),
    )


@pytest.mark.parametrize(
    "checkpoint_dir, config, said",
    [
        ("outputs/checkpoint", {}, True),  # torchtitan purges its folder: the recorder's step-N entries too
        ("forensic-ckpt", {}, False),  # a folder of its own: nothing rotates it
        ("outputs/checkpoint", {"keep_latest_k": 0}, False),  # torchtitan keeps every checkpoint
        ("outputs/checkpoint", {"enable": False}, False),  # torchtitan writes no checkpoint
    ],
)
def test_keep_latest_k_purging_the_forensic_checkpoints_is_said_at_attach(
    tmp_path, monkeypatch, caplog, checkpoint_dir, config, said
):
    """Issue 40: torchtitan's checkpoint.keep_latest_k deletes all but the latest k ``step-N`` entries of
    its checkpoint folder; record's checkpoints there (``step-N`` too) would go: said on rank 0, one line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    trainer = _trainer(
        config=_titan_config("outputs", **config),
        optimizers=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
        train_step=lambda: None,
    )
    with caplog.at_level("WARNING"):
        sdc.record(trainer, "trace", checkpoint_every=3, checkpoint_dir=tmp_path / checkpoint_dir)
    lines = [r.getMessage() for r in caplog.records if "deletes early checkpoints" in r.getMessage()]
    if said:
        (line,) = lines
        assert (
            line.startswith("sdc-forensics: torchtitan's checkpoint.keep_latest_k=10 in outputs/checkpoint")
            and "certify --follow" in line
        )
    else:
        assert lines == []


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
        found[policy] = {
            "results": [[step, [list(r.suspects) for r in results]] for step, results in trainer.sdc_results],
            "alarm": alarm,
        }
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
    with sdc.record(
        trainer,
        Path(root, "trace"),
        microbatch_ids=ids,
        recipe=sharded.REFERENCE,
        checkpoint_every=3,
        checkpoint_dir=Path(root, "ckpt"),
        inject=inject,
        options=RecorderOptions(reduction="ordered"),
    ):
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
        assert result.exit_code == 0 and [(c["step"], c["status"]) for c in doc["checkpoints"]] == [
            (1, "clean"),
            (4, "clean"),
        ], doc
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


def test_recording_a_pipeline_trainer_without_its_schedule_or_with_checkpoints_it_cannot_key_is_refused():
    """Issue 36: record passes trainer.pp_schedule to the recorder; a pipeline trainer without one is
    refused in one line, and so are forensic checkpoints of several model parts whose optimizer has
    no name-keyed state_dict of its own (torchtitan's OptimizersContainer has one)."""
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=0.1)
    cases = [
        (dict(parallel_dims=SimpleNamespace(pp_enabled=True)), {}, "without trainer.pp_schedule"),
        (
            dict(model_parts=parts, pp_schedule=object()),
            dict(checkpoint_every=3, checkpoint_dir="unused"),
            "OptimizersContainer",
        ),
    ]
    for overrides, kwargs, says in cases:
        trainer = _trainer(**{"optimizers": optimizer, "train_step": lambda: None, **overrides})
        with pytest.raises(UsageError) as refused:
            sdc.record(trainer, "unused", **kwargs)
        assert says in str(refused.value) and "\n" not in str(refused.value), refused.value
        assert not hasattr(trainer, "sdc_recorder")


@pytest.mark.heavy  # two 4-process runs and a replay
def test_a_resumed_torchtitan_loop_starts_its_attempt_at_its_step_and_writes_over_no_checkpoint(tmp_path):
    """Issue 40: attempt 0 (steps 1..6, a flip at step 5, checkpoints 1 and 4); attempt 1 loads
    checkpoint 4 and runs steps 4..7. Its first step's checkpoint, step-00000004, exists: it goes
    to step-00000004-v1, attempt 0's files stay byte for byte, and attempt 1's checkpoint 7 certifies.
    bisect still reports attempt 0's fault (rank 1 at step 5, with its attempt: corruption)."""
    import hashlib
    import json

    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    def hashes():
        ckpt = tmp_path / "ckpt"
        return {
            str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt.rglob("*"))
            if p.is_file()
        }

    inject = ("local-gradient:step=5:rank=1:bit=20",)
    assert gloo_job(_recorded_job, WORLD, tmp_path / "results0", str(tmp_path), inject) == ["ok"] * WORLD
    before = hashes()
    assert gloo_job(_recorded_job, WORLD, tmp_path / "results1", str(tmp_path), (), 4, 7) == ["ok"] * WORLD
    after = hashes()
    assert {k: after[k] for k in before} == before
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step-00000001",
        "step-00000004",
        "step-00000004-v1",
        "step-00000007",
    ]
    doc = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "trace"), "--json"]).stdout)
    assert [(a["attempt"], a["start_step"]) for a in doc["attempts"]] == [(0, 1), (1, 4)]
    result = CliRunner().invoke(cli, ["bisect", str(tmp_path / "trace"), "--json"])
    doc = json.loads(result.stdout)
    statuses = {(c["step"], c["path"].rsplit("/", 1)[-1]): c["status"] for c in doc["checkpoints"]}
    assert statuses.get((7, "step-00000007")) == "clean", (statuses, result.stderr)
    # the first attempt's fault, judged on its own records: its rank, its attempt, its step
    assert (result.exit_code, doc["verdict"], doc["first_divergent_step"]) == (1, "corruption", None), result.stderr
    assert [(s["rank"], s.get("attempt"), s["steps"]) for s in doc["suspects"]] == [(1, 0, [5])], doc["suspects"]


def _stopped_job(rank: int, root: str, how: str) -> dict:
    """torchtitan's ``train()`` (its loop: ``step += 1``, then ``train_step``) around the sharded demo
    job, recorded with ``record`` and no ``with`` block, stopped inside step 3 on every rank:
    ``how="interrupt"``, KeyboardInterrupt after the step's first backward (Ctrl+C); ``how="alarm"``,
    the alarm a flip of rank 1's reduce-scatter output raises under policy ``raise``."""
    from pathlib import Path

    import torch.distributed as dist

    from sdc_forensics.demo import sharded
    from sdc_forensics.recorder import RecorderOptions

    model = sharded.shard(sharded.build_model())
    trainer = _trainer(model_parts=[model], optimizers=sharded.make_optimizer(model))
    world = dist.get_world_size()

    def ids(trainer) -> list[int]:
        first = ((trainer.step - 1) * world + rank) * 2
        return [first, first + 1]

    def train_step(trainer=trainer):
        for m, mb in enumerate(ids(trainer)):
            model.set_requires_gradient_sync(m == 1)
            sharded.loss_of(model, sharded.microbatch(mb)).backward()
            if how == "interrupt" and trainer.step == 3:
                raise KeyboardInterrupt
        trainer.optimizers.step()
        trainer.optimizers.zero_grad()

    def train(trainer=trainer):
        for step in range(1, 7):
            trainer.step = step
            trainer.train_step()

    trainer.train_step, trainer.train = train_step, train
    inject = ("reduce-scatter-output:step=3:rank=1:bit=29",) if how == "alarm" else ()
    sdc.record(
        trainer,
        Path(root, "trace"),
        microbatch_ids=ids,
        recipe=sharded.REFERENCE,
        checkpoint_every=3,
        checkpoint_dir=Path(root, "ckpt"),
        inject=inject,
        options=RecorderOptions(reduction="ordered", policy="raise"),
    )
    try:
        trainer.train()
    except BaseException as exc:  # noqa: BLE001 - what train() raised, for the test to check
        return {"raised": type(exc).__name__, "train_step given back": trainer.train_step is train_step}
    return {"raised": None}


@pytest.mark.heavy  # two 2-process runs, about 8 s each
@pytest.mark.parametrize("how, raised, last_step", [("interrupt", "KeyboardInterrupt", 2), ("alarm", "SdcAlarm", 3)])
def test_train_closes_the_trace_however_it_ends(tmp_path, how, raised, last_step):
    """Issue 40: ``record`` wraps ``trainer.train()``; a KeyboardInterrupt inside step 3, or an
    alarm at step 3, leaves it with every rank's trace closed on an exception (END record)."""
    import json

    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    found = gloo_job(_stopped_job, 2, tmp_path / "results", str(tmp_path), how)
    assert found == [{"raised": raised, "train_step given back": True}] * 2
    end = json.loads(CliRunner().invoke(cli, ["inspect", str(tmp_path / "trace"), "--json"]).stdout)["end"]
    assert [(r["closed"], r["closed_on_error"]) for r in end["ranks"]] == [(True, True)] * 2, end
    assert "no rank closed its trace" not in end["summary"] and end["last_step"] == last_step, end


def _pipelined_jobs(rank: int, root: str, runs: list) -> list:
    """torchtitan's loop (``step += 1``, then ``train_step``) around a PP 2 x FSDP2 DP 2 job, recorded
    with ``record``: a trainer shaped as torchtitan 0.3's with pipeline parallelism (``parallel_dims.
    pp_enabled``, ``pp_schedule`` a real ``ScheduleGPipe`` over the rank's ``fully_shard``-ed stage,
    ``model_parts`` that stage, ``pp_has_first_stage`` / ``pp_has_last_stage``), its ``train_step``
    as torchtitan's (``zero_grad``, the schedule's step over 4 microbatches, ``optimizers.step``).
    The model, cut and microbatches are ``demo/pp.py``'s (its recipe replays the trace); IDs from the
    step, which torchtitan counts from 1. ``runs``: (name, fault specs, stages per rank), one trace
    each; with 2 stages per rank, ``pp_schedule`` is ``ScheduleInterleaved1F1B`` over stages ``pp``
    and ``pp + 2`` (torchtitan's loop placement), ``model_parts`` both, no checkpoints (a plain
    optimizer over several parts has no name-keyed state: ``record`` refuses them)."""
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    from sdc_forensics.demo import pp as demo
    from sdc_forensics.recorder import RecorderOptions

    mesh = init_device_mesh("cpu", (demo.PP, WORLD // demo.PP), mesh_dim_names=("pp", "dp"))
    stage_index, dp = mesh.get_coordinate()
    found = []
    for name, inject, per_rank in runs:
        count = demo.PP * per_rank
        indices = [stage_index + demo.PP * v for v in range(per_rank)]
        parts = [demo.stage_module(demo.build_model(), i, count) for i in indices]
        for part in parts:
            for block in part.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
        stages = [
            PipelineStage(part, i, count, torch.device("cpu"), group=mesh["pp"].get_group())
            for i, part in zip(indices, parts)
        ]
        schedule = (
            ScheduleGPipe(stages[0], demo.MICROBATCHES, loss_fn=demo.loss_fn)
            if per_rank == 1
            else ScheduleInterleaved1F1B(stages, demo.MICROBATCHES, loss_fn=demo.loss_fn)
        )
        trainer = _trainer(
            model_parts=parts,
            optimizers=torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=3e-3),
            parallel_dims=SimpleNamespace(pp_enabled=True),
            pp_schedule=schedule,
            pp_has_first_stage=0 in indices,
            pp_has_last_stage=count - 1 in indices,
        )

        def ids(trainer) -> list[int]:
            return demo.microbatch_ids(trainer.step - 1, dp)

        def train_step(trainer=trainer):
            trainer.optimizers.zero_grad()
            batches = [demo.microbatch(i) for i in ids(trainer)]
            if trainer.pp_has_first_stage:
                trainer.pp_schedule.step(torch.cat([inputs for inputs, _ in batches]))
            else:
                trainer.pp_schedule.step(target=torch.cat([labels for _, labels in batches]), losses=[])
            trainer.optimizers.step()

        trainer.train_step = train_step
        with sdc.record(
            trainer,
            Path(root, name, "trace"),
            microbatch_ids=ids,
            recipe=demo.REFERENCE,
            checkpoint_every=3 if per_rank == 1 else 0,
            checkpoint_dir=Path(root, name, "ckpt"),
            inject=tuple(inject),
            # the online alarm said, training on, as a job that records for bisect would
            options=RecorderOptions(policy="continue"),
        ):
            for step in range(1, 7):
                trainer.step = step
                trainer.train_step()
        found.append(trainer.train_step is train_step)
    return found


@pytest.mark.heavy  # three 4-process pipeline runs and a replay
def test_a_recorded_torchtitan_pipeline_loop_is_read_by_bisect_and_certified(tmp_path):
    """Issue 36: record passes torchtitan's pipeline schedule to the recorder (the PP layout); the
    trace counts torchtitan's steps (1..6) and ``bisect --trace-only`` reads it: clean, nothing found;
    a flip of rank 2's (pp=1, dp=0) reduce-scatter output at step 3 named there from the trace alone,
    and so is one of rank 1's (pp=0, dp=1) under ScheduleInterleaved1F1B with two model parts per
    rank. The clean trace certifies with the demo's recipe (checkpoints 1 and 4, bit for bit)."""
    import json

    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    runs = [
        ("clean", [], 1),
        ("flip", ["reduce-scatter-output:step=3:rank=2:bit=29"], 1),
        ("interleaved", ["reduce-scatter-output:step=3:rank=1:bit=29"], 2),
    ]
    assert gloo_job(_pipelined_jobs, WORLD, tmp_path / "results", str(tmp_path), runs) == [[True] * 3] * WORLD

    def invoke(*args):
        result = CliRunner().invoke(cli, [*args, "--json"])
        return result.exit_code, json.loads(result.stdout)

    _, doc = invoke("inspect", str(tmp_path / "clean" / "trace"))
    assert doc["framework"]["name"] == "torchtitan" and doc["end"]["last_step"] == 6, doc["end"]
    # clean: nothing in the trace (exit 4: a trace-only clean verdict is not a certificate)
    rc, doc = invoke("bisect", str(tmp_path / "clean" / "trace"), "--trace-only")
    assert rc == 4 and doc["first_divergent_step"] is None and doc["suspects"] == [], doc
    rc, doc = invoke("bisect", str(tmp_path / "flip" / "trace"), "--trace-only")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == 3, doc
    assert [s["rank"] for s in doc["suspects"]] == [2] and "pp=1, dp=0" in json.dumps(doc["suspects"]), doc
    rc, doc = invoke("bisect", str(tmp_path / "interleaved" / "trace"), "--trace-only")
    assert rc == 1 and doc["verdict"] == "corruption" and doc["first_divergent_step"] == 3, doc
    assert [s["rank"] for s in doc["suspects"]] == [1] and "pp=0, dp=1" in json.dumps(doc["suspects"]), doc
    rc, doc = invoke("certify", str(tmp_path / "clean" / "trace"))
    assert rc == 0 and [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(1, "clean"), (4, "clean")], doc
