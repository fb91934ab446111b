"""Hostile checkpoints and certificates (issue #9): each crash site found by mutation ends in one
line on stderr and exit 3 (unreadable or invalid input), never a traceback or exit 1, and the
input is left unchanged. One test per site, each building its file in ``tmp_path``.

Over 400 lines on purpose: one list of hostile checkpoint files, each a few lines, read as a catalogue.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from sdc_forensics.checkpoint import open_checkpoint
from sdc_forensics.cli.main import cli
from sdc_forensics.errors import CheckpointError
from tests.factories import assert_refused, write_safetensors_raw

F32_4 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def _run_bad(path: Path, *extra: str, args: tuple[str, ...] | None = None) -> str:
    """``verify-checkpoint PATH`` (or ``args``) on a hostile input: ``factories.assert_refused``."""
    return assert_refused(list(args) if args is not None else ["verify-checkpoint", str(path), *extra], path)


# ---------------------------------------------------------------------------------------------
# torch.save zip archives


def _pt(tmp_path: Path) -> bytes:
    path = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.ones(4)}, "step": 2}, path)
    return path.read_bytes()


def test_pt_missing_its_first_byte(tmp_path):
    """``_member_bytes``: the archive's offsets shift by one; was ``struct.error``."""
    path = tmp_path / "x.pt"
    path.write_bytes(_pt(tmp_path)[1:])
    assert "missing at its start" in _run_bad(path)


@pytest.mark.parametrize("which", [0, -1])
def test_pt_zip_entry_name_with_a_flipped_byte(tmp_path, which):
    """``_check_archive``: a name flagged UTF-8 that no longer decodes; was ``UnicodeDecodeError``."""
    raw = bytearray(_pt(tmp_path))
    entries = [i for i in range(len(raw)) if raw[i : i + 4] == b"PK\x01\x02"]
    raw[entries[which] + 46 + 1] ^= 0x80  # second byte of that central-directory entry's name
    path = tmp_path / "x.pt"
    path.write_bytes(bytes(raw))
    assert "not valid UTF-8" in _run_bad(path)


def _rezipped(source: Path, target: Path, cut: dict[str, int]) -> Path:
    """``source``'s members rewritten into ``target`` (stored, CRC-32 of the new bytes), the ones
    named in ``cut`` shortened to that many bytes."""
    import zipfile

    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as out:
        for name in src.namelist():
            data = src.read(name)
            out.writestr(name, data[: cut[name.split("/", 1)[1]]] if name.split("/", 1)[1] in cut else data)
    return target


def test_pt_storage_member_shorter_than_its_tensor(tmp_path):
    """``_check_storage_sizes``: ``torch.load(mmap=True)`` read the bytes after a short member as the tensor's
    (a consistent CRC-32), and the file was VERIFIED; torch.load without mmap refuses it."""
    torch.manual_seed(0)
    source = tmp_path / "src.pt"
    torch.save({"w": torch.randn(16, 8), "b": torch.randn(16), "view": torch.arange(10)[2:5]}, source)
    assert _run_verify(_rezipped(source, tmp_path / "same.pt", {})) == 0  # rebuilt whole: still read
    assert "holds 8 bytes, but the pickle declares 512" in _run_bad(_rezipped(source, tmp_path / "x.pt", {"data/0": 8}))


def _run_verify(path: Path) -> int:
    return CliRunner().invoke(cli, ["verify-checkpoint", str(path)]).exit_code


# ---------------------------------------------------------------------------------------------
# safetensors and Hugging Face indexes


def _raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize(
    "header",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
    ids=["top-level", "in-an-entry"],
)
def test_safetensors_header_nested_deeper_than_python_decodes(tmp_path, header):
    """``safetensors_reader._parse``: was ``RecursionError``."""
    assert "nested too deeply" in _run_bad(_raw_safetensors(tmp_path / "x.safetensors", header))


def test_safetensors_dtype_that_is_a_list(tmp_path):
    """``safetensors_reader._entry``: ``code not in DTYPES`` hashed a list; was ``TypeError``."""
    header = {"a": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}
    assert "unknown dtype" in _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", header, bytes(16)))


def test_safetensors_integer_of_5000_digits(tmp_path):
    """Python refuses to convert it; was ``ValueError``."""
    header = b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 16]}}'
    assert "digits" in _run_bad(_raw_safetensors(tmp_path / "x.safetensors", header, bytes(16)))


@pytest.mark.parametrize("shape", [[0, 2**63], [2**63, 0], [2**62, 4, 0]])
def test_safetensors_zero_size_shape_with_a_dimension_beyond_int64(tmp_path, shape):
    """Zero bytes, so the offsets agree, but ``view`` overflowed; was ``TypeError``/``RuntimeError``."""
    header = {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}
    line = _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", header, b""))
    assert "invalid shape" in line or "overflows 64 bits" in line


def _hf(tmp_path: Path, index: str | bytes) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.ones(4)}, folder / "model-00001-of-00001.safetensors")
    path = folder / "model.safetensors.index.json"
    path.write_bytes(index if isinstance(index, bytes) else index.encode())
    return folder


def test_hf_index_nested_deeper_than_python_decodes(tmp_path):
    """``hf_index.read_index``: was ``RecursionError``."""
    folder = _hf(tmp_path, "[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in _run_bad(folder / "model.safetensors.index.json")
    assert "nested too deeply" in _run_bad(folder)


def test_hf_index_naming_a_5000_character_shard(tmp_path):
    """``is_file()`` raised ``OSError`` (ENAMETOOLONG) for the shard path."""
    folder = _hf(tmp_path, json.dumps({"weight_map": {"a": "x" * 5000 + ".safetensors"}}))
    assert "longer than a file name" in _run_bad(folder / "model.safetensors.index.json")
    assert "longer than a file name" in _run_bad(folder)


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint metadata with wrong-typed fields


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "src"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"w": torch.randn(8, 4), "b": torch.zeros(4)}, "step": 3}, checkpoint_id=str(folder), no_dist=True
        )
    return folder


def _info(meta, fqn: str = "model.w"):
    return next(info for index, info in meta.storage_data.items() if index.fqn == fqn)


def _set(obj, name, value):
    object.__setattr__(obj, name, value)  # MetadataIndex is frozen; the others are not


# name -> mutation of the (trusted, our own) Metadata object; the site each one crashed
DCP_MUTATIONS = {
    "offset-a-string": lambda m: _set(_info(m), "offset", "0"),  # _check: '<' between str and int
    "length-a-float": lambda m: _set(_info(m), "length", 10.5),  # _read_chunk: slice indices
    "file-name-missing": lambda m: m.storage_data.__setitem__(
        next(k for k in m.storage_data if k.fqn == "model.w"), None
    ),
    "chunks-none": lambda m: _set(m.state_dict_metadata["model.w"], "chunks", None),  # _check: not iterable
    "chunk-not-a-chunk": lambda m: m.state_dict_metadata["model.w"].chunks.__setitem__(
        0, 5
    ),  # _check_coverage: AttributeError
    "chunk-offsets-none": lambda m: _set(
        m.state_dict_metadata["model.w"].chunks[0], "offsets", None
    ),  # _check_coverage
    "chunk-sizes-a-string": lambda m: _set(
        m.state_dict_metadata["model.w"].chunks[0], "sizes", "ab"
    ),  # _check_coverage
    "size-an-int": lambda m: _set(m.state_dict_metadata["model.w"], "size", 5),  # _check: tuple(5)
    "size-of-strings": lambda m: _set(m.state_dict_metadata["model.w"], "size", ("8", "4")),
    "properties-none": lambda m: _set(m.state_dict_metadata["model.w"], "properties", None),  # tensors: .dtype of None
    "dtype-a-string": lambda m: _set(m.state_dict_metadata["model.w"].properties, "dtype", "float32"),
    "storage-key-a-string": lambda m: m.storage_data.__setitem__("zz", _info(m)),  # _check: index.fqn
    "state-key-an-int": lambda m: m.state_dict_metadata.__setitem__(5, m.state_dict_metadata["model.w"]),
    "transforms-an-int": lambda m: _set(_info(m), "transform_descriptors", 5),
}


@pytest.mark.parametrize("mutation", sorted(DCP_MUTATIONS))
def test_dcp_metadata_field_of_the_wrong_type(dcp_source, tmp_path, mutation):
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_source, folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    DCP_MUTATIONS[mutation](meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    assert ".metadata" in _run_bad(folder)


def _build_on_a_class(cls: bytes, attr: str, value_ops: bytes) -> bytes:
    """Pickle opcodes that BUILD ``(None, {attr: value})`` onto the allow-listed class ``pathlib.<cls>``: a setattr on it."""
    return b"cpathlib\n" + cls + b"\nN}X" + len(attr).to_bytes(4, "little") + attr.encode() + value_ops + b"s\x86b0"


def test_dcp_metadata_that_sets_attributes_of_a_class_it_may_name_is_refused_and_undone(dcp_source, tmp_path):
    """A trial user's crafted ``.metadata``: BUILD onto ``pathlib.PosixPath`` (allow-listed) set ``parts = ()`` and
    ``is_relative_to = PosixPath``, which defeated the check that data files lie inside the checkpoint for the whole
    process: every item read from ``../outside``, VERIFIED. No forbidden global, no link."""
    import pathlib

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    outside = tmp_path / "outside"
    outside.mkdir()
    data = next(dcp_source.glob("*.distcp"))
    shutil.copy(data, outside / data.name)
    folder = tmp_path / "dcp"
    folder.mkdir()
    meta = pickle.loads((dcp_source / ".metadata").read_bytes())
    for key, info in list(meta.storage_data.items()):
        meta.storage_data[key] = _StorageInfo(f"../outside/{data.name}", info.offset, info.length)
    raw = pickle.dumps(meta, protocol=2)
    prefix = _build_on_a_class(b"PosixPath", "parts", b")") + _build_on_a_class(
        b"PosixPath", "is_relative_to", b"cpathlib\nPosixPath\n"
    )
    (folder / ".metadata").write_bytes(raw[:2] + prefix + raw[2:])
    line = _run_bad(folder)
    assert "changes attributes of PosixPath" in line
    assert "parts" not in vars(pathlib.PosixPath) and "is_relative_to" not in vars(pathlib.PosixPath)
    assert pathlib.PosixPath("/a/b").parts == ("/", "a", "b")
    (folder / ".metadata").write_bytes(raw)  # the same escape without the BUILDs: refused by the inside check
    assert "outside" in _run_bad(folder)


def test_dcp_chunk_zip_entry_name_with_a_flipped_byte(dcp_source, tmp_path):
    """``dcp_reader._check_crc``: was ``UnicodeDecodeError``."""
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_source, folder)
    data = next(folder.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    start = 0
    while (start := raw.find(b"PK\x01\x02", start + 1)) >= 0:
        raw[start + 46 + 1] ^= 0x80
    data.write_bytes(bytes(raw))
    assert "not valid UTF-8" in _run_bad(folder)


# ---------------------------------------------------------------------------------------------
# certificates with wrong field types (read by verify-checkpoint --certificate)


def _certificate(tmp_path: Path, checkpoint: Path) -> dict:
    entry = {
        "step": 2,
        "path": str(checkpoint.resolve()),
        "status": "clean",
        "reasons": [],
        "format": "safetensors",
        "weights_digest": "",
        "files": [{"name": checkpoint.name, "size_bytes": 1, "digest": "0" * 16}],
        "evidence": [{"kind": "nonfinite", "subject": "a", "expected": "", "found": "", "detail": ""}],
    }
    return {
        "format": "sdc-forensics-certificate",
        "certificate_version": 2,
        "tool_version": "0",
        "created_utc": "",
        "seed": 7,
        "trace_dir": "",
        "first_divergent_step": None,
        "resume_step": 2,
        "resume_path": str(checkpoint),
        "checkpoints": [entry],
    }


def _entry(doc: dict) -> dict:
    return doc["checkpoints"][0]


CERTIFICATE_MUTATIONS = {
    "checkpoints-an-int": lambda d: d.__setitem__("checkpoints", 5),
    "entry-a-list": lambda d: d.__setitem__("checkpoints", [[1, 2]]),  # was AttributeError (.get on a list)
    "entry-a-string": lambda d: d.__setitem__("checkpoints", ["x"]),
    "step-a-string": lambda d: _entry(d).__setitem__("step", "2"),
    "path-a-number": lambda d: _entry(d).__setitem__("path", 3),
    "status-a-list": lambda d: _entry(d).__setitem__("status", ["clean"]),
    "reasons-of-numbers": lambda d: _entry(d).__setitem__("reasons", [1, 2]),  # rendered with "; ".join later
    "file-a-string": lambda d: _entry(d).__setitem__("files", ["f"]),
    "file-size-a-string": lambda d: _entry(d)["files"][0].__setitem__("size_bytes", "1"),
    "evidence-subject-a-number": lambda d: _entry(d)["evidence"][0].__setitem__("subject", 5),
    "evidence-kind-unknown": lambda d: _entry(d)["evidence"][0].__setitem__("kind", "zzz"),
    "seed-a-string": lambda d: d.__setitem__("seed", "7"),
    "seed-negative": lambda d: d.__setitem__("seed", -1),
    "first-divergent-step-a-string": lambda d: d.__setitem__("first_divergent_step", "3"),
    "resume-path-a-list": lambda d: d.__setitem__("resume_path", ["a"]),
    "version-a-list": lambda d: d.__setitem__("certificate_version", [2]),
}


@pytest.mark.parametrize("mutation", sorted(CERTIFICATE_MUTATIONS))
def test_certificate_field_of_the_wrong_type(tmp_path, mutation):
    checkpoint = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4)}, checkpoint)
    doc = _certificate(tmp_path, checkpoint)
    CERTIFICATE_MUTATIONS[mutation](doc)
    cert = tmp_path / "cert.json"
    cert.write_text(json.dumps(doc))
    line = _run_bad(tmp_path, args=("verify-checkpoint", str(checkpoint), "--certificate", str(cert)))
    assert "cert.json" in line


def test_certificate_nested_deeper_than_python_decodes(tmp_path):
    checkpoint = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4)}, checkpoint)
    cert = tmp_path / "cert.json"
    cert.write_text('{"format": "sdc-forensics-certificate", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in _run_bad(
        tmp_path, args=("verify-checkpoint", str(checkpoint), "--certificate", str(cert))
    )


def test_a_valid_certificate_still_reads(tmp_path):
    from sdc_forensics.decide.certificate import read_certificate

    checkpoint = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4)}, checkpoint)
    cert = tmp_path / "cert.json"
    cert.write_text(json.dumps(_certificate(tmp_path, checkpoint)))
    read = read_certificate(cert)
    assert read.seed == 7 and read.checkpoints[0].files[0].size_bytes == 1 and read.resume_step == 2


# ---------------------------------------------------------------------------------------------
# The CLI's last line of defence is limited to errors raised under a reader


def test_an_unchecked_error_under_a_reader_is_exit_3_one_line(tmp_path, monkeypatch):
    from sdc_forensics.checkpoint import safetensors_reader

    def unchecked(path, mapped, *rest):
        raise TypeError("a malformed input no check caught")

    monkeypatch.setattr(safetensors_reader, "_parse", unchecked)
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(4)}, path)
    line = _run_bad(path)
    assert "TypeError" in line and "safetensors_reader" in line and "does not check yet" in line
    assert "no check caught" in line  # the stub's own error, not a call with the wrong arguments


def test_the_same_error_outside_the_readers_stays_a_bug(tmp_path, monkeypatch):
    """A TypeError in verification (not under a reader) is not dressed up as bad input."""
    import sdc_forensics.checkpoint as checkpoint

    def buggy(reader, options=None):
        raise TypeError("a bug in verification")

    monkeypatch.setattr(checkpoint, "verify_checkpoint", buggy)
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(4)}, path)
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(path)])
    assert isinstance(result.exception, TypeError) and result.exit_code == 1


# ---------------------------------------------------------------------------------------------
# A small property test of the safetensors header parser: any JSON header either opens or
# raises CheckpointError, never anything else.

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_entry_spec = (
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "I64", "BOOL", "F31"]) | _json,
            "shape": st.lists(st.integers(min_value=-2, max_value=2**64) | _json, max_size=3) | _json,
            "data_offsets": st.lists(st.integers(min_value=-2, max_value=2**64), min_size=0, max_size=3) | _json,
        }
    )
    | _json
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=4), _entry_spec, max_size=3) | _json, data_len=st.integers(0, 64))
def test_safetensors_header_parser_raises_only_checkpoint_error(tmp_path, header, data_len):
    path = tmp_path / "p.safetensors"
    write_safetensors_raw(path, header, bytes(data_len))
    try:
        with open_checkpoint(path) as reader:
            for _ in reader.tensors():
                pass
    except CheckpointError:
        pass


# ---------------------------------------------------------------------------------------------
# Tensors that are not dense CPU tensors (found by tests/fuzz/test_fuzz_pt.py): refused when read


def _pt_with_payload_pickle(tmp_path: Path, pkl: bytes) -> Path:
    import zipfile

    path = tmp_path / "x.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pkl)
        archive.writestr("archive/byteorder", b"little")
        archive.writestr("archive/version", b"3\n")
    return path


def test_pt_meta_tensor_without_data(tmp_path):
    """``_rebuild_meta_tensor_no_storage`` is on the weights-only allow-list: a 124-byte pickle made a
    tensor with no data, and verification's digest raised ``NotImplementedError`` (traceback, exit 1)."""
    pkl = (
        b"\x80\x02}q\x00X\x05\x00\x00\x00modelq\x01ctorch._utils\n_rebuild_meta_tensor_no_storage\nq\x02"
        b"(ctorch\nfloat32\nq\x03))\x89tq\x04Rq\x05s."
    )
    assert "device meta" in _run_bad(_pt_with_payload_pickle(tmp_path, pkl))


@pytest.mark.parametrize("kind", ["sparse", "nested", "float4"])
def test_pt_tensor_that_is_not_dense(tmp_path, kind):
    """Sparse and nested tensors, and a packed float4 dtype, load with ``weights_only``; verification
    raised (``RuntimeError``/``NotImplementedError``, a traceback) instead of saying why."""
    tensor = {
        "sparse": lambda: torch.eye(3).to_sparse(),
        "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "float4": lambda: torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    }[kind]()
    path = tmp_path / "x.pt"
    torch.save({"t": tensor}, path)
    assert "cannot be verified" in _run_bad(path)


def test_pt_quantized_tensor_does_not_crash_the_process(tmp_path):
    """A genuine ``torch.quantize_per_tensor`` checkpoint: verification's digest crashed the
    interpreter (SIGSEGV) in torch. Run in a subprocess so that a regression fails one test only."""
    import subprocess
    import sys

    path = tmp_path / "q.pt"
    torch.save({"q": torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)}, path)
    before = path.read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "sdc_forensics.cli.main", "verify-checkpoint", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and "dtype qint8" in lines[0], done.stderr
    assert path.read_bytes() == before


def test_dcp_chunk_holding_a_quantized_tensor(dcp_source, tmp_path):
    """A DCP chunk is a ``torch.save`` archive: one holding a quantized tensor, with metadata saying
    ``qint8``, reached the same crash; the metadata's dtype is refused first."""
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_source, folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    _set(meta.state_dict_metadata["model.b"].properties, "dtype", torch.qint8)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    assert "plain torch dtype" in _run_bad(folder)


@pytest.mark.parametrize("value", ["a\x00b", "\ud800"], ids=["nul-byte", "lone-surrogate"])
@pytest.mark.parametrize("field", ["entry-path", "resume_path", "trace_dir"])
def test_certificate_path_that_is_no_path(tmp_path, field, value):
    """Found by tests/fuzz/test_fuzz_certificate.py: ``Certificate.entry_for`` resolved an entry's
    path and raised ``ValueError``/``UnicodeEncodeError`` outside the reader (traceback, exit 1).
    ``resume_path`` and ``trace_dir`` name files too and are checked the same way."""
    checkpoint = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4)}, checkpoint)
    doc = _certificate(tmp_path, checkpoint)
    if field == "entry-path":
        _entry(doc)["path"] = value
    else:
        doc[field] = value
    cert = tmp_path / "cert.json"
    cert.write_text(json.dumps(doc))
    line = _run_bad(tmp_path, args=("verify-checkpoint", str(checkpoint), "--certificate", str(cert)))
    assert "cert.json" in line and "a file path" in line


@pytest.mark.parametrize(
    "spec",
    [{"dtype": "F31", "shape": [4], "data_offsets": [0, 16]}, {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}],
    ids=["unknown-dtype", "offsets-disagree"],
)
def test_safetensors_tensor_name_of_10000_characters(tmp_path, spec):
    """Found by tests/fuzz/test_fuzz_safetensors.py: the messages printed the whole name, so one
    crafted header made a 10,000-character "line". Names are clipped to 80 characters."""
    line = _run_bad(write_safetensors_raw(tmp_path / "x.safetensors", {"n" * 10_000: spec}, bytes(16)))
    assert "n" * 80 in line and "n" * 81 not in line and len(line) < 600


def test_pt_pickle_string_opcode_of_100000_characters(tmp_path):
    """Found by fuzzing: pickletools' ``ValueError`` quotes the whole malformed line (``S`` without
    quotes), so a 100 kB line in data.pkl became a 100 kB error line. The reason is clipped."""
    line = _run_bad(_pt_with_payload_pickle(tmp_path, b"\x80\x02S" + b"x" * 100_000 + b"\n."))
    assert "the pickle is malformed" in line and len(line) < 600


def test_dcp_chunk_whose_local_header_name_swallows_the_data(dcp_source, tmp_path):
    """Found by tests/fuzz/test_fuzz_dcp.py: a chunk's zip local header whose name length is
    enlarged (and not flagged UTF-8, so any bytes decode) makes zipfile quote 3,000 bytes of the
    chunk in its "names differ" error; the line is clipped."""
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_source, folder)
    data = next(folder.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    meta = pickle.loads((folder / ".metadata").read_bytes())
    start = _info(meta).offset
    local = raw.find(b"PK\x03\x04", start)
    raw[local + 26 : local + 28] = struct.pack("<H", 3000)
    flags = struct.unpack("<H", raw[local + 6 : local + 8])[0]
    raw[local + 6 : local + 8] = struct.pack("<H", flags & ~0x800)
    data.write_bytes(bytes(raw))
    line = _run_bad(folder)
    assert "model.w" in line and "is not a torch.save archive" in line and len(line) < 800


def test_pt_compressed_member_whose_local_header_name_swallows_the_data(tmp_path):
    """The same zipfile error for a compressed member of a ``torch.save`` file (``limits.inflate_member``)."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(_pt(tmp_path))) as archive:
        members = [(m.filename, archive.read(m)) for m in archive.infolist()]
    path = tmp_path / "x.pt"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in sorted(members, key=lambda m: not m[0].endswith("/byteorder")):  # byteorder first, deflated
            archive.writestr(
                name, data, compress_type=zipfile.ZIP_DEFLATED if name.endswith("/byteorder") else zipfile.ZIP_STORED
            )
    raw = bytearray(path.read_bytes())
    raw[26:28] = struct.pack("<H", 900)  # the first local header's name length
    raw[6:8] = struct.pack("<H", struct.unpack("<H", raw[6:8])[0] & ~0x800)
    path.write_bytes(bytes(raw))
    line = _run_bad(path)
    assert "cannot be decompressed" in line and len(line) < 600


@pytest.mark.parametrize("offset", [5, pathlib.PurePosixPath("__0_0.distcp")], ids=["an-int", "a-path"])
def test_dcp_storage_key_offset_that_is_not_offsets(dcp_source, tmp_path, offset):
    """Found by tests/fuzz/test_fuzz_dcp.py: a storage key (``MetadataIndex``) whose ``offset`` is not
    a tuple reached ``tuple(offset)`` in ``DcpReader._check``: ``TypeError``, exit 3 only through the
    CLI's last line of defence ("does not check yet"). It is checked with the other fields."""
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_source, folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    index, info = next((k, v) for k, v in meta.storage_data.items() if k.fqn == "model.w")
    del meta.storage_data[index]
    _set(index, "offset", offset)
    meta.storage_data[index] = info
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    line = _run_bad(folder)
    assert "the offset of storage key 'model.w'" in line and "does not check yet" not in line


def test_dcp_metadata_bytearray_claiming_exabytes(dcp_source, tmp_path):
    """Found by tests/fuzz/test_fuzz_dcp.py (minimised to 14 bytes): a ``.metadata`` pickle whose
    BYTEARRAY8 claims 7.6e18 bytes; CPython's unpickler, reading it from the file, sometimes (about
    one run in five) printed "SystemError: deallocated bytearray object has exported buffers" on
    stderr before the error line. The opcodes are now scanned before anything is unpickled."""
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_source, folder)
    (folder / ".metadata").write_bytes(b"\x80\x05\x96\x89t\x94b\x8c\x04si)")
    assert "bytearray8" in _run_bad(folder)


def test_a_loop_of_links_is_named_as_one_not_as_a_missing_path(tmp_path):
    """``x -> y -> x``: one line (exit 3) that says it is a link leading nowhere, not "does not exist"."""
    (tmp_path / "x").symlink_to(tmp_path / "y")
    (tmp_path / "y").symlink_to(tmp_path / "x")
    ran = CliRunner().invoke(cli, ["verify-checkpoint", str(tmp_path / "x")])
    assert ran.exit_code == 3, ran.output
    assert "symbolic link that leads to no file" in ran.output and "does not exist" not in ran.output
    assert (tmp_path / "x").is_symlink() and (tmp_path / "y").is_symlink()  # left as they were


@pytest.mark.parametrize("inside", [False, True], ids=["the-file", "a-file-of-its-folder"])
def test_a_file_this_user_cannot_read(tmp_path, monkeypatch, inside):
    """Not root: a checkpoint (or a file of its folder) with mode 000 was a ``PermissionError``
    traceback (exit 1), or click's "is not readable" (exit 2); it is one line, exit 3. Root reads
    any file, so the denial is simulated where the reader opens it."""
    import os

    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"w": torch.ones(4)}, folder / "model.safetensors")
    torch.save({"s": torch.ones(2)}, folder / "optimizer.pt")
    denied = folder / "optimizer.pt"
    real_open = os.open

    def deny(path, *args, **kwargs):
        if Path(path) == denied:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    line = _run_bad(folder if inside else denied)
    assert f"{denied}: permission denied" in line and "make it readable" in line


def test_a_checkpoint_holding_an_argparse_namespace_is_told_how_to_save_it(tmp_path):
    """``torch.save({..., "args": args})``, a common pattern: its pickle needs ``argparse.Namespace``, so
    it is refused unloaded; the line said "only load it if you trust its origin", which the tool cannot do."""
    import argparse

    path = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=0.1)}, path)
    line = _run_bad(path)
    assert "argparse.Namespace" in line and "vars(args)" in line and "trust" not in line


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="Linux's /proc")
def test_a_read_the_system_fails_is_one_line_and_exit_3():
    """A trial user's ``verify-checkpoint /proc/self/mem`` (EIO at offset 0, as a failing disk gives) was a
    62-line traceback and exit 1, which means 'corruption found'."""
    result = CliRunner().invoke(cli, ["verify-checkpoint", "/proc/self/mem"])
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "could not read it" in lines[0] and "Traceback" not in result.output


def test_a_dcp_bytes_item_changed_after_saving_is_found_by_its_crc(tmp_path):
    """A trial user changed an optimizer's lr (0.125 -> 12.5) inside a DCP bytes item: VERIFIED, exit 0.
    Only tensor chunks had their zip CRC-32 checked."""
    import struct

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save
        dcp.save({"w": torch.ones(4, 4), "optim": {"param_groups": [{"lr": 0.125}]}}, checkpoint_id=folder)
    assert CliRunner().invoke(cli, ["verify-checkpoint", str(folder)]).exit_code == 0
    meta = pickle.loads((folder / ".metadata").read_bytes())
    info = meta.storage_data[MetadataIndex("optim.param_groups.0.lr")]
    path = folder / info.relative_path
    raw = bytearray(path.read_bytes())
    at = raw.find(struct.pack(">d", 0.125), info.offset, info.offset + info.length)
    assert at >= 0
    raw[at : at + 8] = struct.pack(">d", 12.5)
    path.write_bytes(bytes(raw))
    ran = CliRunner().invoke(cli, ["verify-checkpoint", str(folder)])
    assert ran.exit_code == 1, ran.output
    assert "CRC-32 of the bytes item 'optim.param_groups.0.lr' does not match" in " ".join(ran.output.split())


def test_a_dcp_data_file_that_is_a_fifo_or_a_directory_is_said_to_be_one(dcp_source, tmp_path):
    """A trial user's FIFO (opening it would block) and directory in place of a ``.distcp`` file were each
    said to 'not exist', which sends one looking for a lost file."""
    import os

    for kind in ("fifo", "directory"):
        folder = tmp_path / kind
        shutil.copytree(dcp_source, folder)
        data = next(folder.glob("*.distcp"))
        data.unlink()
        os.mkfifo(data) if kind == "fifo" else data.mkdir()
        line = _run_bad(folder)
        assert (
            "FIFO, device or socket" if kind == "fifo" else "is a directory"
        ) in line and "does not exist" not in line


def test_a_dcp_chunk_listed_twice_is_said_to_repeat_not_to_be_missing(dcp_source, tmp_path):
    """A trial user's duplicated chunk read 'cover 200 of its 100 elements: the checkpoint is incomplete'."""
    folder = tmp_path / "dcp"
    shutil.copytree(dcp_source, folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    chunks = meta.state_dict_metadata["model.w"].chunks
    chunks.append(chunks[0])
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    line = _run_bad(folder)
    assert "chunks overlap or repeat" in line and "incomplete" not in line


def test_two_key_paths_that_join_to_one_name_keep_both_tensors(tmp_path):
    """A trial user's ``{"a.b": NaN tensor, "a": {"b": clean tensor}}`` verified (exit 0, '1 tensor'): the later
    path overwrote the earlier in the flattened state, and the NaN was never read."""
    from sdc_forensics.checkpoint import verify_checkpoint

    path = tmp_path / "collide.pt"
    torch.save({"a.b": torch.tensor([float("nan")]), "a": {"b": torch.ones(2)}}, path)
    report = verify_checkpoint(path)
    assert sorted(t.key for t in report.tensors) == ["a.b", "a.b#2"]
    assert [f.subject for f in report.findings] == ["a.b"]


def test_a_dcp_data_file_named_alone_points_at_its_directory(dcp_source):
    """A trial user's ``verify-checkpoint __0_0.distcp`` printed torch's 'archive is corrupted' for a clean file."""
    line = _run_bad(next(dcp_source.glob("*.distcp")))
    assert "data file of a torch.distributed.checkpoint directory" in line and "corrupt" not in line


def test_a_pickle_protocol_torch_cannot_read_is_said_to_be_that_not_unsafe(tmp_path):
    """A trial user's ``torch.save(..., pickle_protocol=4)`` was refused 'it could run code'; it names only allowed
    globals, and torch's weights-only loader does not read the protocol's FRAME opcode."""
    path = tmp_path / "proto4.pt"
    torch.save({"w": torch.ones(3)}, path, pickle_protocol=4)
    result = CliRunner().invoke(cli, ["verify-checkpoint", str(path)])
    if result.exit_code == 0:  # a torch whose weights-only loader reads protocol 4
        return
    line = " ".join(result.output.split())
    assert result.exit_code == 3 and "pickle protocol 4 or 5" in line and "could run code" not in line, line
