"""Checkpoint folders: every file below the folder is verified or listed as not verifiable, and a
folder with any such file is never VERIFIED (exit 1 through the CLI, ``report.ok`` False)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from sdc_forensics.checkpoint import FindingKind, open_checkpoint, verify_checkpoint
from sdc_forensics.cli.main import cli
from sdc_forensics.errors import CheckpointError
from sdc_forensics.fingerprint.core import digest
from sdc_forensics.trace.checkpoints import hex64
from tests.checkpoint.conftest import tree_sha256, zip_member_offset


@dataclasses.dataclass
class TrainingArguments:
    """Stands in for transformers' TrainingArguments, which Trainer pickles into training_args.bin."""

    output_dir: str = "out"
    learning_rate: float = 5e-5


def _invoke(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output
    return result


def _trained(steps: int = 2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    for _ in range(steps):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def _hf_folder(folder: Path, *, nan_in_optimizer: bool = False) -> Path:
    """model.safetensors + config.json + optimizer.pt + scheduler.pt (plain ints and floats)."""
    folder.mkdir(parents=True)
    model, optimizer, _ = _trained()
    save_file(model.state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "mlp", "hidden_size": 5}))
    state = optimizer.state_dict()
    if nan_in_optimizer:
        state["state"][0]["exp_avg"].view(-1)[3] = float("nan")
    torch.save(state, folder / "optimizer.pt")
    torch.save({"last_epoch": 2, "_step_count": 3, "base_lrs": [1e-3], "_last_lr": [3.3e-4]}, folder / "scheduler.pt")
    return folder


def _trainer_checkpoint(folder: Path, step: int = 500) -> Path:
    """What transformers' Trainer._save_checkpoint lays out in checkpoint-500/."""
    folder.mkdir(parents=True)
    model, optimizer, scheduler = _trained()
    save_file(model.state_dict(), folder / "model.safetensors", metadata={"format": "pt"})
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
        folder / "rng_state.pth",
    )
    (folder / "trainer_state.json").write_text(
        json.dumps(
            {"global_step": step, "epoch": 1.0, "log_history": [{"loss": 1.5, "step": step}], "best_metric": None},
            indent=2,
        )
    )
    torch.save(TrainingArguments(), folder / "training_args.bin")
    (folder / "config.json").write_text(json.dumps({"architectures": ["Mlp"], "torch_dtype": "float32"}))
    return folder


def _kinds(report) -> dict[str, FindingKind]:
    return {f.subject: f.kind for f in report.findings}


def _weights_only_loads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal
        return False
    return True


def test_clean_hf_folder_verifies_every_file(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt")
    before = tree_sha256(folder)
    report = verify_checkpoint(folder)
    assert report.ok and report.format == "safetensors" and report.unverifiable == ()
    assert sorted(f.name for f in report.files) == ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt"]
    keys = {t.key: t for t in report.tensors}
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= set(keys)  # model keys unchanged
    exp_avg = torch.load(folder / "optimizer.pt", weights_only=True)["state"][0]["exp_avg"]
    assert keys["optimizer.pt/state.0.exp_avg"].digest == hex64(digest(exp_avg))  # read and digested like the model
    assert keys["optimizer.pt/state.0.exp_avg"].file == "optimizer.pt"
    result = _invoke("verify-checkpoint", str(folder))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output
    assert tree_sha256(folder) == before


def test_nan_in_optimizer_pt_of_a_folder_is_not_certifiable(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt", nan_in_optimizer=True)
    report = verify_checkpoint(folder)
    assert _kinds(report) == {"optimizer.pt/state.0.exp_avg": FindingKind.NONFINITE}
    result = _invoke("verify-checkpoint", str(folder), "--json")
    assert result.exit_code == 1
    assert "NOT CERTIFIABLE" in result.stderr and "optimizer.pt" in result.stderr.split("NOT CERTIFIABLE")[1]
    doc = json.loads(result.stdout)
    assert [(f["kind"], f["subject"]) for f in doc["report"]["findings"]] == [
        ("nonfinite", "optimizer.pt/state.0.exp_avg")
    ]


def test_unknown_binary_file_is_not_verifiable(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt")
    np.save(folder / "foo.npy", np.arange(10.0))
    report = verify_checkpoint(folder)
    assert not report.ok and report.unverifiable == ("foo.npy",)
    (finding,) = report.findings
    assert finding.kind is FindingKind.NOT_VERIFIABLE and "numpy array" in finding.detail
    assert "foo.npy" in {f.name for f in report.files}  # still checksummed
    result = _invoke("verify-checkpoint", str(folder), "--json")
    # nothing wrong found, but not all verified: 4, not the 1 of damage (a trial user's Trainer folders)
    assert result.exit_code == 4, result.output
    assert "NOT VERIFIED" in result.stderr and "not-verifiable foo.npy" in result.stderr
    doc = json.loads(result.stdout)
    assert doc["report"]["unverifiable"] == ["foo.npy"] and doc["report"]["ok"] is False
    assert doc["verdict"] == "unverified"


def test_transformers_trainer_checkpoint_folder(tmp_path):
    folder = _trainer_checkpoint(tmp_path / "checkpoint-500")
    before = tree_sha256(folder)
    report = verify_checkpoint(folder)
    assert report.step == 500  # from trainer_state.json: the safetensors file does not say
    assert {f.name for f in report.files} == {
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
        "training_args.bin",
        "config.json",
    }
    kinds = _kinds(report)
    # the pickled TrainingArguments: the job's configuration, never loaded at resume; checksummed
    # (in report.files above), never unpickled, and no reason to call the folder unverified
    assert "training_args.bin" not in kinds and "training_args.bin" in report.ignored
    numpy_needed = not _weights_only_loads(folder / "rng_state.pth")
    if not numpy_needed:
        assert "rng_state.pth" not in kinds and any(t.key.startswith("rng_state.pth/") for t in report.tensors)
    else:  # numpy's RNG state is an ndarray: outside the allow-list
        assert kinds["rng_state.pth"] is FindingKind.NOT_VERIFIABLE
        assert "numpy" in next(f.detail for f in report.findings if f.subject == "rng_state.pth")
    assert set(kinds) <= {"rng_state.pth"}
    assert any(t.key.startswith("optimizer.pt/state.") for t in report.tensors)
    result = _invoke("verify-checkpoint", str(folder))
    if numpy_needed:
        assert result.exit_code == 4 and "NOT VERIFIED" in result.output and "--allow-numpy" in result.output
    result = _invoke("verify-checkpoint", str(folder), "--allow-numpy")
    assert result.exit_code == 0 and "VERIFIED" in result.output, result.output
    assert "not read (no training state): training_args.bin" in result.output
    assert tree_sha256(folder) == before


def test_hf_index_folder_with_trainer_files(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.ones(4)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(2, 2)}, folder / "model-00002-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 32},
                "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
            }
        )
    )
    torch.save({"state": {0: {"exp_avg": torch.tensor([1.0, float("inf")])}}}, folder / "optimizer.pt")
    torch.save({"last_epoch": 7}, folder / "scheduler.pt")
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    (folder / "trainer_state.json").write_text('{"global_step": 7, "log_hist')  # truncated
    report = verify_checkpoint(folder)
    assert report.format == "hf-index"
    assert {"a", "b", "optimizer.pt/state.0.exp_avg"} <= {t.key for t in report.tensors}
    assert _kinds(report) == {
        "trainer_state.json": FindingKind.FILE_DAMAGED,
        "optimizer.pt/state.0.exp_avg": FindingKind.NONFINITE,
    }
    assert len(report.files) == 7


def test_damaged_and_refused_torch_files_are_findings_not_errors(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt")
    raw = (folder / "optimizer.pt").read_bytes()
    (folder / "optimizer.pt").write_bytes(raw[: len(raw) // 2])  # truncated: no central directory
    (folder / "scaler.pt").write_bytes(b"")
    (folder / "notes.bin").write_bytes(b"\x00\x01 raw bytes")
    torch.save({"x": torch.ones(3)}, folder / "legacy.pt", _use_new_zipfile_serialization=False)
    report = verify_checkpoint(folder)
    assert _kinds(report) == {
        "optimizer.pt": FindingKind.FILE_DAMAGED,
        "scaler.pt": FindingKind.FILE_DAMAGED,
        "notes.bin": FindingKind.NOT_VERIFIABLE,
        "legacy.pt": FindingKind.NOT_VERIFIABLE,
    }
    assert "legacy raw pickle" in next(f.detail for f in report.findings if f.subject == "legacy.pt")


def test_crc_damage_in_an_extra_torch_file_names_that_file(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt")
    start, size = zip_member_offset(folder / "optimizer.pt", "/data/0")
    raw = bytearray((folder / "optimizer.pt").read_bytes())
    raw[start + size // 2] ^= 0x10
    (folder / "optimizer.pt").write_bytes(bytes(raw))
    kinds = _kinds(verify_checkpoint(folder))
    assert kinds.get("optimizer.pt") is FindingKind.FILE_DAMAGED


def test_huggingface_hub_cache_snapshot_links_are_followed(tmp_path):
    repo = tmp_path / "hub" / "models--org--mlp"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    save_file({"w": torch.randn(3, 3)}, blobs / "1111")
    (blobs / "2222").write_text(json.dumps({"model_type": "mlp"}))
    os.symlink("../../blobs/1111", snapshot / "model.safetensors")
    os.symlink("../../blobs/2222", snapshot / "config.json")
    report = verify_checkpoint(snapshot)
    assert report.ok and [t.key for t in report.tensors] == ["w"]
    assert sorted(f.name for f in report.files) == ["config.json", "model.safetensors"]
    assert _invoke("verify-checkpoint", str(snapshot)).exit_code == 0


def test_links_out_of_the_folder_dangling_links_and_fifos_are_not_verifiable(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(folder / "scheduler.pt", outside / "scheduler.pt")
    os.symlink(outside / "scheduler.pt", folder / "scheduler.pt")
    os.symlink(folder / "gone.pt", folder / "dangling.pt")
    os.symlink("loop-b.pt", folder / "loop-a.pt")  # a loop is not "dangling": its target is not missing
    os.symlink("loop-a.pt", folder / "loop-b.pt")
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.txt").write_text("inside\n")
    os.symlink("sub", folder / "more")  # a linked directory: not walked twice
    os.mkfifo(folder / "pipe")  # opening it would block: it must never be opened
    os.symlink("config.json", folder / "config-copy.json")  # inside: followed
    report = verify_checkpoint(folder)
    kinds = _kinds(report)
    refused = ("scheduler.pt", "dangling.pt", "loop-a.pt", "loop-b.pt", "more", "pipe")
    assert kinds == {name: FindingKind.NOT_VERIFIABLE for name in refused}
    details = {f.subject: f.detail for f in report.findings}
    assert "outside the checkpoint folder" in details["scheduler.pt"] and "dangling" in details["dangling.pt"]
    assert all("link loop" in details[name] and "dangling" not in details[name] for name in ("loop-a.pt", "loop-b.pt"))
    assert "directory" in details["more"] and "regular file" in details["pipe"]
    assert "config-copy.json" in {f.name for f in report.files}
    assert not any(t.key.startswith("scheduler.pt/") for t in report.tensors)


def test_model_file_linked_out_of_the_folder_is_refused(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt")
    shutil.move(folder / "model.safetensors", tmp_path / "model.safetensors")
    os.symlink(tmp_path / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        open_checkpoint(folder)
    assert _invoke("verify-checkpoint", str(folder)).exit_code == 3


def test_hub_download_bookkeeping_and_git_are_ignored_and_listed(tmp_path):
    folder = _hf_folder(tmp_path / "ckpt")
    meta = folder / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "model.safetensors.metadata").write_text("etag\n")
    (meta / "model.safetensors.lock").write_bytes(b"")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    report = verify_checkpoint(folder)
    assert report.ok and report.ignored == (".cache/huggingface/", ".git/")
    assert ".gitattributes" in {f.name for f in report.files}
    assert not any(f.name.startswith((".cache", ".git/")) for f in report.files)


def test_dcp_folder_with_extra_files_and_fsdp_style_sub_directory(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.randn(10), "step": 5}, checkpoint_id=str(folder), no_dist=True)
    (folder / "extra.bin").write_bytes(b"junk bytes")
    (folder / "stale.distcp").write_bytes(b"junk bytes")
    report = verify_checkpoint(folder)
    assert report.format == "dcp" and report.step == 5 and "w" in {t.key for t in report.tensors}
    assert _kinds(report) == {"extra.bin": FindingKind.NOT_VERIFIABLE, "stale.distcp": FindingKind.NOT_VERIFIABLE}

    trainer = tmp_path / "checkpoint-9"  # Trainer with FSDP SHARDED_STATE_DICT: DCP sub-directories
    with pytest.warns(UserWarning):
        dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(trainer / "pytorch_model_fsdp_0"), no_dist=True)
    torch.save({"last_epoch": 9}, trainer / "scheduler.pt")
    report = verify_checkpoint(trainer)
    assert report.ok and report.format == "folder"
    assert [t.key for t in report.tensors] == ["pytorch_model_fsdp_0/model.w"]
    assert any(f.name == "pytorch_model_fsdp_0/.metadata" for f in report.files)


def test_folder_without_any_tensor_file_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert _invoke("verify-checkpoint", str(tmp_path)).exit_code == 3


def test_file_inside_a_folder_is_verified_alone(tmp_path):
    """Naming one file verifies that file; naming the folder verifies everything in it."""
    folder = _hf_folder(tmp_path / "ckpt", nan_in_optimizer=True)
    np.save(folder / "foo.npy", np.zeros(2))
    assert verify_checkpoint(folder / "model.safetensors").ok
    assert not verify_checkpoint(folder).ok


@pytest.mark.parametrize("kind", ["quantized", "sparse"])
def test_quantized_or_sparse_optimizer_pt_is_not_verifiable_not_damaged(tmp_path, kind):
    """A ``torch.save`` file beside the model holding a tensor verification cannot read as dense
    bits (a quantized or sparse optimizer state) is intact as far as anyone can tell: not
    verifiable (exit 1, never VERIFIED), not ``file-damaged``, and still checksummed."""
    import warnings

    folder = _hf_folder(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch deprecates quantized tensor creation
        tensor = (
            torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
            if kind == "quantized"
            else torch.eye(3).to_sparse()
        )
    torch.save({"state": {0: {"exp_avg": tensor}}, "param_groups": []}, folder / "optimizer.pt")
    report = verify_checkpoint(folder)
    assert _kinds(report) == {"optimizer.pt": FindingKind.NOT_VERIFIABLE}
    (finding,) = report.findings
    expected = "dtype qint8" if kind == "quantized" else "sparse_coo tensor"
    assert expected in finding.detail and "checksummed" in finding.detail
    assert "optimizer.pt" in {f.name for f in report.files}
    before = tree_sha256(folder)
    result = _invoke("verify-checkpoint", str(folder), "--json")
    assert result.exit_code == 4, result.output  # not verifiable is not damage
    assert "not-verifiable optimizer.pt" in result.stderr and "file-damaged" not in result.stderr
    assert json.loads(result.stdout)["report"]["unverifiable"] == ["optimizer.pt"]
    assert tree_sha256(folder) == before


def test_a_noted_file_the_reader_declined_is_not_verified_never_missing(tmp_path):
    # a clean Trainer job's checkpoint read without --allow-numpy: rng_state.pth (numpy's RNG state)
    # is declined, and its noted tensors are "not verified", not "noted at save time, absent"
    # (which bisect read as storage damage: "corruption, check the disk" on a clean run)
    from sdc_forensics.checkpoint.limits import ReadLimits
    from sdc_forensics.trace.checkpoints import CheckpointNote

    folder = _trainer_checkpoint(tmp_path / "checkpoint-500")
    reader = open_checkpoint(folder, limits=ReadLimits(allow_numpy=True))
    try:
        everything = verify_checkpoint(reader)
    finally:
        reader.close()
    assert any(t.key.startswith("rng_state.pth/") for t in everything.tensors)
    note = CheckpointNote(step=500, path=str(folder), tensors={t.key: t.digest for t in everything.tensors})
    report = verify_checkpoint(folder, note=note)
    kinds = {f.kind for f in report.findings}
    assert FindingKind.MISSING_TENSOR not in kinds and FindingKind.DIGEST_MISMATCH not in kinds
    if not _weights_only_loads(folder / "rng_state.pth"):
        assert [f.subject for f in report.findings] == ["rng_state.pth"] and kinds == {FindingKind.NOT_VERIFIABLE}
        assert "--allow-numpy" in report.findings[0].detail


def test_shards_the_names_say_exist_and_no_index_lists_are_missing_not_verified(tmp_path):
    """A trial user's folder with only ``model-00001-of-00002.safetensors`` (no index) was VERIFIED, exit 0."""
    folder = tmp_path / "half"
    folder.mkdir()
    save_file({"a.weight": torch.ones(8, 8)}, folder / "model-00001-of-00002.safetensors")
    report = verify_checkpoint(folder)
    assert _kinds(report) == {"model-00002-of-00002.safetensors": FindingKind.NOT_VERIFIABLE}
    detail = next(f.detail for f in report.findings)
    assert "say 2 shards and 1 is here" in detail and "incomplete" in detail
    assert _invoke("verify-checkpoint", str(folder)).exit_code != 0
    save_file({"b.weight": torch.ones(2)}, folder / "model-00002-of-00002.safetensors")  # both, still no index
    assert not verify_checkpoint(folder).findings


def test_dtypes_safetensors_writes_are_read_or_not_verifiable_never_damaged(tmp_path):
    """A trial user's safetensors 0.8 files with C64, F8_E8M0 and F4 tensors: each alone 'unknown dtype' (exit 3),
    and in a model folder 'file-damaged' (exit 1), a false damage claim."""
    from tests.factories import write_safetensors_raw

    folder = _hf_folder(tmp_path / "ckpt")
    write_safetensors_raw(
        folder / "freqs.safetensors", {"f": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}, bytes(16)
    )
    write_safetensors_raw(
        folder / "packed.safetensors", {"p": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, bytes(2)
    )
    report = verify_checkpoint(folder)
    assert _kinds(report) == {"packed.safetensors": FindingKind.NOT_VERIFIABLE}
    assert "dtype F4" in next(f.detail for f in report.findings)
    assert "freqs.safetensors/f" in {t.key for t in report.tensors}  # complex64, read and digested
    assert _invoke("verify-checkpoint", str(folder)).exit_code == 4
