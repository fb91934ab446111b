"""Content verification: clean files verify (exit 0), a flipped data byte or NaN in optimizer
state does not (exit 1), digests agree with the recorder's definition in every format."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from sdc_forensics.checkpoint import FindingKind, open_checkpoint, verify_checkpoint
from sdc_forensics.checkpoint.measure import count_nonfinite
from sdc_forensics.cli.main import cli
from sdc_forensics.fingerprint.reference import digest_bytes
from sdc_forensics.statedict import state_digests
from sdc_forensics.trace.checkpoints import CheckpointNote, hex64
from tests.factories import flip_byte, tree_sha256, write_safetensors_raw, zip_member_offset


def _reference_digest(tensor: torch.Tensor) -> str:
    """The recorder's digest definition, from the numpy reference (not the torch code verify runs)."""
    return hex64(digest_bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _invoke(*args: str):
    result = CliRunner().invoke(cli, list(args))
    assert "Traceback" not in result.output
    return result


def test_clean_demo_checkpoint_verifies_against_its_note(make_run):
    run = make_run(steps=4)
    path = run.checkpoints[2]
    before = tree_sha256(path)
    result = _invoke("verify-checkpoint", str(path), "--trace", str(run.trace_dir), "--json")
    # content as noted, the replicas' majority, no NaN/Inf; this trace names no recipe, so steps
    # 0..1 cannot be replayed: "nothing wrong found, not certified" (exit 4), never VERIFIED
    assert result.exit_code == 4, result.output
    doc = json.loads(result.stdout)
    assert doc["report"]["findings"] == [] and doc["certification"]["status"] == "unverified"
    assert "NOT CERTIFIED" in result.stderr
    alone = _invoke("verify-checkpoint", str(path))
    assert alone.exit_code == 0 and "VERIFIED" in alone.output
    assert tree_sha256(path) == before


def test_flipped_data_byte_is_caught_by_its_digest(make_run):
    run = make_run(steps=4)
    path = run.checkpoints[2]
    start, size = zip_member_offset(path, "/data/0")  # storage of the first tensor saved (model.0.weight)
    flip_byte(path, start + size // 2, 0x04)
    result = _invoke("verify-checkpoint", str(path), "--trace", str(run.trace_dir), "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1 and doc["verdict"] == "not-certifiable"
    kinds = {(f["kind"], f["subject"]) for f in doc["report"]["findings"]}
    assert ("digest-mismatch", "model.0.weight") in kinds
    assert any(k == "file-damaged" for k, _ in kinds)  # the zip CRC of that storage member too
    assert doc["certification"]["status"] == "corrupt"


def test_flipped_byte_without_trace_is_caught_by_zip_crc(make_run):
    run = make_run(steps=2)
    path = run.checkpoints[2]
    start, size = zip_member_offset(path, "/data/0")
    flip_byte(path, start + 3)
    result = _invoke("verify-checkpoint", str(path))
    assert result.exit_code == 1 and "file-damaged" in result.output


def test_nan_in_optimizer_state_is_not_certifiable(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    state["state"][0]["exp_avg_sq"].view(-1)[5] = float("nan")
    path = tmp_path / "ckpt.pt"
    payload = {"model": model.state_dict(), "optimizer": state, "step": 1}
    torch.save(payload, path)
    result = _invoke("verify-checkpoint", str(path), "--json")
    assert result.exit_code == 1
    findings = json.loads(result.stdout)["report"]["findings"]
    assert findings == [
        {
            "kind": "nonfinite",
            "subject": "optimizer.state.0.exp_avg_sq",
            "expected": "0",
            "found": "1",
            "detail": "1 NaN/Inf value(s)",
        }
    ]
    note = CheckpointNote(step=1, path=str(path), tensors=state_digests(payload))
    report = verify_checkpoint(path, note=note)
    assert [f.kind for f in report.findings] == [FindingKind.NONFINITE]  # digests match: it was saved that way


def test_safetensors_digest_mismatch_vs_note_and_missing_tensor(tmp_path):
    tensors = {"w": torch.randn(300, 7), "b": torch.randn(7)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    note = CheckpointNote(step=0, path=str(path), tensors={**state_digests(tensors), "gone": "0" * 16})
    report = verify_checkpoint(path, note=note)
    assert [(f.kind, f.subject) for f in report.findings] == [(FindingKind.MISSING_TENSOR, "gone")]
    flip_byte(path, path.stat().st_size - 1, 0x80)  # the last byte of the data buffer
    report = verify_checkpoint(path, note=note)
    mismatched = [f.subject for f in report.findings if f.kind == FindingKind.DIGEST_MISMATCH]
    assert len(mismatched) == 1 and mismatched[0] in tensors


def test_digests_equal_the_recorders_in_every_format(tmp_path):
    import torch.distributed.checkpoint as dcp

    tensors = {
        "a": torch.randn(33, 5),
        "b": torch.arange(10, dtype=torch.int64),
        "c": torch.randn(9).to(torch.bfloat16),
    }
    expected = {k: _reference_digest(t) for k, t in tensors.items()}
    save_file(tensors, tmp_path / "m.safetensors")
    torch.save(tensors, tmp_path / "m.pt")
    with pytest.warns(UserWarning):
        dcp.save(tensors, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for target in ("m.safetensors", "m.pt", "dcp"):
        report = verify_checkpoint(tmp_path / target)
        assert report.ok
        assert {t.key: t.digest for t in report.tensors} == expected, target


def test_misaligned_safetensors_offsets_still_digest_exactly(tmp_path):
    """A header length that leaves the data buffer at an odd address forces the copying path."""
    values = torch.randn(1000)
    header = {"x": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}
    path = write_safetensors_raw(tmp_path / "odd.safetensors", header, values.numpy().tobytes())
    assert (8 + len(json.dumps(header))) % 4
    with open_checkpoint(path) as reader:
        ((_, tensor),) = list(reader.tensors())
        assert torch.equal(tensor, values)
    assert verify_checkpoint(path).tensors[0].digest == _reference_digest(values)


def test_file_checksum_is_the_digest_of_the_file_bytes(tmp_path):
    import numpy as np

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(10, 10)}, path)
    (checksum,) = verify_checkpoint(path).files
    assert checksum.digest == hex64(digest_bytes(np.frombuffer(path.read_bytes(), dtype=np.uint8)))
    assert checksum.size_bytes == path.stat().st_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_count_nonfinite(dtype):
    x = torch.zeros(5000, dtype=dtype)
    assert count_nonfinite(x) == 0
    x[17], x[4000], x[4999] = float("nan"), float("inf"), -float("inf")
    assert count_nonfinite(x) == 3
    big = torch.full((4096,), torch.finfo(dtype).max / 2, dtype=dtype)  # the sum overflows; no element is Inf
    assert count_nonfinite(big) == 0
    assert count_nonfinite(torch.arange(10)) == 0


def test_hf_index_reads_all_shards(tmp_path):
    save_file({"a": torch.ones(4)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(2, 2)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 32},
                "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
            }
        )
    )
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.format == "hf-index"
    assert sorted(t.key for t in report.tensors) == ["a", "b"]
    assert sorted(f.name for f in report.files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert _invoke("verify-checkpoint", str(tmp_path)).exit_code == 0


def test_usage_errors_exit_2(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(1)}, path)
    assert _invoke("verify-checkpoint", str(path), "--step", "3").exit_code == 2
    assert _invoke("verify-checkpoint", str(path), "--step", "-1", "--trace", str(tmp_path)).exit_code == 2
    assert _invoke("verify-checkpoint").exit_code == 2


def test_dcp_flipped_data_byte_is_caught_by_the_chunk_crc(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.randn(10_000), "step": 5}, checkpoint_id=str(folder), no_dist=True)
    assert verify_checkpoint(folder).ok and verify_checkpoint(folder).step == 5
    data = next(folder.glob("*.distcp"))
    flip_byte(data, data.stat().st_size // 2)
    result = _invoke("verify-checkpoint", str(folder), "--json")
    assert result.exit_code == 1, result.output
    assert [f["kind"] for f in json.loads(result.stdout)["report"]["findings"]] == ["file-damaged"]


def test_parallel_and_sequential_measuring_agree_and_threads_are_restored(tmp_path):
    from sdc_forensics.checkpoint import VerifyOptions

    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(20)}
    tensors["bad"] = torch.tensor([1.0, float("inf")])
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    threads = torch.get_num_threads()
    parallel = verify_checkpoint(path, options=VerifyOptions(workers=4))
    assert torch.get_num_threads() == threads
    sequential = verify_checkpoint(path, options=VerifyOptions(workers=1))
    assert parallel.tensors == sequential.tensors and parallel.files == sequential.files
    assert [f.subject for f in parallel.findings] == ["bad"]


def test_hf_bin_index_with_torch_shards(tmp_path):
    torch.save({"a": torch.ones(40)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.zeros(3)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(
        json.dumps({"weight_map": {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}})
    )
    report = verify_checkpoint(tmp_path)
    assert report.ok and sorted(t.key for t in report.tensors) == ["a", "b"]
    start, size = zip_member_offset(tmp_path / "pytorch_model-00001-of-00002.bin", "/data/0")
    flip_byte(tmp_path / "pytorch_model-00001-of-00002.bin", start + 7)
    result = _invoke("verify-checkpoint", str(index))
    assert result.exit_code == 1 and "file-damaged" in result.output
    index.write_text(
        json.dumps({"weight_map": {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00001-of-00002.bin"}})
    )
    bad = _invoke("verify-checkpoint", str(index))
    assert bad.exit_code == 3 and "does not hold it" in bad.output


def test_a_file_named_unlike_its_note_is_not_verifiable_against_it_not_corrupt(tmp_path):
    """A trial user checked DeepSpeed's own global_step10 folder (and zero_to_fp32.py's output) against
    the trace's note of checkpoint 10: every tensor 'unexpected', every noted one 'missing', verdict
    corrupt, on a clean run whose weights were bit for bit the noted ones. None of its tensors is named
    as the note's: it cannot be compared, which is not-verifiable (exit 4), never damage."""
    from sdc_forensics.checkpoint.findings import ANOTHER_LAYOUT
    from sdc_forensics.forensics.files import CheckpointFile, replayable
    from sdc_forensics.statedict import state_digests
    from sdc_forensics.trace.checkpoints import CheckpointNote

    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    noted = {"model": weights, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2, 3)}}}}
    note = CheckpointNote(step=10, path=str(tmp_path / "step-10.pt"), tensors=state_digests(noted, 0))
    other = tmp_path / "converted.pt"
    torch.save({"module": {"encoder.w": weights["w"], "encoder.b": weights["b"]}}, other)
    report = verify_checkpoint(other, note=note)
    [finding] = report.findings
    assert finding.kind is FindingKind.NOT_VERIFIABLE and finding.subject == ANOTHER_LAYOUT
    assert "step-10.pt" in finding.detail
    assert not replayable(CheckpointFile(path=str(other), report=report, error=""))
    # a file that shares the note's names is still compared tensor by tensor
    torch.save({"model": {"w": weights["w"]}}, tmp_path / "partial.pt")
    kinds = {f.kind for f in verify_checkpoint(tmp_path / "partial.pt", note=note).findings}
    assert FindingKind.MISSING_TENSOR in kinds
