"""Fuzzing checkpoint folders (``checkpoint/folder.py``), as ``transformers``' Trainer writes them:
one file damaged byte by byte, and the layout edited: files removed, emptied, renamed to another
format's suffix; names with rich markup, newlines or bytes that are not UTF-8; symbolic links out
of the folder, dangling, looping or onto directories; FIFOs and directories where files belong;
several index files. Property: ``open_checkpoint`` + ``verify_checkpoint`` on the folder return
a report or raise ``CheckpointError``; nothing under the folder changes."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save

from tests.fuzz import test_fuzz_dcp
from tests.fuzz.test_fuzz_pt import saved
from tests.fuzz.harness import hostile_call, mutate, mutations
from tests.fuzz.readers import CHECKPOINT_ERRORS, verify


@functools.cache
def corpus() -> dict[str, bytes]:
    """A ``checkpoint-4/`` folder: model, optimizer and scheduler state, trainer state, config,
    a tokenizer file sdc-forensics does not read, and an FSDP-style DCP sub-directory."""
    gen = torch.Generator().manual_seed(0)
    files = {
        "model.safetensors": save({"w": torch.randn(4, 3, generator=gen), "b": torch.zeros(3)}),
        "optimizer.pt": saved(
            {"state": {0: {"exp_avg": torch.ones(4, 3), "step": torch.tensor(4.0)}}, "param_groups": [{"lr": 1e-3}]}
        ),
        "scheduler.pt": saved({"last_epoch": 4, "_step_count": 5}),
        "trainer_state.json": json.dumps({"global_step": 4, "log_history": []}).encode(),
        "config.json": json.dumps({"hidden_size": 3}).encode(),
        "tokenizer.model": b"\x0a\x05hello",
        "README.md": b"# checkpoint\n",
    }
    files.update({f"pytorch_model_fsdp_0/{name}": raw for name, raw in test_fuzz_dcp.corpus().items()})
    return files


_NAMES = sorted(corpus())


def _write(folder: Path, files: dict[str, bytes], specials: list[tuple[str, str, str]]) -> Path:
    root = folder / "checkpoint-4"
    root.mkdir()
    for name, raw in files.items():
        path = root / name
        if path.parent.exists() and not path.parent.is_dir():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() and not path.is_symlink():
            path.write_bytes(raw)
    for kind, name, target in specials:
        path = root / name
        if path.exists() or path.is_symlink():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "link":
            os.symlink(target, path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "directory":
            path.mkdir()
    return root


def _check(folder: Path, files: dict[str, bytes], specials: list[tuple[str, str, str]] = ()):
    root = _write(folder, files, list(specials))
    return hostile_call("folder", lambda: verify(root), allowed=CHECKPOINT_ERRORS, watch=folder)


@st.composite
def mutated_file(draw):
    name = draw(st.sampled_from(_NAMES))
    return {**corpus(), name: mutate(corpus()[name], draw(mutations()))}


@given(files=mutated_file())
def test_folder_one_file_mutated(scratch, files):
    """One file of the folder (model, optimizer, JSON, DCP metadata or data) damaged."""
    with scratch() as folder:
        _check(folder, files)


_ODD_NAMES = st.sampled_from(
    [
        "model.safetensors",
        "optimizer.pt",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "x.bin.index.json",
        "pytorch_model.bin",
        "training_args.bin",
        "rng_state.pth",
        "[bold]x[/].pt",
        "line\nbreak.pt",
        os.fsdecode(b"\xff\xfe.pt"),
        "x.distcp",
        ".metadata",
        "sub/.metadata",
        ".git/HEAD",
        ".cache/huggingface/x.lock",
        "a/b/c/d/e.safetensors",
        "x.npy",
        "x.pkl",
        "trainer_state.json",
        "x" * 250 + ".pt",
        "model.safetensors.tmp",
    ]
)
_LAYOUT = st.one_of(
    st.tuples(st.just("remove"), st.sampled_from(_NAMES), st.none()),
    st.tuples(st.just("empty"), st.sampled_from(_NAMES), st.none()),
    st.tuples(st.just("copy"), st.sampled_from(_NAMES), _ODD_NAMES),
    st.tuples(
        st.just("bytes"),
        _ODD_NAMES,
        st.binary(max_size=24) | st.sampled_from([b"{}", b"[]", b"PK\x05\x06" + bytes(18), b"\x80\x02}."]),
    ),
    st.tuples(
        st.just("link"),
        _ODD_NAMES,
        st.sampled_from(
            [
                "/etc/hostname",
                "/nonexistent",
                "..",
                ".",
                "model.safetensors",
                "optimizer.pt",
                "pytorch_model_fsdp_0",
                "../checkpoint-4",
                "/proc/self/fd/0",
                "loop.pt",
            ]
        ),
    ),
    st.tuples(st.just("fifo"), _ODD_NAMES, st.none()),
    st.tuples(st.just("directory"), _ODD_NAMES, st.none()),
)


@given(ops=st.lists(_LAYOUT, min_size=1, max_size=4))
def test_folder_layout_edited(scratch, ops):
    """Files removed, emptied, copied under another name or format; symbolic links, FIFOs and
    directories where checkpoint files belong; names that are markup, multi-line or not UTF-8."""
    files, specials = dict(corpus()), []
    for op, name, extra in ops:
        if op == "remove":
            files.pop(name, None)
        elif op == "empty" and name in files:
            files[name] = b""
        elif op == "copy" and name in files:
            files[extra] = files[name]
        elif op == "bytes":
            files[name] = extra
        elif op in ("link", "fifo", "directory"):
            files.pop(name, None)
            specials.append((op, name, extra or ""))
    with scratch() as folder:
        _check(folder, files, specials)
