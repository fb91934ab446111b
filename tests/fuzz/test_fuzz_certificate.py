"""Fuzzing certificates (``decide/certificate.py``), as ``verify-checkpoint CKPT --certificate
FILE`` reads them: a valid certificate with fields replaced by any JSON value (paths with NUL or
lone surrogates, huge numbers, unknown statuses and kinds), removed or added; its bytes damaged.
Property: reading it, finding the checkpoint's entry and checking the checkpoint against it
(``readers.read_certificate_for``) return or raise ``InvalidInputError``; nothing changes."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save

from tests.fuzz.harness import edit_json, hostile_call, json_edits, json_values, mutate, mutations
from tests.fuzz.readers import CERTIFICATE_ERRORS, read_certificate_for

CHECKPOINT = "model.safetensors"


@functools.cache
def checkpoint_bytes() -> bytes:
    return save({"a": torch.ones(4)})


def certificate(folder: Path) -> dict:
    """A valid certificate of ``folder/model.safetensors`` (what ``certify --certificate-out`` writes)."""
    from sdc_forensics.checkpoint import VerifyOptions, verify_checkpoint

    path = folder / CHECKPOINT
    report = verify_checkpoint(path, options=VerifyOptions(workers=1, populate=False))
    files = [{"name": f.name, "size_bytes": f.size_bytes, "digest": f.digest} for f in report.files]
    entry = {
        "step": 2,
        "path": str(path.resolve()),
        "status": "clean",
        "reasons": [],
        "format": "safetensors",
        "weights_digest": "",
        "files": files,
        "evidence": [{"kind": "nonfinite", "subject": "a", "expected": "0", "found": "1", "detail": ""}],
    }
    return {
        "format": "sdc-forensics-certificate",
        "certificate_version": 2,
        "tool_version": "0.1.0",
        "created_utc": "2026-11-29T09:00:00Z",
        "seed": 402905780677,
        "trace_dir": str(folder),
        "first_divergent_step": None,
        "resume_step": 2,
        "resume_path": str(path),
        "checkpoints": [entry, {**entry, "step": 4, "path": str(folder / "other.safetensors"), "status": "corrupt"}],
    }


def _check(folder: Path, raw: bytes):
    cert = folder / "cert.json"
    cert.write_bytes(raw)
    return hostile_call(
        "certificate", lambda: read_certificate_for(cert, folder / CHECKPOINT), allowed=CERTIFICATE_ERRORS, watch=folder
    )


_VALUES = json_values(6) | st.sampled_from(
    [
        "",
        "\x00",
        "a\x00b",
        "\ud800",
        "x" * 5000,
        "/",
        "clean",
        "corrupt",
        "unverified",
        "tainted",
        "digest-mismatch",
        CHECKPOINT,
        2**63,
        2**64,
        -1,
        float("nan"),
    ]
)


@given(edits=json_edits(3, values=_VALUES))
def test_certificate_fields_edited(scratch, edits):
    """Any field replaced by any JSON value, removed, or an extra key or item added."""
    with scratch() as folder:
        (folder / CHECKPOINT).write_bytes(checkpoint_bytes())
        doc = edit_json(certificate(folder), edits)
        _check(folder, json.dumps(doc).encode())


@given(ops=mutations(max_ops=3))
def test_certificate_bytes_mutated(scratch, ops):
    """The certificate's bytes damaged: invalid UTF-8 or JSON, truncated, spliced."""
    with scratch() as folder:
        (folder / CHECKPOINT).write_bytes(checkpoint_bytes())
        _check(folder, mutate(json.dumps(certificate(folder), indent=1, sort_keys=True).encode(), ops))


_PATH_FIELDS = st.sampled_from(
    [
        ("checkpoints", 0, "path"),
        ("checkpoints", 1, "path"),
        ("resume_path",),
        ("trace_dir",),
        ("checkpoints", 0, "files", 0, "name"),
        ("checkpoints", 0, "format"),
        ("checkpoints", 0, "weights_digest"),
    ]
)
_PATHS = st.one_of(
    st.sampled_from(
        [
            "",
            "\x00",
            "a\x00b",
            "\ud800",
            "\udcff",
            "x" * 5000,
            "/",
            ".",
            "..",
            CHECKPOINT,
            "./" + CHECKPOINT,
            "../" + CHECKPOINT,
            "/proc/self/fd/0",
            "~/x",
        ]
    ),
    st.text(max_size=12),
)


@given(fields=st.dictionaries(_PATH_FIELDS, _PATHS, min_size=1, max_size=3))
def test_certificate_paths(scratch, fields):
    """Paths and names that are no paths: NUL bytes, lone surrogates, 5,000 characters, ``..``."""
    with scratch() as folder:
        (folder / CHECKPOINT).write_bytes(checkpoint_bytes())
        doc = certificate(folder)
        for where, value in fields.items():
            parent = doc
            for step in where[:-1]:
                parent = parent[step]
            parent[where[-1]] = value
        _check(folder, json.dumps(doc).encode())
