"""Fuzzing ``torch.distributed.checkpoint`` directories (``checkpoint/dcp_reader.py``): byte
mutations of ``.metadata`` (a pickle, loaded with an allow-list) and of the ``.distcp`` data
file, and structured edits of the metadata's fields (any Python value an allow-listed pickle can
hold: wrong types, negative or huge numbers, paths out of the directory, quantized dtypes,
chunks dropped, duplicated or pointed at other items). A two-chunk tensor is in the corpus, so
assembly from chunks is reached. Property: ``open_checkpoint`` + ``verify_checkpoint`` on the
directory return a report or raise ``CheckpointError``; the input is unchanged."""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import pathlib
import pickle
import tempfile
import warnings
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import hostile_call, mutate, mutations, signature_offsets
from tests.fuzz.readers import CHECKPOINT_ERRORS, verify

DATA = "__0_0.distcp"


@functools.cache
def corpus() -> dict[str, bytes]:
    """``{".metadata": pickle, "__0_0.distcp": data}`` of a DCP save (model.w split in two chunks, a
    bytes item ``step`` and a string item), read back into memory once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = Path(tmp) / "src"
        gen = torch.Generator().manual_seed(0)
        dcp.save(
            {"model": {"w": torch.randn(8, 4, generator=gen), "b": torch.zeros(4)}, "step": 3, "extra": {"note": "hi"}},
            checkpoint_id=str(folder),
            no_dist=True,
        )
        meta = pickle.loads((folder / ".metadata").read_bytes())
        data = (folder / DATA).read_bytes()
    # model.w as two row chunks, as a 2-rank FSDP save would write it
    full = torch.randn(8, 4, generator=gen)
    old = next(index for index in meta.storage_data if index.fqn == "model.w")
    del meta.storage_data[old]
    chunks = []
    for row in (0, 4):
        buffer = io.BytesIO()
        torch.save(full[row : row + 4].clone(), buffer)
        blob = buffer.getvalue()
        chunks.append(ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=torch.Size([4, 4])))
        meta.storage_data[MetadataIndex("model.w", torch.Size([row, 0]), len(chunks) - 1)] = _StorageInfo(
            DATA, len(data), len(blob)
        )
        data += blob
    meta.state_dict_metadata["model.w"].chunks = chunks
    return {".metadata": pickle.dumps(meta), DATA: data}


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    ckpt = folder / "ckpt"
    ckpt.mkdir()
    for name, raw in files.items():
        (ckpt / name).write_bytes(raw)
    return ckpt


def _check(folder: Path, files: dict[str, bytes]):
    ckpt = _write(folder, files)
    return hostile_call("dcp", lambda: verify(ckpt), allowed=CHECKPOINT_ERRORS, watch=folder)


@st.composite
def mutated_file(draw, name: str):
    raw = corpus()[name]
    hot = signature_offsets(
        raw, (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"torch", b"distcp", b"Size", b"\x8a", b"K")
    )
    return {**corpus(), name: mutate(raw, draw(mutations(hot)))}


@given(files=mutated_file(".metadata"))
def test_dcp_metadata_bytes_mutated(scratch, files):
    """The ``.metadata`` pickle flipped, truncated, spliced, with boundary integers written over it."""
    with scratch() as folder:
        _check(folder, files)


@given(files=mutated_file(DATA))
def test_dcp_data_bytes_mutated(scratch, files):
    """The ``.distcp`` file (concatenated ``torch.save`` archives) damaged anywhere."""
    with scratch() as folder:
        _check(folder, files)


# ---------------------------------------------------------------------------------------------
# Structured edits of the metadata

_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.sampled_from([-1, 0, 1, 3, 4, 8, 2**31, 2**63 - 1, 2**63]),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(["../x", "/etc/passwd", "", DATA, "a\x00b", ".metadata", "x" * 300, "sub/" + DATA]),
    st.lists(st.integers(-2, 2**63), max_size=3).map(tuple),
    st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
    st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool, torch.qint8, torch.complex64]),
    st.just(pathlib.PurePosixPath(DATA)),
    st.lists(st.integers(0, 3), max_size=3),
)
_FIELDS = {
    "storage": ("relative_path", "offset", "length", "transform_descriptors"),
    "chunk": ("offsets", "sizes"),
    "tensor": ("size", "chunks", "properties"),
    "properties": ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
    "index": ("fqn", "offset", "index"),
    "metadata": ("state_dict_metadata", "storage_data", "planner_data", "storage_meta", "version"),
}


def _set(obj, name: str, value) -> None:
    try:
        object.__setattr__(obj, name, value)  # MetadataIndex and friends may be frozen dataclasses
    except (AttributeError, TypeError):  # an earlier edit put None (or an int) where this object was
        pass


def _edit(meta, edit: tuple) -> None:
    """Apply one edit (``_EDIT``) to a copy of the corpus metadata, in place."""
    kind, pick, field, value = edit
    storage_data = getattr(meta, "storage_data", None)
    state = getattr(meta, "state_dict_metadata", None)
    storage = list(storage_data.items()) if isinstance(storage_data, dict) else []
    tensors = (
        [(fqn, m) for fqn, m in state.items() if isinstance(getattr(m, "chunks", None), list)]
        if isinstance(state, dict)
        else []
    )
    if kind == "storage" and storage:
        _set(storage[pick % len(storage)][1], _FIELDS["storage"][field % 4], value)
    elif kind == "chunk" and tensors:
        chunks = tensors[pick % len(tensors)][1].chunks
        if chunks:
            _set(chunks[field % len(chunks)], _FIELDS["chunk"][field % 2], value)
    elif kind == "tensor" and tensors:
        _set(tensors[pick % len(tensors)][1], _FIELDS["tensor"][field % 3], value)
    elif kind == "properties" and tensors:
        _set(tensors[pick % len(tensors)][1].properties, _FIELDS["properties"][field % 5], value)
    elif kind == "index" and storage:
        index, info = storage[pick % len(storage)]
        del storage_data[index]
        index = copy.copy(index)
        _set(index, _FIELDS["index"][field % 3], value)
        try:
            storage_data[index] = info
        except TypeError:  # unhashable now: the file could not hold it either
            pass
    elif kind == "metadata":
        _set(meta, _FIELDS["metadata"][field % 5], value)
    elif kind == "retarget" and len(storage) > 1:  # an item's bytes are another item's
        source = storage[field % len(storage)][1]
        target = storage[pick % len(storage)][1]
        _set(target, "offset", source.offset)
        _set(target, "length", source.length)
    elif kind == "drop_chunk" and tensors:
        chunks = tensors[pick % len(tensors)][1].chunks
        if chunks:
            chunks.pop(field % len(chunks))
    elif kind == "duplicate_chunk" and tensors:
        chunks = tensors[pick % len(tensors)][1].chunks
        if chunks:
            chunks.append(dataclasses.replace(chunks[field % len(chunks)]))
    elif kind == "drop_storage" and storage:
        del storage_data[storage[pick % len(storage)][0]]
    elif kind == "rename" and isinstance(state, dict) and state:
        key = list(state)[pick % len(state)]
        state[value if isinstance(value, (str, int)) else str(value)] = state.pop(key)


_EDIT = st.tuples(
    st.sampled_from(
        [
            "storage",
            "chunk",
            "tensor",
            "properties",
            "index",
            "metadata",
            "retarget",
            "drop_chunk",
            "duplicate_chunk",
            "drop_storage",
            "rename",
        ]
    ),
    st.integers(0, 7),
    st.integers(0, 7),
    _VALUE,
)


@given(edits=st.lists(_EDIT, min_size=1, max_size=3))
def test_dcp_metadata_fields_edited(scratch, edits):
    """Any field of the metadata's objects set to any value; chunks and storage entries dropped,
    duplicated, renamed or pointed at another item's bytes."""
    meta = pickle.loads(corpus()[".metadata"])
    for edit in edits:
        _edit(meta, edit)
    try:
        raw = pickle.dumps(meta)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError, RecursionError, RuntimeError):
        return  # not something a file can hold
    with scratch() as folder:
        _check(folder, {**corpus(), ".metadata": raw})
