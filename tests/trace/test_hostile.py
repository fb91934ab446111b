"""Hostile traces (issue #9): each crash site found by mutation ends in one line on stderr and
exit 3 for ``inspect`` and ``bisect --trace-only``, never a traceback or exit 1 (which means
"corruption found"), and the trace directory is left unchanged. Numpy only: no torch here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, note_path, write_checkpoint_note
from tests.factories import assert_refused

COMMANDS = {"inspect": ("inspect",), "bisect": ("bisect", "--trace-only")}


def _run_bad(trace: Path, command: str) -> str:
    """``command`` on a hostile trace: ``factories.assert_refused``."""
    name, *flags = COMMANDS[command]
    return assert_refused([name, str(trace), *flags], trace)


@pytest.fixture
def trace(make_trace) -> Path:
    return make_trace(ranks=2, steps=4)


def _edit_manifest(trace: Path, edit) -> None:
    doc = json.loads((trace / "manifest.json").read_text())
    edit(doc)
    (trace / "manifest.json").write_text(json.dumps(doc))


def _rank0(doc: dict) -> dict:
    return doc["attempts"][0]["ranks"][0]


MANIFEST_MUTATIONS = {
    # manifest._from_dict: ``r.items()`` on a rank entry that is not an object (AttributeError)
    "rank-entry-a-number": lambda d: d["attempts"][0]["ranks"].__setitem__(0, 5),
    "attempt-entry-a-string": lambda d: d["attempts"].__setitem__(0, "x"),
    "attempts-an-object": lambda d: d.__setitem__("attempts", {"a": 1}),
    # the rich renderers of inspect: a string field that is a number (NotRenderableError)
    "host-a-number": lambda d: _rank0(d).__setitem__("host", 5),
    "gpu-uuid-a-list": lambda d: _rank0(d).__setitem__("gpu_uuid", ["GPU-0"]),
    "torch-version-a-number": lambda d: d["attempts"][0].__setitem__("torch_version", 2.13),
    "recipe-a-number": lambda d: d.__setitem__("recipe", 5),
    "grad-dtype-a-number": lambda d: d["fingerprint"].__setitem__("grad_dtype", 32),
    "grad-dtype-unknown": lambda d: d["fingerprint"].__setitem__(
        "grad_dtype", "float7"
    ),  # bisect's tolerance: ValueError
    "rank-a-string": lambda d: _rank0(d).__setitem__("rank", "0"),
    "start-step-beyond-max-step": lambda d: d["attempts"][0].__setitem__("start_step", 2**63),
    "world-size-a-string": lambda d: d.__setitem__("world_size", "2"),
    "world-size-zero": lambda d: d.__setitem__("world_size", 0),
    # the rank files' headers say 2: a trial user's manifest saying fewer made every all-reduce check fail (exit 1)
    "world-size-below-the-rank-files": lambda d: d.__setitem__("world_size", 1),
    "sketch-k-a-float": lambda d: d["fingerprint"].__setitem__("sketch_k", 8.0),
    "seed-negative": lambda d: d["fingerprint"].__setitem__("seed", -1),
    "fingerprint-a-list": lambda d: d.__setitem__("fingerprint", [1]),
    "node-of-rank-of-strings": lambda d: d.__setitem__("node_of_rank", ["0", "0"]),
    "reduction-unknown": lambda d: d.__setitem__("reduction", "max"),
    "determinism-a-list": lambda d: d["attempts"][0].__setitem__("determinism", [1]),
    "extra-nested-900-deep": lambda d: d.__setitem__("extra", {"x": json.loads("[" * 900 + "]" * 900)}),
    "format-version-a-list": lambda d: d.__setitem__("format_version", [1]),
    # trace/mesh.py: a sharded job's mixed precision (the replay casts the recipe's model by it)
    "casts-an-unknown-dtype": lambda d: _sharded(d, casts=[["", "float7", ""]]),
    "casts-not-triples": lambda d: _sharded(d, casts=[["0"]]),
    "casts-a-string": lambda d: _sharded(d, casts="0"),
    "casts-module-a-number": lambda d: _sharded(d, casts=[[0, "bfloat16", ""]]),
    "casts-module-name-of-5000-characters": lambda d: _sharded(d, casts=[["a" * 5000, "bfloat16", ""]]),
    "param-dtype-unknown": lambda d: _sharded(d, param_dtype="int8", reduce_dtype="float32"),
    "param-dtype-without-reduce-dtype": lambda d: _sharded(d, param_dtype="bfloat16"),
}


def _sharded(doc: dict, **fields) -> None:
    """Make the (2-rank) manifest a sharded job's, with ``fields`` in its mesh."""
    doc["parallel"] = {
        "kind": "fsdp",
        "shape": [2],
        "dim_names": ["shard"],
        "shard_dim": 0,
        "coords": [[0], [1]],
    } | fields


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("mutation", sorted(MANIFEST_MUTATIONS))
def test_manifest_field_of_the_wrong_type(trace, mutation, command):
    _edit_manifest(trace, MANIFEST_MUTATIONS[mutation])
    assert "manifest.json" in _run_bad(trace, command)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_manifest_nested_deeper_than_python_decodes(trace, command):
    (trace / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in _run_bad(trace, command)


# ---------------------------------------------------------------------------------------------
# checkpoint notes (trace/checkpoints.read_checkpoint_notes)


def _note(trace: Path) -> Path:
    return write_checkpoint_note(
        trace,
        CheckpointNote(
            step=2,
            path="ckpt/step-00000002.pt",
            weights_digest="0123456789abcdef",
            tensors={"w": "fedcba9876543210"},
            agreeing_ranks=(0, 1),
        ),
    )


def _set(doc: dict, key: str, value) -> dict:
    doc[key] = value
    return doc


# name -> the note document to write instead of a valid one
NOTE_MUTATIONS = {
    "not-an-object": lambda d: [1, 2],
    "step-a-string": lambda d: _set(d, "step", "2"),  # bisect: '>=' between str and int
    "step-missing": lambda d: {k: v for k, v in d.items() if k != "step"},
    "path-a-number": lambda d: _set(d, "path", 3),  # inspect's renderer
    "tensors-a-list": lambda d: _set(d, "tensors", [1]),
    "tensor-digest-a-number": lambda d: _set(d, "tensors", {"w": 5}),
    "weights-digest-rich-markup": lambda d: _set(d, "weights_digest", "[/w]"),  # not a digest; rich would choke on it
    "blessed-a-string": lambda d: _set(d, "blessed", "yes"),
    "agreeing-ranks-of-strings": lambda d: _set(d, "agreeing_ranks", ["0"]),
    "attempt-negative": lambda d: _set(d, "attempt", -1),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("mutation", sorted(NOTE_MUTATIONS))
def test_checkpoint_note_field_of_the_wrong_type(trace, mutation, command):
    path = _note(trace)
    path.write_text(json.dumps(NOTE_MUTATIONS[mutation](json.loads(path.read_text()))))
    assert "checkpoint note" in _run_bad(trace, command)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_checkpoint_note_nested_deeper_than_python_decodes(trace, command):
    """``read_checkpoint_notes``: was ``RecursionError``."""
    note_path(trace, 2, 0).parent.mkdir(parents=True, exist_ok=True)
    note_path(trace, 2, 0).write_text('{"step": 2, "path": "x", "tensors": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in _run_bad(trace, command)


# ---------------------------------------------------------------------------------------------
# rank files: a record with a valid checksum and an impossible step


def _set_step(trace: Path, index: int, step: int) -> None:
    """Give record ``index`` of rank 0's file ``step`` and a valid checksum (a crafted file)."""
    path = trace / "rank-00000.attempt-000.sdct"
    raw = path.read_bytes()
    records = np.frombuffer(raw[F.HEADER_SIZE :], dtype=F.record_dtype(8)).copy()
    records["step"][index] = step
    F.seal(records)
    path.write_bytes(raw[: F.HEADER_SIZE] + records.tobytes())


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("index", [0, -1], ids=["first-record", "last-record"])
@pytest.mark.parametrize("step", [2**63 - 1, F.MAX_STEP + 1, -1])
def test_record_step_out_of_range_with_a_valid_checksum(trace, command, index, step):
    """``reader._dense_first_step``: 2^63-1 overflowed ``np.arange`` (first record) or made the step
    windows span 2^63 steps (last record)."""
    _set_step(trace, index, step)
    assert "valid checksum" in _run_bad(trace, command)


def test_the_largest_allowed_step_is_still_read(trace):
    """The bound is a bound, not an off-by-one: a record at MAX_STEP is data, not an error."""
    from sdc_forensics.trace.reader import Trace

    _set_step(trace, -1, F.MAX_STEP)
    opened = Trace.open(trace)
    assert opened.step_range() == (0, F.MAX_STEP)


# ---------------------------------------------------------------------------------------------
# strings that are strings, but look like rich markup, are printed as they are


def test_inspect_prints_markup_in_trace_strings_literally(trace):
    _edit_manifest(trace, lambda d: (_rank0(d).__setitem__("host", "[/]"), d.__setitem__("recipe", "[bold]x[/bold]")))
    _note(trace)
    result = CliRunner().invoke(cli, ["inspect", str(trace)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "[/]" in result.stderr and "[bold]x[/bold]" in result.stderr


# ---------------------------------------------------------------------------------------------
# found by tests/fuzz/test_fuzz_trace.py


@pytest.mark.parametrize(
    "name", ["rank-00000.attempt-000.sdct", "rank-00003.attempt-000.sdct"], ids=["replacing-a-rank-file", "extra"]
)
def test_a_directory_named_like_a_rank_file(trace, name):
    """``reader._open_rank_file`` read it with ``np.fromfile``: ``IsADirectoryError``, a traceback and
    exit 1 ("corruption found"). It is damage (``bad_header``), listed, and the rest is read."""
    path = trace / name
    if path.exists():
        path.unlink()
    path.mkdir()
    result = CliRunner().invoke(cli, ["inspect", str(trace), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    damage = {(d["kind"], d["detail"]) for d in json.loads(result.stdout)["damage"]}
    assert ("bad_header", f"{name} is not a regular file; ignored") in damage
    result = CliRunner().invoke(cli, ["bisect", str(trace), "--trace-only", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    from sdc_forensics.exitcodes import EXIT_BY_VERDICT

    doc = json.loads(result.stdout)
    # the verdict's code, but a clean verdict of the trace alone is 4 (nothing replayed)
    assert result.exit_code == doc["exit_code"] == (4 if doc["verdict"] == "clean" else EXIT_BY_VERDICT[doc["verdict"]])


def test_a_rank_file_whose_header_alone_says_another_world_size_is_ignored_as_foreign(make_trace):
    import numpy as np

    from sdc_forensics.trace.reader import Trace

    path = make_trace(ranks=3, steps=4)
    rank_file = path / "rank-00002.attempt-000.sdct"
    raw = bytearray(rank_file.read_bytes())
    header = np.frombuffer(bytes(raw[: F.HEADER_SIZE]), dtype=F.HEADER_DTYPE).copy()
    header["world_size"] = 8
    header["checksum"] = F.checksums(header)[0]
    raw[: F.HEADER_SIZE] = header.tobytes()
    rank_file.write_bytes(bytes(raw))
    trace = Trace.open(path)
    assert sorted(f.rank for f in trace.files) == [0, 1]
    foreign = [d for d in trace.damage() if d.kind == "bad_header"]
    assert len(foreign) == 1 and "says world size 8, the manifest 3" in foreign[0].detail
