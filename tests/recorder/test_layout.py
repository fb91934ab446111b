"""One recorder, one step protocol, a layout behind a contract (issue 34).

The recorder folder's imports form a straight stack (the protocol above the layouts above their
contract above the checks); DDP and FSDP2/HSDP are two implementations of ``layout.Layout``, not
subclasses of ``Recorder``; each concept is written once: the vote within groups
(``checks.majority_within``), the finding type with its enum of checks, the checkpoint protocol
(``checkpointing.save_checkpoint``), the parameters' keys in a checkpoint (``param_keys``), and
the closed sets of the options as string enums.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import sdc_forensics.recorder as package
from sdc_forensics.errors import SdcError, UsageError
from sdc_forensics.recorder import checkpointing, checks
from sdc_forensics.recorder.checks import Check, Finding, Majority
from sdc_forensics.recorder.ddp_layout import DdpLayout
from sdc_forensics.recorder.fsdp_layout import FsdpLayout
from sdc_forensics.recorder.layout import Layout
from sdc_forensics.recorder.options import Policy, RecorderOptions, Reduction
from sdc_forensics.recorder.recorder import Recorder, make_layout
from sdc_forensics.trace import consensus
from sdc_forensics.trace import format as F

FOLDER = Path(package.__file__).parent
LAYOUTS = ("ddp_layout", "fsdp_layout")


def _imports() -> dict[str, set[str]]:
    """``{file: recorder files it imports at run time}`` (imports under ``TYPE_CHECKING`` excluded)."""
    out = {}
    for path in FOLDER.glob("*.py"):
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sdc_forensics.recorder"):
                sub = node.module.removeprefix("sdc_forensics.recorder").lstrip(".")
                deps |= (
                    {sub.split(".")[0]} if sub else {a.name for a in node.names if (FOLDER / f"{a.name}.py").exists()}
                )
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[2] for a in node.names if a.name.startswith("sdc_forensics.recorder.")}
        out[path.stem] = deps - {path.stem}
    return out


def test_the_recorder_folder_imports_form_a_straight_stack():
    imports = _imports()
    order: list[str] = []

    def place(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        for dep in sorted(imports[name]):
            place(dep, path + (name,))
        if name not in order:
            order.append(name)

    for name in sorted(imports):
        place(name, ())
    # the protocol on top, then the layouts, then their contract
    assert {name for name, deps in imports.items() if "recorder" in deps} <= {"__init__"}
    for layout in LAYOUTS:
        assert "layout" in imports[layout] and "recorder" not in imports[layout]
        assert not set(LAYOUTS) & imports[layout]
    assert not ({"recorder", *LAYOUTS} & imports["layout"])
    assert set(LAYOUTS) <= imports["recorder"]


def test_the_protocol_and_each_layout_stay_readable():
    for name in ("recorder", *LAYOUTS):
        lines = len((FOLDER / f"{name}.py").read_text().splitlines())
        assert lines <= 500, (name, lines)


def test_layouts_implement_the_contract_and_nothing_subclasses_the_recorder():
    with pytest.raises(TypeError):
        Layout()
    for layout in (DdpLayout, FsdpLayout):
        assert issubclass(layout, Layout) and not getattr(layout, "__abstractmethods__", None), layout
    assert Recorder.__new__ is object.__new__
    assert Recorder.__subclasses__() == []


def test_a_model_that_is_neither_ddp_nor_sharded_is_refused_before_anything_else():
    with pytest.raises(
        UsageError,
        match="DistributedDataParallel-wrapped model, a model sharded by fully_shard, or a pipeline schedule",
    ):
        make_layout(torch.nn.Linear(2, 2))
    with pytest.raises(UsageError, match="DistributedDataParallel-wrapped model"):
        Recorder("unused", torch.nn.Linear(2, 2), None)


def test_one_finding_type_whose_checks_are_an_enum_that_are_still_their_strings():
    finding = Finding(check="weights", step=2, rank=1, detail="d", flag=F.Flag.WEIGHTS_DIVERGED)
    assert finding.check is Check.WEIGHTS and finding.check == "weights"
    assert (
        f"{finding.check} check" == "weights check" and json.dumps({"check": finding.check}) == '{"check": "weights"}'
    )
    assert {(2, 1, "weights")} == {(finding.step, finding.rank, finding.check)}
    # the FSDP monitor's finer checks: the alarm they raise in the recorder and its flag
    assert [
        (c.family, c.flag)
        for c in (Check.NONFINITE_BEFORE, Check.NONFINITE_AFTER, Check.REDUCE_SCATTER, Check.REPLICA_ALL_REDUCE)
    ] == [
        ("nonfinite", F.Flag.NONFINITE_LOCAL),
        ("nonfinite", F.Flag.NONFINITE_REDUCED),
        ("allreduce", F.Flag.ALLREDUCE_MISMATCH),
        ("allreduce", F.Flag.ALLREDUCE_MISMATCH),
    ]
    assert Finding(check="reduce-scatter", rank=3, detail="d").flag == F.Flag.ALLREDUCE_MISMATCH
    assert (checks.NONFINITE, checks.ALLREDUCE, checks.AUDIT, checks.WEIGHTS) == (
        "nonfinite",
        "allreduce",
        "audit",
        "weights",
    )
    from sdc_forensics.recorder.fsdp_monitor import FsdpFinding

    assert FsdpFinding is Finding


def test_policy_and_reduction_are_enums_given_as_strings():
    options = RecorderOptions(policy="continue", reduction="ordered")
    assert options.policy is Policy.CONTINUE and options.reduction is Reduction.ORDERED
    assert options.policy == "continue" and options.reduction == "ordered" and f"{options.reduction}" == "ordered"
    assert json.loads(json.dumps(dataclasses.asdict(options)))["policy"] == "continue"
    assert dataclasses.replace(options, grad_dtype="bfloat16") == RecorderOptions(
        policy=Policy.CONTINUE, reduction="ordered", grad_dtype="bfloat16"
    )
    with pytest.raises(UsageError, match="policy must be one of raise, continue, got 'stop'"):
        RecorderOptions(policy="stop")
    with pytest.raises(UsageError, match="reduction must be one of native, ordered"):
        RecorderOptions(reduction="tree")


def test_the_one_vote_within_groups_is_the_consensus_vote_of_each_group():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 3, size=(50, 6)).astype(np.uint64)
    valid = rng.random((50, 6)) > 0.1
    groups = [(0, 2, 4), (1, 3, 5)]
    majority, has = checks.majority_within(values, valid, groups)
    for group in groups:
        value, ok = consensus.strict_majority(values[:, list(group)], valid[:, list(group)])
        for rank in group:
            assert (has[:, rank] == ok).all() and (majority[ok, rank] == value[ok]).all()
    whole, has_whole = checks.majority_within(values, valid)
    value, ok = consensus.strict_majority(values, valid)
    assert (has_whole == ok[:, None]).all() and (whole[ok] == np.repeat(value[:, None], 6, axis=1)[ok]).all()


def test_a_vote_per_shard_names_the_odd_replica_and_says_where_there_is_no_majority():
    # shards (0, 2, 4) agree but rank 4; (1, 3) split evenly
    votes = checks.vote_within([7, 8, 7, 9, 6], [(0, 2, 4), (1, 3)])
    assert votes == [
        ((0, 2, 4), Majority(value=7, agreeing=(0, 2), diverged=(4,))),
        ((1, 3), Majority(value=None, agreeing=(), diverged=(1, 3))),
    ]
    assert checks.overall(votes, 0) == Majority(value=None, agreeing=(0, 2), diverged=(1, 3, 4))
    assert [checks.own_weights_flag(votes, r) for r in range(5)] == [
        0,
        int(F.Flag.NO_MAJORITY),
        0,
        int(F.Flag.NO_MAJORITY),
        int(F.Flag.WEIGHTS_DIVERGED),
    ]
    assert checks.overall(checks.vote_within([5, 5, 6], [(0, 1, 2)]), 2).value == 5
    assert checks.strict_majority([1, 2]) == Majority(value=None, agreeing=(), diverged=(0, 1))


def test_the_parameters_are_found_in_a_checkpoint_by_storage_then_by_their_one_name():
    model = torch.nn.ModuleDict(
        {"norm": torch.nn.LayerNorm(2), "attn": torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(2)})}
    )
    named = list(model.named_parameters())
    shared = checkpointing.param_keys(named, {"model": model.state_dict()})
    assert shared == tuple(f"model.{name}" for name, _ in named)
    # copies: found by name; "norm.weight" also ends "model.attn.norm.weight": the one under a top-level key
    copies = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    assert checkpointing.param_keys(named, copies) == shared
    with pytest.raises(UsageError, match="does not hold parameter 'norm.bias'"):
        checkpointing.param_keys(named, {"model": {"attn.norm.weight": torch.ones(2)}})


class _Writer:
    def __init__(self) -> None:
        self.records: list = []

    def new(self, kind, step):
        record = collections.defaultdict(int)
        record.update(kind=kind, step=step)
        return record

    def append(self, record) -> None:
        self.records.append(dict(record))


class _Saver(checkpointing.Saver):
    def __init__(self, failure: str = "") -> None:
        self.calls, self.failure = 0, failure

    def save(self, site, step, path, state, save, vote):
        self.calls += 1
        return checkpointing.Saved(saved_by=0, digest=vote.value or 0, failure=self.failure)


BLESSED = Majority(value=5, agreeing=(0, 1, 2), diverged=())


def _site(*, policy="raise", vote=BLESSED, findings=(), last=None, saver=None):
    reacted, settled = [], []
    site = checkpointing.CheckpointSite(
        module=torch.nn.Linear(1, 1),
        seed=0,
        policy=Policy(policy),
        rank=0,
        world_size=3,
        group=None,
        attempt=0,
        trace_dir=Path("."),
        writer=_Writer(),
        injector=None,
        last_weights_vote=last,
        weights_digest=lambda: 5,
        vote=lambda step, digest: (list(findings), vote),
        settled=settled.append,
        react=reacted.extend,
        saver=saver or _Saver(),
    )
    return site, reacted, settled


def test_the_checkpoint_protocol_votes_then_saves_then_records_then_reacts():
    finding = Finding(check="weights", step=2, rank=-1, flag=F.Flag.NO_MAJORITY, detail="no majority")
    unblessed = Majority(value=None, agreeing=(), diverged=(0, 1, 2))
    # policy raise without a majority: nothing saved, the record says it was refused, then the alarm
    site, reacted, settled = _site(vote=unblessed, findings=[finding])
    assert checkpointing.save_checkpoint(site, 3, Path("x"), {}, None) is None
    assert site.saver.calls == 0 and settled == [5] and reacted == [finding]
    assert site.writer.records[0]["flags"] == int(
        F.Flag.WEIGHTS_CHECKED | F.Flag.CHECKPOINT_REFUSED | F.Flag.NO_MAJORITY
    )
    # continue: saved unblessed
    site, reacted, _ = _site(policy="continue", vote=unblessed, findings=[finding])
    checkpointing.save_checkpoint(site, 3, Path("x"), {}, None)
    assert site.saver.calls == 1 and reacted == [finding]
    # the last step's vote is reused: no vote, no finding
    site, reacted, settled = _site(last=(2, 9, Majority(value=9, agreeing=(0, 1, 2), diverged=())), vote=None)
    checkpointing.save_checkpoint(site, 3, Path("x"), {}, None)
    assert (
        settled == [9] and site.writer.records[0]["weights_digest"] == 9 and site.writer.records[0]["aux_digest"] == 9
    )
    # a failed save: recorded, then raised on every rank
    site, _, _ = _site(saver=_Saver(failure="checkpoint 3 could not be saved to x: rank 1: OSError: full"))
    with pytest.raises(SdcError, match="rank 1: OSError: full"):
        checkpointing.save_checkpoint(site, 3, Path("x"), {}, None)
    assert len(site.writer.records) == 1
