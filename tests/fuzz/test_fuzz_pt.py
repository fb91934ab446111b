"""Fuzzing ``torch.save`` checkpoints (``checkpoint/torch_reader.py``): byte mutations of valid
small archives, zip-member edits rebuilt into valid archives, crafted ``data.pkl`` pickles
(tensors with any storage, offset, size and stride; globals inside and outside the allow-list)
and opcode soups. Property: ``open_checkpoint`` + ``verify_checkpoint`` return a report or raise
``CheckpointError``; the input is unchanged (``harness.hostile_call``)."""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import warnings
import zipfile
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import hostile_call, mutate, mutations, signature_offsets
from tests.fuzz.readers import CHECKPOINT_ERRORS, verify

ZIP_SIGNATURES = (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07")


def saved(obj) -> bytes:
    """``obj`` as ``torch.save`` writes it (also used by the folder corpus)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@functools.cache
def corpus() -> dict[str, bytes]:
    """Small valid ``torch.save`` files: a state dict, optimizer state, odd dtypes, shared storage."""
    gen = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(4, 3, generator=gen), "b": torch.zeros(3)}
    shared = torch.arange(12, dtype=torch.float32)
    return {
        "model.pt": saved({"model": model, "step": 4}),
        "optimizer.pt": saved(
            {
                "state": {0: {"exp_avg": torch.ones(4, 3), "step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 1e-3, "params": [0]}],
            }
        ),
        "dtypes.pt": saved(
            {
                "h": torch.ones(5, dtype=torch.float16),
                "bf": torch.ones(2, dtype=torch.bfloat16),
                "i": torch.arange(3),
                "flag": torch.tensor([True, False]),
                "empty": torch.zeros(0),
                "scalar": torch.tensor(7.5),
            }
        ),
        "views.pt": saved(
            {"full": shared, "view": shared[2:8], "t": shared.view(3, 4).t(), "list": [shared[:2], {"x": shared[5:]}]}
        ),
    }


def _hot(raw: bytes) -> tuple[int, ...]:
    return signature_offsets(raw, ZIP_SIGNATURES + (b"data.pkl", b"byteorder", b"version"))


@st.composite
def mutated_files(draw):
    name = draw(st.sampled_from(sorted(corpus())))
    raw = corpus()[name]
    return name, mutate(raw, draw(mutations(_hot(raw))))


def _check(folder: Path, raw: bytes, name: str = "x.pt"):
    path = folder / name
    path.write_bytes(raw)
    return hostile_call("pt", lambda: verify(path), allowed=CHECKPOINT_ERRORS, watch=folder)


@given(case=mutated_files())
def test_pt_mutated_bytes(scratch, case):
    """Flips, truncations, a missing head, deletions, insertions, splices, boundary integers."""
    name, raw = case
    with scratch() as folder:
        _check(folder, raw, name)


# ---------------------------------------------------------------------------------------------
# zip-member edits (a valid zip archive around what torch.save did not write)

_NAMES = st.sampled_from(
    [
        "archive/data.pkl",
        "archive/data/0",
        "archive/data/1",
        "archive/data/99",
        "archive/byteorder",
        "archive/version",
        "archive/.format_version",
        "../evil",
        "/abs/data.pkl",
        "",
        "a" * 300,
        "x/data.pkl",
        "archive/data/0\x00",
        "archive/dätä.pkl",
        "archive/data/-1",
        "archive/data/0/1",
    ]
) | st.text(max_size=12)
_EDIT = st.one_of(
    st.tuples(st.just("drop"), st.integers(0, 15)),
    st.tuples(st.just("rename"), st.integers(0, 15), _NAMES),
    st.tuples(st.just("replace"), st.integers(0, 15), st.binary(max_size=64)),
    st.tuples(st.just("resize"), st.integers(0, 15), st.integers(-64, 64)),
    st.tuples(
        st.just("compress"),
        st.integers(0, 15),
        st.sampled_from([zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]),
    ),
    st.tuples(st.just("add"), _NAMES, st.binary(max_size=64)),
    st.tuples(st.just("swap"), st.integers(0, 15), st.integers(0, 15)),
    st.tuples(st.just("duplicate"), st.integers(0, 15)),
    st.tuples(st.just("byteorder"), st.sampled_from([b"big", b"little", b"", b"middle", b"\xff"])),
    st.tuples(st.just("version"), st.sampled_from([b"0", b"1", b"3", b"99", b"-1", b"x", b"1" * 5000])),
)


def _rebuild(raw: bytes, edits: list[tuple]) -> bytes:
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        members = [[m.filename, archive.read(m), zipfile.ZIP_STORED] for m in archive.infolist()]
    for edit in edits:
        kind, n = edit[0], len(members)
        pick = (lambda i: members[i % n]) if n else None
        if kind == "drop" and n:
            members.pop(edit[1] % n)
        elif kind == "rename" and n:
            pick(edit[1])[0] = edit[2]
        elif kind == "replace" and n:
            pick(edit[1])[1] = edit[2]
        elif kind == "resize" and n:
            member = pick(edit[1])
            member[1] = member[1][: edit[2]] if edit[2] < 0 else member[1] + bytes(edit[2])
        elif kind == "compress" and n:
            pick(edit[1])[2] = edit[2]
        elif kind == "add":
            members.append([edit[1], edit[2], zipfile.ZIP_STORED])
        elif kind == "swap" and n:
            a, b = pick(edit[1]), pick(edit[2])
            a[1], b[1] = b[1], a[1]
        elif kind == "duplicate" and n:
            members.append(list(pick(edit[1])))
        elif kind in ("byteorder", "version"):
            for member in members:
                if member[0].endswith("/" + kind):
                    member[1] = edit[1]
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w") as archive:
        warnings.simplefilter("ignore")  # duplicate names are the point
        for name, data, method in members:
            try:
                archive.writestr(zipfile.ZipInfo(name) if name else zipfile.ZipInfo("_"), data, compress_type=method)
            except ValueError:  # a name zipfile itself refuses to write
                continue
    return out.getvalue()


@given(name=st.sampled_from(sorted(corpus())), edits=st.lists(_EDIT, min_size=1, max_size=4))
def test_pt_zip_members_edited(scratch, name, edits):
    """Members dropped, renamed, resized, swapped, duplicated, compressed, added; byteorder and version edited."""
    with scratch() as folder:
        _check(folder, _rebuild(corpus()[name], edits))


# ---------------------------------------------------------------------------------------------
# crafted data.pkl: tensors built by torch's own rebuild functions from any numbers

_STORAGES = [
    torch.FloatStorage,
    torch.DoubleStorage,
    torch.HalfStorage,
    torch.BFloat16Storage,
    torch.LongStorage,
    torch.IntStorage,
    torch.ByteStorage,
    torch.BoolStorage,
    torch.ComplexFloatStorage,
    torch.QInt8Storage,
]
_DIM = st.one_of(st.integers(-2, 6), st.sampled_from([2**31, 2**33, 2**40, 2**62, 2**63 - 1, 2**63, 2**64]))


class _Storage:
    def __init__(self, storage_type, key: str, numel: int, location: str = "cpu") -> None:
        self.storage_type, self.key, self.numel, self.location = storage_type, key, numel, location


class _Reduce:
    """Pickles as ``func(*args)`` (``__reduce__``): how torch.save writes a tensor."""

    def __init__(self, func, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", obj.storage_type, obj.key, obj.location, obj.numel)
        return None


@st.composite
def _tensor(draw, keys: list[str]):
    storage = _Storage(
        draw(st.sampled_from(_STORAGES)),
        draw(st.sampled_from(keys)),
        draw(_DIM),
        draw(st.sampled_from(["cpu", "cpu", "cuda:0", "meta", "xla:0", ""])),
    )
    size = tuple(draw(st.lists(_DIM, max_size=3)))
    stride = tuple(draw(st.lists(_DIM, min_size=len(size), max_size=len(size)) | st.lists(_DIM, max_size=3)))
    offset = draw(_DIM)
    how = draw(st.sampled_from(["v2", "v2", "v3", "parameter", "meta", "forbidden", "sparse"]))
    if how == "v3":
        return _Reduce(
            torch._utils._rebuild_tensor_v3,
            (storage, offset, size, stride, False, collections.OrderedDict(), torch.float32),
        )
    if how == "parameter":
        inner = _Reduce(
            torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, collections.OrderedDict())
        )
        return _Reduce(torch._utils._rebuild_parameter, (inner, draw(st.booleans()), collections.OrderedDict()))
    if how == "meta":
        return _Reduce(torch._utils._rebuild_meta_tensor_no_storage, (torch.float32, size, stride, False))
    if how == "forbidden":  # never run: the scan refuses it (a harmless call if it ever did)
        import os

        return _Reduce(os.getcwd, ())
    if how == "sparse":
        inner = _Reduce(torch._utils._rebuild_tensor_v2, (storage, 0, (1, 1), (1, 1), False, collections.OrderedDict()))
        return _Reduce(torch._utils._rebuild_sparse_tensor, (torch.sparse_coo, size, (inner, inner)))
    return _Reduce(
        torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, draw(st.booleans()), collections.OrderedDict())
    )


@st.composite
def crafted_archives(draw):
    """``(data.pkl, {storage key: bytes})`` of a payload whose tensors are any rebuild call."""
    keys = ["0", "1", "2"]
    blobs = {key: draw(st.binary(max_size=48)) for key in keys if draw(st.booleans())}
    leaf = st.one_of(
        _tensor(keys), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6), st.none(), st.booleans()
    )
    payload = draw(
        st.recursive(
            leaf,
            lambda inner: st.one_of(
                st.lists(inner, max_size=3),
                st.dictionaries(st.text(max_size=4) | st.integers(-2, 2), inner, max_size=3),
                st.lists(inner, max_size=3).map(tuple),
            ),
            max_leaves=6,
        )
    )
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=draw(st.sampled_from([2, 4]))).dump(
        {"model": payload, "step": draw(st.integers(-2, 2**64))}
    )
    return buffer.getvalue(), blobs


def _archive(pkl: bytes, blobs: dict[str, bytes], *, prefix: str = "archive") -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr(f"{prefix}/data.pkl", pkl)
        archive.writestr(f"{prefix}/byteorder", b"little")
        for key, blob in blobs.items():
            archive.writestr(f"{prefix}/data/{key}", blob)
        archive.writestr(f"{prefix}/version", b"3\n")
    return out.getvalue()


@given(case=crafted_archives())
def test_pt_crafted_pickle(scratch, case):
    """Tensors of any storage type, size, stride, offset and location; meta, sparse, parameters;
    a global outside the allow-list; storages missing or shorter than declared."""
    pkl, blobs = case
    with scratch() as folder:
        _check(folder, _archive(pkl, blobs))


_OPCODES = st.one_of(
    st.sampled_from(
        [
            b"}",
            b"]",
            b")",
            b"(",
            b"t",
            b"\x85",
            b"\x86",
            b"\x87",
            b"R",
            b"b",
            b"s",
            b"u",
            b"a",
            b"e",
            b"Q",
            b"\x93",
            b"\x94",
            b"\x81",
            b"N",
            b"\x88",
            b"\x89",
            b"0",
            b"1",
            b"2",
            b".",
            b"ctorch._utils\n_rebuild_tensor_v2\n",
            b"ctorch\nFloatStorage\n",
            b"ccollections\nOrderedDict\n",
            b"cbuiltins\neval\n",
            b"cos\nsystem\n",
            b"\x8c\x07storage",
            b"\x8c\x01" + b"0",
            b"\x8c\x03cpu",
            b"X\xff\xff\xff\x7f",
            b"\x8e" + struct.pack("<Q", 2**62),
            b"I99999999999999999999\n",
        ]
    ),
    st.tuples(
        st.sampled_from([b"K", b"M", b"J", b"h", b"j", b"q", b"r", b"\x8a", b"\x8b", b"C", b"B", b"T", b"\x95"]),
        st.binary(min_size=1, max_size=9),
    ).map(b"".join),
    st.binary(min_size=1, max_size=8),
)


@given(ops=st.lists(_OPCODES, max_size=24), proto=st.sampled_from([2, 4]))
def test_pt_pickle_opcode_soup(scratch, ops, proto):
    """``data.pkl`` is any sequence of pickle opcodes: malformed, unbalanced, or naming forbidden globals."""
    pkl = bytes([0x80, proto]) + b"".join(ops) + b"."
    with scratch() as folder:
        _check(folder, _archive(pkl, {"0": bytes(16)}))
