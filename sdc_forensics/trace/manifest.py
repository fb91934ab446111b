"""The run-level manifest ``manifest.json`` of a trace directory, as frozen dataclasses.

The manifest is written by global rank 0, atomically (temporary file, then ``os.replace``), at
the start of every attempt. It holds what every reader needs to interpret the rank files: world
size, fingerprint settings and seed, the replay recipe, the reduction, and per attempt the
environment and the identity of every rank. Parsing happens here; nothing past the reader digs
into raw JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from sdc_forensics.errors import TraceError
from sdc_forensics.trace.format import FORMAT_VERSION

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "sdc-forensics-trace"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankIdentity:
    """Where one global rank ran."""

    rank: int
    host: str = ""
    node_rank: int = -1
    local_rank: int = -1
    gpu_uuid: str = ""
    pci_bus_id: str = ""
    device: str = "cpu"
    slurm_job_id: str = ""
    slurm_node: str = ""
    k8s_node: str = ""

    @property
    def gpu(self) -> str:
        """A short human label of the accelerator (UUID, else PCI bus id, else the device)."""
        return self.gpu_uuid or self.pci_bus_id or self.device


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attempt:
    """One execution of the job; a resume from checkpoint ``N`` starts a new attempt at step ``N``."""

    attempt: int
    start_step: int
    started_ns: int = 0
    torch_version: str = ""
    cuda_version: str = ""
    determinism: dict[str, Any] = dataclasses.field(default_factory=dict)
    ranks: tuple[RankIdentity, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class FingerprintSettings:
    """How fingerprints in this trace were computed."""

    seed: int
    sketch_k: int
    block_words: int = 1024
    block_elems: int = 1024
    grad_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.sketch_k < 1:
            raise TraceError(f"sketch_k must be >= 1, got {self.sketch_k}; the manifest is damaged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything run-level about a trace."""

    format_version: int
    world_size: int
    fingerprint: FingerprintSettings
    recipe: str | None = None
    reduction: str = "mean"
    checkpoint_every: int | None = None
    audit_every: int | None = None
    weights_every: int = 1
    node_of_rank: tuple[int, ...] = ()
    attempts: tuple[Attempt, ...] = ()
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def identity(self, rank: int, attempt: int | None = None) -> RankIdentity:
        """Identity of ``rank`` in ``attempt`` (default: the latest attempt that lists it)."""
        for att in sorted(self.attempts, key=lambda a: a.attempt, reverse=True):
            if attempt is not None and att.attempt != attempt:
                continue
            for ident in att.ranks:
                if ident.rank == rank:
                    return ident
        return RankIdentity(rank=rank)

    def to_json(self) -> dict[str, Any]:
        """The JSON document (sorted keys are applied by :func:`write_manifest`)."""
        doc = dataclasses.asdict(self)
        doc["format"] = FORMAT_NAME
        return doc


def _from_dict(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def parse_manifest(doc: Any, where: str = MANIFEST_NAME) -> Manifest:
    """Turn a decoded manifest document into a :class:`Manifest`, or raise :class:`TraceError`."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise TraceError(f"{where} is not an sdc-forensics trace manifest (no \"format\": \"{FORMAT_NAME}\")")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise TraceError(
            f"{where} has trace format version {version!r}; this sdc-forensics reads version "
            f"{FORMAT_VERSION}: upgrade sdc-forensics, or re-export the trace with the version that wrote it"
        )
    try:
        attempts = tuple(
            dataclasses.replace(
                _from_dict(Attempt, a),
                ranks=tuple(_from_dict(RankIdentity, r) for r in a.get("ranks", ())),
            )
            for a in doc.get("attempts", ())
        )
        return Manifest(
            format_version=version,
            world_size=int(doc["world_size"]),
            fingerprint=_from_dict(FingerprintSettings, doc["fingerprint"]),
            recipe=doc.get("recipe"),
            reduction=doc.get("reduction", "mean"),
            checkpoint_every=doc.get("checkpoint_every"),
            audit_every=doc.get("audit_every"),
            weights_every=int(doc.get("weights_every", 1)),
            node_of_rank=tuple(doc.get("node_of_rank", ())),
            attempts=attempts,
            extra=dict(doc.get("extra", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"{where} is malformed ({exc!r}); it was not written by sdc-forensics or is damaged") from None


def read_manifest(trace_dir: str | os.PathLike) -> Manifest:
    """Read and validate ``TRACE_DIR/manifest.json``."""
    path = Path(trace_dir) / MANIFEST_NAME
    if not Path(trace_dir).is_dir():
        raise TraceError(f"{trace_dir} is not a directory; pass the trace directory the recorder wrote")
    if not path.is_file():
        raise TraceError(f"{trace_dir} has no {MANIFEST_NAME}: not a trace directory (or the run never started)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{path} is not valid JSON ({exc}); the manifest is damaged") from None
    return parse_manifest(doc, str(path))


def write_manifest(trace_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write the manifest atomically (readers never see half a manifest)."""
    path = Path(trace_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
