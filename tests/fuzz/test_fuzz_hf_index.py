"""Fuzzing Hugging Face sharded checkpoints (``checkpoint/hf_index.py``): the
``model.safetensors.index.json`` damaged byte by byte, or rewritten with any ``weight_map``
(tensors moved between shards, missing, unknown; shard names that escape the directory, name the
index itself, hold NUL or lone surrogates, or are longer than a file name) and any ``metadata``;
and a shard damaged under a valid index. Property: ``open_checkpoint`` + ``verify_checkpoint`` on
the index file or on its directory return a report or raise ``CheckpointError``; the input is
unchanged."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save

from tests.fuzz.harness import hostile_call, json_values, mutate, mutations, signature_offsets
from tests.fuzz.readers import CHECKPOINT_ERRORS, verify

INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@functools.cache
def corpus() -> dict[str, bytes]:
    """Two shards and their index, as ``save_pretrained`` writes them."""
    gen = torch.Generator().manual_seed(0)
    parts = (
        {"embed.weight": torch.randn(6, 4, generator=gen), "layer.0.weight": torch.randn(4, 4, generator=gen)},
        {"layer.1.weight": torch.randn(4, 4, generator=gen), "head.bias": torch.zeros(6)},
    )
    files = {name: save(tensors, metadata={"format": "pt"}) for name, tensors in zip(SHARDS, parts)}
    weight_map = {key: name for name, tensors in zip(SHARDS, parts) for key in tensors}
    files[INDEX] = json.dumps(
        {"metadata": {"total_size": sum(len(v) for v in files.values())}, "weight_map": weight_map}, indent=2
    ).encode()
    return files


def _check(folder: Path, files: dict[str, bytes], through_folder: bool):
    root = folder / "hf"
    root.mkdir()
    for name, raw in files.items():
        (root / name).write_bytes(raw)
    target = root if through_folder else root / INDEX
    return hostile_call("hf-index", lambda: verify(target), allowed=CHECKPOINT_ERRORS, watch=folder)


@st.composite
def mutated_index(draw):
    raw = corpus()[INDEX]
    return {
        **corpus(),
        INDEX: mutate(raw, draw(mutations(signature_offsets(raw, (b'"weight_map"', b'"metadata"', b'"model-', b":"))))),
    }


@given(files=mutated_index(), through_folder=st.booleans())
def test_hf_index_mutated_bytes(scratch, files, through_folder):
    """The index JSON flipped, truncated, spliced (invalid UTF-8, JSON, structure)."""
    with scratch() as folder:
        _check(folder, files, through_folder)


_SHARD_NAME = st.one_of(
    st.sampled_from(
        [
            *SHARDS,
            INDEX,
            "",
            ".",
            "..",
            "../" + SHARDS[0],
            "/etc/passwd",
            "sub/" + SHARDS[0],
            "a\x00b.safetensors",
            "\ud800.safetensors",
            "x" * 300 + ".safetensors",
            "missing.safetensors",
            "model.bin",
            "shard.pt",
            "a\\b",
        ]
    ),
    st.text(max_size=12),
    json_values(3),
)
_TENSOR_NAME = st.sampled_from(
    ["embed.weight", "layer.0.weight", "layer.1.weight", "head.bias", "unknown", ""]
) | st.text(max_size=6)


@given(
    weight_map=st.dictionaries(_TENSOR_NAME, _SHARD_NAME, max_size=6) | json_values(6),
    metadata=json_values(8),
    extra=st.dictionaries(st.text(max_size=6), json_values(3), max_size=2),
    through_folder=st.booleans(),
)
def test_hf_index_any_weight_map(scratch, weight_map, metadata, extra, through_folder):
    """Any ``weight_map`` (tensors moved, missing, unknown; hostile shard names) and ``metadata``."""
    doc = {**extra, "weight_map": weight_map, "metadata": metadata}
    with scratch() as folder:
        _check(folder, {**corpus(), INDEX: json.dumps(doc).encode()}, through_folder)


@st.composite
def mutated_shard(draw):
    name = draw(st.sampled_from(SHARDS))
    raw = corpus()[name]
    return {
        **corpus(),
        name: mutate(raw, draw(mutations((0, 8, *signature_offsets(raw, (b'"data_offsets"', b'"shape"')))))),
    }


@given(files=mutated_shard(), through_folder=st.booleans())
def test_hf_index_shard_mutated(scratch, files, through_folder):
    """A shard damaged under a valid index."""
    with scratch() as folder:
        _check(folder, files, through_folder)
