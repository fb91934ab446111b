"""The corpus of bad checkpoints: every one must give one clear line, exit 3, no traceback, an
unchanged input, and never run a payload."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from sdc_forensics.checkpoint import open_checkpoint
from sdc_forensics.checkpoint.torch_reader import pickle_globals
from sdc_forensics.cli.main import cli
from sdc_forensics.errors import CheckpointError
from tests.factories import tree_sha256, write_safetensors_raw, zip_member_offset

OPEN = f"{open.__module__}.open"  # how pickle names builtins.open (io.open)
F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def _run_bad(path: Path, *extra: str) -> str:
    """verify-checkpoint on a bad input: exit 3, one line, no traceback, input unchanged."""
    before = tree_sha256(path)
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(path), *extra])
    assert result.exit_code == 3, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert tree_sha256(path) == before
    return lines[0]


@pytest.fixture
def good_st(tmp_path) -> Path:
    path = tmp_path / "good.safetensors"
    save_file({"a": torch.randn(64, 8), "b": torch.arange(33, dtype=torch.int64), "c": torch.randn(7).bfloat16()}, path)
    return path


def test_truncated_safetensors_at_many_offsets(good_st, tmp_path):
    raw = good_st.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    offsets = sorted(
        {
            0,
            1,
            4,
            7,
            8,
            9,
            8 + header_len // 2,
            8 + header_len - 1,
            8 + header_len,
            8 + header_len + 1,
            8 + header_len + 100,
            (len(raw) + 8 + header_len) // 2,
            len(raw) - 4,
            len(raw) - 1,
        }
    )
    for cut in offsets:
        path = tmp_path / f"cut-{cut}.safetensors"
        path.write_bytes(raw[:cut])
        line = _run_bad(path)
        assert "truncated" in line or "too short" in line or "larger than the file" in line or "not valid" in line, line


def test_header_length_larger_than_file(tmp_path):
    line = _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", {"a": F32_4}, bytes(16), header_len=10_000))
    assert "larger than the file" in line


def test_invalid_header_json(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 12) + b'{"a": [1, 2' + b"\x00" * 17)
    assert "not valid UTF-8 JSON" in _run_bad(path)


def test_offsets_out_of_range(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    assert "out of range" in _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", header, bytes(16)))


def test_overlapping_offsets(tmp_path):
    header = {"a": F32_4, "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    assert "overlap" in _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", header, bytes(24)))


def test_gap_between_tensors(tmp_path):
    header = {"a": F32_4, "b": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]}}
    assert "belong to no tensor" in _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", header, bytes(36)))


def test_dtype_shape_not_matching_byte_length(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}
    assert "12 bytes" in _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", header, bytes(16)))


def test_unknown_dtype(tmp_path):
    header = {"a": {"dtype": "F31", "shape": [4], "data_offsets": [0, 16]}}
    assert "unknown dtype" in _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", header, bytes(16)))


def _index(tmp_path: Path, weight_map: dict) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.ones(4)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(2)}, folder / "model-00002-of-00002.safetensors")
    (folder / "model.safetensors.index.json").write_text(
        __import__("json").dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def test_index_naming_missing_shard(tmp_path):
    folder = _index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00003-of-00003.safetensors"})
    line = _run_bad(folder)
    assert "model-00003-of-00003.safetensors" in line and "does not exist" in line
    assert "model-00003" in _run_bad(folder / "model.safetensors.index.json")


def test_index_naming_tensor_absent_from_its_shard(tmp_path):
    folder = _index(
        tmp_path,
        {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    )
    line = _run_bad(folder)
    assert "'c'" in line and "does not hold it" in line


def test_index_missing_a_tensor_of_a_shard(tmp_path):
    folder = _index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    save_file({"b": torch.ones(2), "x": torch.ones(1)}, folder / "model-00002-of-00002.safetensors")
    assert "does not list it" in _run_bad(folder / "model.safetensors.index.json")


def _dcp(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save(
            {"model": {"w": torch.randn(8, 4), "b": torch.zeros(4)}, "step": 3}, checkpoint_id=str(folder), no_dist=True
        )
    return folder


def test_dcp_without_metadata(tmp_path):
    folder = _dcp(tmp_path)
    (folder / ".metadata").unlink()
    assert ".metadata" in _run_bad(folder)


def test_dcp_truncated_data_file(tmp_path):
    folder = _dcp(tmp_path)
    data = next(folder.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    assert "truncated" in _run_bad(folder)


class _Evil:
    """Unpickling this creates ``marker``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pt_whose_pickle_would_create_a_file(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "payload": _Evil(marker)}, path)
    assert OPEN in pickle_globals(_data_pkl(path))
    line = _run_bad(path)
    assert OPEN in line and "refusing" in line
    assert not marker.exists()


def test_raw_pickle_pt_is_never_unpickled(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "legacy.pt"
    path.write_bytes(pickle.dumps(_Evil(marker), protocol=2))
    assert "raw (legacy) pickle" in _run_bad(path)
    assert not marker.exists()


def test_evil_pickle_hidden_with_memo_is_still_seen():
    """STACK_GLOBAL whose module string comes through the memo (BINGET) is resolved too."""
    payload = b"\x80\x04\x8c\x02os\x94\x8c\x06getcwd\x94\x930h\x00\x8c\x06system\x94\x930N."
    assert pickle_globals(payload) == ["os.getcwd", "os.system"]


def test_dcp_metadata_pickle_payload_never_runs(tmp_path):
    folder = _dcp(tmp_path)
    marker = tmp_path / "PWNED"
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    assert "cannot be loaded safely" in _run_bad(folder)
    assert not marker.exists()


def _data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))


def test_truncated_torch_checkpoint_at_many_offsets(tmp_path):
    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.randn(32, 32)}, "step": 4}, buffer)
    raw = buffer.getvalue()
    for cut in sorted({0, 1, 2, 30, 100, len(raw) // 3, len(raw) // 2, len(raw) - 23, len(raw) - 1}):
        path = tmp_path / f"cut-{cut}.pt"
        path.write_bytes(raw[:cut])
        _run_bad(path)


def test_damaged_pickle_member_is_structural(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(3)}, path)
    start, _ = zip_member_offset(path, "/data.pkl")
    raw = bytearray(path.read_bytes())
    raw[start + 5] ^= 0x20
    path.write_bytes(bytes(raw))
    assert "CRC-32" in _run_bad(path)


def test_unknown_format_and_missing_path(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert "unknown checkpoint format" in _run_bad(other)
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(tmp_path / "nope.pt")])
    assert result.exit_code == 3 and "does not exist" in result.output


def test_library_raises_checkpoint_error_not_exit(tmp_path):
    path = write_safetensors_raw(tmp_path / "x.safetensors", {"a": F32_4}, bytes(8))
    with pytest.raises(CheckpointError, match="truncated"):
        open_checkpoint(path)


def test_readers_never_open_for_writing(good_st, tmp_path, monkeypatch):
    """Every open() the readers make of checkpoint files is read-only."""
    shutil.copy(good_st, tmp_path / "copy.safetensors")
    real_open = os.open
    modes = []

    def spy(path, flags, *args, **kwargs):
        modes.append(flags & (os.O_WRONLY | os.O_RDWR))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    with open_checkpoint(tmp_path / "copy.safetensors") as reader:
        list(reader.tensors())
    assert modes and not any(modes)


def test_dcp_metadata_may_not_reach_what_the_metadata_module_imports(tmp_path):
    """``torch.distributed.checkpoint.metadata.field`` (imported there from dataclasses) is refused."""
    folder = _dcp(tmp_path)
    payload = b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x94\x8c\x05field\x94\x93\x94)R\x94."
    (folder / ".metadata").write_bytes(payload)
    assert "not allowed" in _run_bad(folder)
