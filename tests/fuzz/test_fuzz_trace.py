"""Fuzzing trace directories (``trace/reader.py``, ``trace/manifest.py``): rank files damaged byte
by byte; records and file headers rewritten with any field values *and valid checksums* (what
a foreign or crafted file looks like: the checksum cannot tell); records reordered, duplicated
or dropped; the manifest damaged or rewritten field by field; files removed, added or replaced
by directories. Property: what ``inspect``, ``export`` and ``bisect --trace-only`` compute
(``readers.read_trace``) returns or raises ``TraceError``; the trace is unchanged. Numpy only."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, write_checkpoint_note
from tests.factories import Fault, write_trace
from tests.fuzz.harness import edit_json, hostile_call, json_edits, json_values, mutate, mutations
from tests.fuzz.readers import TRACE_ERRORS, read_trace

K = 8  # the corpus traces' sketch_k
RECORD = F.record_size(K)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@functools.cache
def corpus() -> dict[str, dict[str, bytes]]:
    """Two small traces as ``{relative path: bytes}``: ``records`` (2 ranks, 5 steps, audits, one
    replica diverging at step 3, a checkpoint note) and ``resumed`` (written in bulk, two attempts)."""
    with tempfile.TemporaryDirectory() as tmp:
        records = write_trace(
            Path(tmp) / "records", ranks=2, steps=5, fault=Fault(kind="weights", step=3, rank=1), audit_every=2
        )
        write_checkpoint_note(
            records,
            CheckpointNote(
                step=2,
                path="ckpt/step-00000002.pt",
                weights_digest="0123456789abcdef",
                tensors={"w": "fedcba9876543210"},
                agreeing_ranks=(0, 1),
            ),
        )
        resumed = write_trace(Path(tmp) / "resumed", ranks=2, steps=5, bulk=True)
        write_trace(resumed, ranks=2, steps=3, bulk=True, attempt=1, start_step=3)
        return {"records": _files(records), "resumed": _files(resumed)}


def _rank_files(files: dict[str, bytes]) -> list[str]:
    return sorted(name for name in files if name.endswith(".sdct"))


def check_trace(folder: Path, files: dict[str, bytes], dirs: tuple[str, ...] = (), kind: str = "trace"):
    """Write ``files`` (and empty directories ``dirs``) as a trace under ``folder`` and read it
    (``kind`` names the input fuzzed, for the benchmark's tally)."""
    trace = folder / "trace"
    trace.mkdir()
    for name in dirs:
        (trace / name).mkdir(parents=True, exist_ok=True)
    for name, raw in sorted(files.items()):
        if (trace / name).parent.is_file() or (trace / name).is_dir():
            continue  # "checkpoints" is a file here: its notes cannot exist
        (trace / name).parent.mkdir(parents=True, exist_ok=True)
        (trace / name).write_bytes(raw)
    return hostile_call(kind, lambda: read_trace(trace), allowed=TRACE_ERRORS, watch=folder)


_TRACE = st.sampled_from(["records", "resumed"])


# ---------------------------------------------------------------------------------------------
# Rank files


def _record_hot(raw: bytes) -> tuple[int, ...]:
    starts = range(F.HEADER_SIZE, len(raw), RECORD)
    fields = [F.record_dtype(K).fields[name][1] for name in ("kind", "step", "rank", "microbatch_count", "checksum")]
    return (0, 8, 12, 14, 16, 56, *(s + f for s in starts for f in fields))


@st.composite
def mutated_rank_file(draw):
    files = dict(corpus()[draw(_TRACE)])
    name = draw(st.sampled_from(_rank_files(files)))
    files[name] = mutate(files[name], draw(mutations(_record_hot(files[name]))))
    return files


@given(files=mutated_rank_file())
def test_trace_rank_file_mutated(scratch, files):
    """Flips, truncations (torn tails), splices and boundary integers in a rank file."""
    with scratch() as folder:
        check_trace(folder, files)


_I64 = st.integers(-(2**63), 2**63 - 1)
_U64 = st.integers(0, 2**64 - 1)
_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=32)
#: record field -> strategy of values (boundaries well represented)
_FIELD_VALUES = {
    "magic": st.sampled_from([F.RECORD_MAGIC, 0]),
    "kind": st.integers(0, 7) | st.integers(0, 2**16 - 1),
    "flags": st.integers(0, 2**16 - 1),
    "step": st.sampled_from([-1, 0, 1, 2, 3, 7, F.MAX_STEP, F.MAX_STEP + 1, 2**63 - 1]) | _I64,
    "rank": st.sampled_from([0, 1, 2, 2**31, 2**32 - 1]),
    "attempt": st.sampled_from([0, 1, 2, 999, 2**32 - 1]),
    "time_ns": _I64,
    "loss": st.floats(allow_nan=True, allow_infinity=True),
    "input_digest": _U64,
    "microbatch_digest": _U64,
    "local_digest": _U64,
    "reduced_digest": _U64,
    "weights_digest": _U64,
    "aux_digest": _U64,
    "microbatch_first": st.sampled_from([-1, 0, 2**62, 2**63 - 1]) | _I64,
    "microbatch_count": st.sampled_from([0, 1, 2**20, 2**31, 2**32 - 1]),
    "nonfinite_local": st.integers(0, 2**32 - 1),
    "nonfinite_reduced": st.integers(0, 2**32 - 1),
    "nonfinite_weights": st.integers(0, 2**32 - 1),
    "local_norm": _FLOAT,
    "reduced_norm": _FLOAT,
    "local_max_abs": _FLOAT,
    "reduced_max_abs": _FLOAT,
    "weights_norm": _FLOAT,
    "aux_rank": st.sampled_from([-1, 0, 1, 2, 2**31 - 1, -(2**31)]),
    "aux_value": st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1.0, 2.0**31, -1.0]),
    "local_sketch": _FLOAT,
    "reduced_sketch": _FLOAT,
}
_RECORD_EDIT = st.one_of(
    st.tuples(st.just("field"), st.integers(0, 63), st.sampled_from(sorted(_FIELD_VALUES))).flatmap(
        lambda t: st.tuples(st.just(t[0]), st.just(t[1]), st.just(t[2]), _FIELD_VALUES[t[2]])
    ),
    st.tuples(st.just("swap"), st.integers(0, 63), st.integers(0, 63), st.none()),
    st.tuples(st.just("duplicate"), st.integers(0, 63), st.integers(0, 63), st.none()),
    st.tuples(st.just("drop"), st.integers(0, 63), st.none(), st.none()),
)


def craft_records(raw: bytes, edits: list[tuple]) -> bytes:
    """``raw`` (a rank file) with records edited by ``edits`` and every checksum made valid again."""
    records = np.frombuffer(
        raw[F.HEADER_SIZE : F.HEADER_SIZE + (len(raw) - F.HEADER_SIZE) // RECORD * RECORD], dtype=F.record_dtype(K)
    ).copy()
    for kind, a, b, value in edits:
        n = len(records)
        if not n:
            break
        if kind == "field":
            records[b][a % n] = value  # a sketch field takes one value for all k entries
        elif kind == "swap":
            records[[a % n, b % n]] = records[[b % n, a % n]]
        elif kind == "duplicate":
            records = np.insert(records, b % (n + 1), records[a % n])
        elif kind == "drop":
            records = np.delete(records, a % n)
    if len(records):
        F.seal(records)
    return raw[: F.HEADER_SIZE] + records.tobytes()


@given(trace=_TRACE, which=st.integers(0, 3), edits=st.lists(_RECORD_EDIT, min_size=1, max_size=4))
def test_trace_records_crafted_with_valid_checksums(scratch, trace, which, edits):
    """Records with any step, kind, flags, rank, counts, NaN/Inf values, reordered, duplicated or
    dropped, each sealed with a valid checksum."""
    files = dict(corpus()[trace])
    name = _rank_files(files)[which % len(_rank_files(files))]
    files[name] = craft_records(files[name], edits)
    with scratch() as folder:
        check_trace(folder, files)


_HEADER_VALUES = {
    "format_version": st.sampled_from([0, 1, 2, 2**16 - 1]),
    "header_size": st.sampled_from([0, 64, 65, 2**16 - 1]),
    "record_size": st.sampled_from([0, 1, RECORD, RECORD + 8, 152, 2**16 - 1]),
    "sketch_k": st.sampled_from([0, 1, K, 9, 2**16 - 1]),
    "rank": st.sampled_from([0, 1, 2, 2**32 - 1]),
    "attempt": st.sampled_from([0, 1, 2, 2**32 - 1]),
    "world_size": st.sampled_from([0, 1, 2, 2**32 - 1]),
    "seed": _U64,
    "created_ns": _I64,
}


@given(
    trace=_TRACE,
    which=st.integers(0, 3),
    fields=st.dictionaries(st.sampled_from(sorted(_HEADER_VALUES)), st.none(), min_size=1, max_size=3),
    data=st.data(),
)
def test_trace_header_crafted_with_valid_checksum(scratch, trace, which, fields, data):
    """A rank file header with any version, sizes, rank, attempt or world size, validly sealed."""
    files = dict(corpus()[trace])
    name = _rank_files(files)[which % len(_rank_files(files))]
    header = np.frombuffer(files[name][: F.HEADER_SIZE], dtype=F.HEADER_DTYPE).copy()
    for field in fields:
        header[field] = data.draw(_HEADER_VALUES[field], label=field)
    header["checksum"] = F.checksums(header)
    files[name] = header.tobytes() + files[name][F.HEADER_SIZE :]
    with scratch() as folder:
        check_trace(folder, files)


# ---------------------------------------------------------------------------------------------
# Manifest and directory layout


@given(trace=_TRACE, edits=json_edits(3))
def test_trace_manifest_fields_edited(scratch, trace, edits):
    """Any manifest field replaced by any JSON value, removed, or given an extra key or item."""
    files = dict(corpus()[trace])
    files["manifest.json"] = json.dumps(edit_json(json.loads(files["manifest.json"]), edits)).encode()
    with scratch() as folder:
        check_trace(folder, files, kind="manifest")


@given(trace=_TRACE, ops=mutations(max_ops=3))
def test_trace_manifest_bytes_mutated(scratch, trace, ops):
    """The manifest's bytes damaged: invalid UTF-8 or JSON, truncated, spliced."""
    files = dict(corpus()[trace])
    files["manifest.json"] = mutate(files["manifest.json"], ops)
    with scratch() as folder:
        check_trace(folder, files, kind="manifest")


_LAYOUT = st.one_of(
    st.tuples(st.just("remove"), st.integers(0, 15), st.none()),
    st.tuples(
        st.just("copy_as"),
        st.integers(0, 15),
        st.sampled_from(
            [
                "rank-00002.attempt-000.sdct",
                "rank-00000.attempt-005.sdct",
                "rank-99999.attempt-999.sdct",
                "rank-00001.attempt-001.sdct",
            ]
        ),
    ),
    st.tuples(st.just("empty"), st.integers(0, 15), st.none()),
    st.tuples(
        st.just("directory"),
        st.none(),
        st.sampled_from(
            [
                "rank-00000.attempt-000.sdct",
                "manifest.json",
                "checkpoints",
                "checkpoints/step-00000002.attempt-000.json",
                "rank-00003.attempt-000.sdct",
            ]
        ),
    ),
    st.tuples(
        st.just("file"),
        st.sampled_from(
            [
                "checkpoints",
                "checkpoints/step-1.attempt-x.json",
                "buckets.attempt-000.json",
                "rank-0.attempt-0.sdct",
                "rank-00000.attempt-000.sdct.tmp",
            ]
        ),
        json_values(3),
    ),
)


@given(trace=_TRACE, ops=st.lists(_LAYOUT, min_size=1, max_size=3))
def test_trace_directory_layout_edited(scratch, trace, ops):
    """Files removed, copied under another rank or attempt, emptied; directories where files belong."""
    files, dirs = dict(corpus()[trace]), []
    for op, a, b in ops:
        names = sorted(files)
        if op == "remove" and names:
            files.pop(names[a % len(names)])
        elif op == "copy_as" and names:
            files[b] = files[names[a % len(names)]]
        elif op == "empty" and names:
            files[names[a % len(names)]] = b""
        elif op == "directory":
            files = {name: raw for name, raw in files.items() if name != b and not name.startswith(b + "/")}
            dirs.append(b)
        elif op == "file":
            if not any(name.startswith(a + "/") for name in files):
                files[a] = json.dumps(b).encode()
    dirs = [d for d in dirs if not any(name == d or d.startswith(name + "/") for name in files)]
    with scratch() as folder:
        check_trace(folder, files, tuple(dirs))
