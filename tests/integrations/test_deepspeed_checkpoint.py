"""Issue 38: DeepSpeed's own ``engine.save_checkpoint`` folder verified without running its pickle.

The optimizer files pickle three DeepSpeed objects outside torch's ``weights_only`` allow-list;
``checkpoint/deepspeed_files.py`` reads exactly those as inert placeholders. Here without
DeepSpeed: files pickled with stand-ins under DeepSpeed's names (modules put in ``sys.modules``
for the save only), then read while those names resolve to classes that fail if touched; and a
real 2-rank ZeRO 2 folder through the CLI (heavy, with the deepspeed extra).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from sdc_forensics.checkpoint.deepspeed_files import PLACEHOLDERS
from sdc_forensics.checkpoint.folder import FolderReader
from sdc_forensics.checkpoint.torch_reader import PickleRefused, TorchReader

NAMES = {
    "deepspeed.runtime.fp16.loss_scaler": "LossScaler",
    "deepspeed.runtime.zero.config": "ZeroStageEnum",
    "deepspeed.utils.tensor_fragment": "fragment_address",
    "deepspeed.runtime.engine": "DeepSpeedEngine",
}


class _Touched(Exception):
    pass


def _modules(monkeypatch, classes: dict[str, type]) -> None:
    # their parent packages too: pickle imports the module by its dotted name (never the real DeepSpeed here)
    parents = {".".join(m.split(".")[:i]) for m in NAMES for i in range(1, m.count(".") + 1)}
    for package in sorted(parents):
        mod = types.ModuleType(package)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, package, mod)
    for module, name in NAMES.items():
        mod = types.ModuleType(module)
        setattr(mod, name, classes[name])
        classes[name].__module__, classes[name].__qualname__ = module, name
        monkeypatch.setitem(sys.modules, module, mod)


def _stand_ins() -> dict[str, type]:
    class LossScaler:
        def __init__(self):
            self.cur_scale = 1.0

    class Stage(int):
        def __reduce__(self):
            return (type(self), (int(self),))

    class Fragment:
        def __init__(self, numel, start):
            self.numel, self.start = numel, start

    class Engine(Fragment):
        pass

    return {"LossScaler": LossScaler, "ZeroStageEnum": Stage, "fragment_address": Fragment, "DeepSpeedEngine": Engine}


def _tripwires() -> dict[str, type]:
    def trip(*args, **kwargs):
        raise _Touched("a DeepSpeed class was resolved and called")

    return {
        name: type(name, (), {"__new__": trip, "__init__": trip, "__setstate__": trip, "__reduce__": trip})
        for name in NAMES.values()
    }


def _save_optimizer_file(path: Path, monkeypatch, *, hostile: bool = False) -> torch.Tensor:
    classes = _stand_ins()
    with monkeypatch.context() as m:
        _modules(m, classes)
        fp32 = torch.arange(6, dtype=torch.float32)
        state = {
            "optimizer_state_dict": {
                "loss_scaler": classes["LossScaler"](),
                "zero_stage": classes["ZeroStageEnum"](2),
                "single_partition_of_fp32_groups": [fp32],
                "param_slice_mappings": [{"0.weight": classes["fragment_address"](6, 0)}],
            }
        }
        if hostile:
            state["engine"] = classes["DeepSpeedEngine"](0, 0)
        torch.save(state, path)
    return fp32


def test_deepspeeds_three_classes_are_read_as_inert_placeholders_and_never_resolved(tmp_path, monkeypatch):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    fp32 = _save_optimizer_file(path, monkeypatch)
    # from here on DeepSpeed's names resolve to classes that raise when touched
    _modules(monkeypatch, _tripwires())
    reader = TorchReader(path)
    try:
        tensors = dict(reader.tensors())
    finally:
        reader.close()
    assert list(tensors) == ["optimizer_state_dict.single_partition_of_fp32_groups.0"]
    assert torch.equal(tensors["optimizer_state_dict.single_partition_of_fp32_groups.0"], fp32)
    assert set(PLACEHOLDERS) == {f"{m}.{n}" for m, n in NAMES.items() if n != "DeepSpeedEngine"}


def test_any_other_deepspeed_global_is_still_refused(tmp_path, monkeypatch):
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _save_optimizer_file(path, monkeypatch, hostile=True)
    _modules(monkeypatch, _tripwires())
    with pytest.raises(PickleRefused, match="deepspeed.runtime.engine.DeepSpeedEngine"):
        TorchReader(path)


def test_latest_and_the_conversion_scripts_are_ignored_only_beside_the_tag_they_name(tmp_path, monkeypatch):
    tag = tmp_path / "global_step2"
    tag.mkdir()
    torch.save({"module": {"w": torch.ones(3)}}, tag / "mp_rank_00_model_states.pt")
    _save_optimizer_file(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", monkeypatch)
    (tmp_path / "zero_to_fp32.py").write_text("print('not run')\n")
    (tmp_path / "latest").write_text("global_step2")
    reader = FolderReader(tmp_path)
    try:
        assert set(reader.ignored()) == {"latest", "zero_to_fp32.py"}
        assert reader.unverifiable() == []
        assert "global_step2/mp_rank_00_model_states.pt/module.w" in dict(reader.tensors())
    finally:
        reader.close()
    # a "latest" naming no folder here is not DeepSpeed's: both stay unverifiable
    (tmp_path / "latest").write_text("../elsewhere")
    reader = FolderReader(tmp_path)
    try:
        assert {i.file for i in reader.unverifiable()} == {"latest", "zero_to_fp32.py"}
    finally:
        reader.close()
    # a tag name whose folder is gone (a trial user's deleted global_step20): said on "latest", in those words
    (tmp_path / "latest").write_text("global_step20")
    reader = FolderReader(tmp_path)
    try:
        [issue] = reader.unverifiable()
        assert (
            issue.file == "latest" and "names checkpoint 'global_step20', which is not in this folder" in issue.detail
        )
    finally:
        reader.close()


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="the deepspeed extra is not installed")
def test_a_zero_2_save_checkpoint_folder_is_verified(tmp_path, monkeypatch):
    from tests.cli.installed import run_installed
    from tests.integrations.launch import assert_ok, run_ranks

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    argv = ["--stage", "2", "--trace", "trace", "--out", "out", "--steps", "2", "--every", "2", "--ds-save", "ds"]
    assert_ok(run_ranks("tests.integrations.dsjob", argv, cwd=tmp_path))
    ran = run_installed(["verify-checkpoint", "ds", "--json"], tmp_path, cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    doc = json.loads(ran.stdout)
    assert (doc["verdict"], doc["report"]["unverifiable"]) == ("verified", [])
    assert set(doc["report"]["ignored"]) == {"latest", "zero_to_fp32.py", "zero_to_torch.py"}
    keys = {t["key"] for t in doc["report"]["tensors"]}
    assert "global_step2/mp_rank_00_model_states.pt/module.0.weight" in keys
    for rank in (0, 1):
        optim = f"global_step2/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt/optimizer_state_dict"
        assert {f"{optim}.base_optimizer_state.state.0.exp_avg", f"{optim}.single_partition_of_fp32_groups.0"} <= keys


@pytest.mark.parametrize("count", [[2], 2])  # ZeRO 1 and 2: one per parameter group; ZeRO 3: an int
def test_a_tag_folder_without_one_ranks_zero_file_is_not_verified(tmp_path, count):
    """A trial user removed rank 1's ZeRO file from a 2-rank global_step10: VERIFIED, exit 0, though
    DeepSpeed cannot load it. The files say how many ranks saved (``partition_count``)."""
    from sdc_forensics.checkpoint import FindingKind, verify_checkpoint

    tag = tmp_path / "global_step10"
    tag.mkdir()
    torch.save({"module": {"w": torch.ones(4)}, "dp_world_size": 2}, tag / "mp_rank_00_model_states.pt")
    for rank in (0, 1):
        state = {"optimizer_state_dict": {"partition_count": count, "fp32": torch.full((2,), float(rank))}}
        torch.save(state, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    assert not verify_checkpoint(tag).findings
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    [finding] = verify_checkpoint(tag).findings
    assert finding.kind is FindingKind.NOT_VERIFIABLE
    assert finding.subject == "zero_pp_rank_1_mp_rank_00_optim_states.pt" and "2 ranks saved" in finding.detail
