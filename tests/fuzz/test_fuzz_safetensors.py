"""Fuzzing ``.safetensors`` files (``checkpoint/safetensors_reader.py``): byte mutations of valid
files (leaning on the length prefix and the header's fields), consistent headers (offsets that
tile the data exactly, so the tensors are read and digested) with one field perturbed, and free
JSON headers. Property: ``open_checkpoint`` + ``verify_checkpoint`` return a report or raise
``CheckpointError``; the input is unchanged."""

from __future__ import annotations

import functools
import json
import math
import struct
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save

from tests.fuzz.harness import hostile_call, json_values, mutate, mutations, signature_offsets
from tests.fuzz.readers import CHECKPOINT_ERRORS, verify

#: safetensors dtype code -> bytes per element (the codes the reader knows, and two it does not)
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_UNKNOWN = ["F31", "f32", "", "C64", "F4"]


@functools.cache
def corpus() -> dict[str, bytes]:
    """Small valid files: several dtypes, an empty tensor, a scalar, metadata with a step."""
    gen = torch.Generator().manual_seed(0)
    return {
        "model.safetensors": save({"w": torch.randn(4, 3, generator=gen), "b": torch.zeros(3)}, metadata={"step": "4"}),
        "dtypes.safetensors": save(
            {
                "h": torch.ones(5, dtype=torch.float16),
                "bf": torch.ones(2, dtype=torch.bfloat16),
                "i": torch.arange(3),
                "flag": torch.tensor([True, False]),
                "empty": torch.zeros(0, 2),
                "scalar": torch.tensor(7.5),
                "nan": torch.tensor([float("nan"), 1.0]),
            }
        ),
    }


def _hot(raw: bytes) -> tuple[int, ...]:
    return (
        0,
        8,
        *signature_offsets(
            raw[: 8 + int.from_bytes(raw[:8], "little")],
            (b'"dtype"', b'"shape"', b'"data_offsets"', b"__metadata__", b"}"),
        ),
    )


def _check(folder: Path, raw: bytes, name: str = "x.safetensors"):
    path = folder / name
    path.write_bytes(raw)
    return hostile_call("safetensors", lambda: verify(path), allowed=CHECKPOINT_ERRORS, watch=folder)


@st.composite
def mutated_files(draw):
    name = draw(st.sampled_from(sorted(corpus())))
    raw = corpus()[name]
    return name, mutate(raw, draw(mutations(_hot(raw))))


@given(case=mutated_files())
def test_safetensors_mutated_bytes(scratch, case):
    """Flips, truncations, splices, boundary integers in the length prefix and the header."""
    name, raw = case
    with scratch() as folder:
        _check(folder, raw, name)


# ---------------------------------------------------------------------------------------------
# Consistent headers with one field perturbed

_DIM = st.one_of(st.integers(0, 5), st.sampled_from([0, 1, 2**31, 2**32, 2**62, 2**63 - 1]))
_ENTRY = st.tuples(
    st.text(min_size=0, max_size=10) | st.sampled_from(["__metadata__", "x" * 2000, "[/]", "a\x00b", "\ud800"]),
    st.sampled_from(sorted(ITEMSIZE)),
    st.lists(_DIM, max_size=4),
)
_PERTURB = st.one_of(
    st.none(),
    st.tuples(st.just("dtype"), st.sampled_from(_UNKNOWN) | json_values(4)),
    st.tuples(st.just("shape"), json_values(4) | st.lists(st.integers(-2, 2**64), max_size=4)),
    st.tuples(st.just("data_offsets"), json_values(4) | st.lists(st.integers(-2, 2**64), max_size=3)),
    st.tuples(st.just("extra_key"), json_values(2)),
    st.tuples(st.just("metadata"), json_values(6)),
    st.tuples(st.just("trailing"), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("short"), st.integers(1, 16)),
)


@st.composite
def consistent_files(draw):
    """A header whose offsets tile the data exactly (when the shapes are small enough to store),
    so the reader reaches the tensors, then at most one perturbation."""
    entries = draw(st.lists(_ENTRY, max_size=4, unique_by=lambda e: e[0]))
    header: dict = {}
    cursor = 0
    for name, code, shape in entries:
        nbytes = math.prod(shape) * ITEMSIZE[code]
        if nbytes > 4096:  # too large to write: keep the header, the data will be missing
            nbytes = nbytes if draw(st.booleans()) else 0
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    data = draw(st.binary(min_size=min(cursor, 4096), max_size=min(cursor, 4096)))
    perturb = draw(_PERTURB)
    if perturb is not None and perturb[0] in ("dtype", "shape", "data_offsets", "extra_key") and header:
        target = header[draw(st.sampled_from(sorted(header)))]
        target[perturb[0] if perturb[0] != "extra_key" else "extra"] = perturb[1]
    elif perturb is not None and perturb[0] == "metadata":
        header["__metadata__"] = perturb[1]
    elif perturb is not None and perturb[0] == "trailing":
        data += perturb[1]
    elif perturb is not None and perturb[0] == "short":
        data = data[: -perturb[1]]
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


@given(raw=consistent_files())
def test_safetensors_consistent_header_perturbed(scratch, raw):
    """Any dtype, shape (zero dims beside huge ones) and name; a field replaced by any JSON value."""
    with scratch() as folder:
        _check(folder, raw)


@given(header=json_values(16), prefix=st.sampled_from([None, 0, 1, 2**63, 2**64 - 1]), data=st.binary(max_size=32))
def test_safetensors_header_any_json(scratch, header, prefix, data):
    """The header is any JSON value (with NaN, huge integers, deep lists), the length prefix right or wrong."""
    blob = json.dumps(header).encode()
    raw = struct.pack("<Q", len(blob) if prefix is None else prefix) + blob + data
    with scratch() as folder:
        _check(folder, raw)
