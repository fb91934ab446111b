"""The run-level manifest ``manifest.json`` of a trace directory, as frozen dataclasses.

The manifest is written by global rank 0, atomically (``newfile.write_atomic``), at
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

from sdc_forensics.errors import TraceError, reader
from sdc_forensics.fingerprint.tolerance import REDUCTIONS, UNIT_ROUNDOFF
from sdc_forensics.newfile import write_atomic
from sdc_forensics.trace.format import FORMAT_VERSION, MAX_STEP
from sdc_forensics.trace.mesh import ShardMesh
from sdc_forensics.untrusted import Fields, describe, is_int, load_json

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
    #: backward-compatible revision of ``format_version`` the writer of the latest attempt
    #: followed (``format.FORMAT_MINOR``); 0 for traces written before revisions were numbered
    format_minor: int = 0
    recipe: str | None = None
    #: job settings handed to the recipe at replay (``Recorder(recipe_args=...)``); None in
    #: traces recorded without them (and before they existed): the recipe takes no arguments
    recipe_args: dict[str, Any] | None = None
    #: the training framework whose adapter wrote the trace (``sdc_forensics.integrations``):
    #: ``{"name": "transformers", "version": "5.24.0", "adapter": "sdc_forensics.integrations.hf"}``;
    #: None for a loop that calls the recorder itself (and every trace written before it existed)
    framework: dict[str, str] | None = None
    reduction: str = "mean"
    checkpoint_every: int | None = None
    audit_every: int | None = None
    weights_every: int = 1
    node_of_rank: tuple[int, ...] = ()
    attempts: tuple[Attempt, ...] = ()
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the mesh of a sharded job (FSDP2, HSDP; ``trace/mesh.py``); None for DDP and every trace
    #: written before sharded jobs were recorded
    parallel: ShardMesh | None = None

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
        # a 1.0 manifest stays byte for byte what it was (golden files)
        if not self.format_minor:
            del doc["format_minor"]
        # an optional key: manifests without job settings stay as they were
        if self.recipe_args is None:
            del doc["recipe_args"]
        # optional too: a hand-written loop's manifest is unchanged
        if self.framework is None:
            del doc["framework"]
        # and a DDP job's
        if self.parallel is None:
            del doc["parallel"]
        else:
            doc["parallel"] = self.parallel.to_json()
        return doc


#: Rank file names hold 5 digits of rank and 3 of attempt (``rank-RRRRR.attempt-AAA.sdct``).
def audit_reach(node_of_rank: tuple[int, ...]) -> str | None:
    """What audits cannot do in a job whose ranks span these nodes (one sentence), or None.

    An audit recomputes a rank's microbatch on a rank of *another* node, and a mismatch is
    resolved by a third recomputation on a third node (``recorder/audit.py``): on one node no
    audit runs, on two a mismatch cannot name the rank. The recorder says it at attach and
    ``bisect`` says it instead of "enable audits"; both call this.
    """
    nodes = len(set(node_of_rank))
    if nodes >= 3 or not node_of_rank:
        return None
    if nodes == 1:
        return (
            "every rank is on one node, so audits never run (an audit recomputes a rank's microbatch on another node); "
            "they need ranks on 2 nodes, and 3 to name the rank that computed wrongly "
            "(RecorderOptions(node_of_rank=...) pretends ranks are nodes, for tests)"
        )
    return (
        "the ranks span 2 nodes: an audit mismatch is recorded but cannot name the rank that computed wrongly "
        "(the majority of three needs a third node)"
    )


MAX_WORLD_SIZE = 100_000
MAX_ATTEMPT = 999
MAX_FORMAT_MINOR = 0xFFFF
_HINT = f"it was not written by sdc-forensics or is damaged: restore {MANIFEST_NAME} from the run"
_IDENTITY_STRINGS = ("host", "gpu_uuid", "pci_bus_id", "device", "slurm_job_id", "slurm_node", "k8s_node")


def _rank_identity(doc: Any, where: str) -> RankIdentity:
    f = Fields(doc, where, TraceError, _HINT)
    return RankIdentity(
        rank=f.int("rank", lo=0, hi=MAX_WORLD_SIZE - 1),
        node_rank=f.int("node_rank", -1, lo=-1),
        local_rank=f.int("local_rank", -1, lo=-1),
        **{name: f.str(name, "", max_len=1024) for name in _IDENTITY_STRINGS},
    )


def _attempt(doc: Any, where: str) -> Attempt:
    f = Fields(doc, where, TraceError, _HINT)
    return Attempt(
        attempt=f.int("attempt", lo=0, hi=MAX_ATTEMPT),
        start_step=f.int("start_step", lo=0, hi=MAX_STEP),
        started_ns=f.int("started_ns", 0, lo=-(1 << 63), hi=(1 << 63) - 1),
        torch_version=f.str("torch_version", "", max_len=1024),
        cuda_version=f.str("cuda_version", "", max_len=1024),
        determinism=f.obj("determinism", {}),
        ranks=tuple(_rank_identity(r, f"{where}, rank entry {i}") for i, r in enumerate(f.list("ranks", ()))),
    )


def _fingerprint(doc: Any, where: str) -> FingerprintSettings:
    f = Fields(doc, where, TraceError, _HINT)
    grad_dtype = f.str("grad_dtype", "float32", max_len=64)
    # the recorder's own online checks need a tolerance model for it
    if grad_dtype not in UNIT_ROUNDOFF:
        raise f.fail("grad_dtype", "one of " + ", ".join(UNIT_ROUNDOFF), grad_dtype)
    return FingerprintSettings(
        seed=f.int("seed", lo=0, hi=(1 << 64) - 1),
        sketch_k=f.int("sketch_k", lo=1, hi=0xFFFF),  # a u2 in every rank file's header
        block_words=f.int("block_words", 1024, lo=1, hi=1 << 40),
        block_elems=f.int("block_elems", 1024, lo=1, hi=1 << 40),
        grad_dtype=grad_dtype,
    )


def _recipe_args(f: Fields) -> dict[str, Any] | None:
    """``recipe_args``: absent or null (None), else an object of identifier keys (keyword arguments)."""
    if f.doc.get("recipe_args") is None:
        return None
    args = f.obj("recipe_args")
    bad = next((k for k in args if not k.isidentifier()), None)
    if bad is not None:
        raise f.fail("recipe_args", "an object whose keys are Python identifiers (the recipe's keyword arguments)", bad)
    return args


def _framework(f: Fields) -> dict[str, str] | None:
    """``framework``: absent or null (None), else an object of short strings (name, version, adapter)."""
    if f.doc.get("framework") is None:
        return None
    doc = f.obj("framework")
    for key in ("name", "version", "adapter"):
        value = doc.get(key, "")
        if not isinstance(value, str) or len(value) > 200:
            raise f.fail("framework", f'an object whose "{key}" is a string of at most 200 characters', value)
    return {key: doc.get(key, "") for key in ("name", "version", "adapter")}


def _parallel(f: Fields, world_size: int) -> ShardMesh | None:
    """``parallel``: absent or null (None: DDP), else the mesh of a sharded job."""
    if f.doc.get("parallel") is None:
        return None
    try:
        return ShardMesh.from_json(f.doc["parallel"], world_size)
    except ValueError as exc:
        raise f.error(f'{f.where}: "parallel" {exc}; {f.hint}') from None


@reader
def parse_manifest(doc: Any, where: str = MANIFEST_NAME) -> Manifest:
    """Turn a decoded manifest document into a :class:`Manifest`, or raise :class:`TraceError`.

    Every field is type- and range-checked here, so that nothing past the reader meets a number
    where it expects a string (a renderer) or a step that does not fit in 64 bits.
    """
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise TraceError(f'{where} is not an sdc-forensics trace manifest (no "format": "{FORMAT_NAME}")')
    version = doc.get("format_version")
    if not is_int(version) or version != FORMAT_VERSION:
        raise TraceError(
            f"{where} has trace format version {version if is_int(version) else describe(version)}; this sdc-forensics reads version "
            f"{FORMAT_VERSION}: upgrade sdc-forensics, or re-export the trace with the version that wrote it"
        )
    f = Fields(doc, where, TraceError, _HINT)
    world_size = f.int("world_size", lo=1, hi=MAX_WORLD_SIZE)
    reduction = f.str("reduction", "mean")
    if reduction not in REDUCTIONS:
        raise f.fail("reduction", " or ".join(f'"{r}"' for r in REDUCTIONS), reduction)
    return Manifest(
        format_version=version,
        world_size=world_size,
        format_minor=f.int("format_minor", 0, lo=0, hi=MAX_FORMAT_MINOR),
        fingerprint=_fingerprint(f.doc.get("fingerprint"), f'{where}, "fingerprint"'),
        recipe=f.str("recipe", None, none=True, max_len=1024),
        recipe_args=_recipe_args(f),
        framework=_framework(f),
        reduction=reduction,
        checkpoint_every=f.int("checkpoint_every", None, lo=1, hi=MAX_STEP, none=True),
        audit_every=f.int("audit_every", None, lo=0, hi=MAX_STEP, none=True),
        weights_every=f.int("weights_every", 1, lo=0, hi=MAX_STEP),
        node_of_rank=f.ints("node_of_rank", (), lo=0),
        attempts=tuple(_attempt(a, f"{where}, attempt entry {i}") for i, a in enumerate(f.list("attempts", ()))),
        extra=f.obj("extra", {}),
        parallel=_parallel(f, world_size),
    )


@reader
def read_manifest(trace_dir: str | os.PathLike) -> Manifest:
    """Read and validate ``TRACE_DIR/manifest.json``."""
    path = Path(trace_dir) / MANIFEST_NAME
    if not path.is_file():
        raise TraceError(_not_a_trace(Path(trace_dir)))
    try:
        doc = load_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise TraceError(
            f"{path} is not valid JSON ({exc}); the manifest is damaged: restore it from the run"
        ) from None
    return parse_manifest(doc, str(path))


def _not_a_trace(where: Path) -> str:
    """Why ``where`` is not a trace directory, and the trace it most likely meant (every case exit 3)."""
    if not where.exists():
        return (
            f"{where} does not exist; pass the trace directory the recorder wrote (the one that holds {MANIFEST_NAME})"
        )
    if not where.is_dir():
        inside = where.parent if (where.parent / MANIFEST_NAME).is_file() else None
        hint = (
            f"pass the directory that holds it: {inside}"
            if inside is not None
            else "pass the trace directory the recorder wrote"
        )
        return f"{where} is a file, not a trace directory; {hint}"
    try:
        below = sorted(d for d in where.iterdir() if d.is_dir() and (d / MANIFEST_NAME).is_file())[:3]
    except OSError:
        below = []
    if below:
        return (
            f"{where} has no {MANIFEST_NAME}, but {' and '.join(map(str, below))} {'has' if len(below) == 1 else 'have'} one: pass "
            + ("it" if len(below) == 1 else "one of them")
            + " (the trace directory, one level down)"
        )
    return f"{where} has no {MANIFEST_NAME}: not a trace directory (or the run never started)"


def write_manifest(trace_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write the manifest atomically (readers never see half a manifest)."""
    return write_atomic(
        Path(trace_dir) / MANIFEST_NAME, json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n"
    )
