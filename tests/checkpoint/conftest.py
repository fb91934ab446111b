"""Factories for checkpoint tests: safetensors files written byte by byte, demo-like runs with a
trace, checkpoint notes and ``torch.save`` checkpoints, and file checksums.

``make_run(ranks=3, steps=8, checkpoint_every=2, diverge=(step, rank), save_from=rank)`` trains
the demo recipe in one process (every replica is the same model, as under DDP), writes STEP
records with the real weights digests of every replica (a diverged replica holds the healthy
weights with one bit flipped from ``step``'s update on), and saves and notes a checkpoint every
``checkpoint_every`` steps, as the recorder does.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from sdc_forensics.demo.recipe import DemoRecipe
from sdc_forensics.fingerprint import constants as C
from sdc_forensics.statedict import state_digests, weights_digest
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, hex64, write_checkpoint_note
from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, Manifest, RankIdentity, write_manifest
from sdc_forensics.trace.writer import RankTraceWriter


def tree_sha256(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path`` itself), to prove inputs unchanged."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def write_safetensors_raw(path: Path, header: dict, data: bytes, *, header_len: int | None = None) -> Path:
    """A safetensors file from a header dict and data bytes; ``header_len`` overrides the prefix."""
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)
    return path


def flip_byte(path: Path, offset: int, mask: int = 0x01) -> None:
    """XOR one byte of ``path`` in place (tests corrupt their own copies only)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        value = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([value ^ mask]))


def zip_member_offset(path: Path, suffix: str) -> tuple[int, int]:
    """``(data offset, size)`` of the stored zip member whose name ends with ``suffix``."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        member = next(m for m in archive.infolist() if m.filename.endswith(suffix))
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", raw[member.header_offset + 26 : member.header_offset + 30])
    return member.header_offset + 30 + name_len + extra_len, member.compress_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """A hand-made run: trace directory, checkpoint directory, checkpoint paths by step."""

    trace_dir: Path
    checkpoints_dir: Path
    checkpoints: dict[int, Path]
    first_divergent_step: int | None


def _flip_first_weight(model: torch.nn.Module) -> None:
    with torch.no_grad():
        param = next(iter(model.parameters()))
        param.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 30)  # an exponent bit


def write_run(root: Path, *, ranks: int = 3, steps: int = 8, checkpoint_every: int = 2, diverge: tuple[int, int] | None = None,
              save_from: int = 0, blessed: bool | None = None) -> Run:
    """Train the demo recipe for ``steps`` steps and write trace, notes and checkpoints under ``root``."""
    recipe = DemoRecipe(hidden=32)
    trace_dir, ckpt_dir = root / "trace", root / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    seed = C.DEFAULT_SEED
    idents = tuple(RankIdentity(rank=r, host=f"node{r}") for r in range(ranks))
    trace_dir.mkdir(parents=True)
    write_manifest(trace_dir, Manifest(
        format_version=F.FORMAT_VERSION, world_size=ranks, fingerprint=FingerprintSettings(seed=seed, sketch_k=C.DEFAULT_SKETCH_K),
        checkpoint_every=checkpoint_every, attempts=(Attempt(attempt=0, start_step=0, ranks=idents),),
    ))
    writers = [RankTraceWriter(trace_dir, rank=r, attempt=0, world_size=ranks, sketch_k=C.DEFAULT_SKETCH_K, seed=seed) for r in range(ranks)]
    model, optimizer, _ = recipe.build()
    names = tuple(name for name, _ in model.named_parameters())
    checkpoints: dict[int, Path] = {}

    def replica_states():
        healthy = weights_digest(model.named_parameters(), seed)
        digests = [healthy] * ranks
        diverged_model = None
        if diverge is not None and n_done > diverge[0]:
            diverged_model = copy.deepcopy(model)
            _flip_first_weight(diverged_model)
            digests[diverge[1]] = weights_digest(diverged_model.named_parameters(), seed)
        return healthy, digests, diverged_model

    def save(step: int) -> None:
        healthy, digests, diverged_model = replica_states()
        diverged = tuple(r for r in range(ranks) if digests[r] != healthy)
        source = diverged_model if (save_from in diverged and diverged_model is not None) else model
        path = ckpt_dir / f"step-{step:08d}.pt"
        payload = {"model": source.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(payload, path)
        checkpoints[step] = path
        write_checkpoint_note(trace_dir, CheckpointNote(
            step=step, path=str(path), weights_digest=hex64(healthy), param_names=names, tensors=state_digests(payload, seed),
            saved_by_rank=save_from, agreeing_ranks=tuple(r for r in range(ranks) if r not in diverged), diverged_ranks=diverged,
            blessed=(save_from not in diverged) if blessed is None else blessed,
        ))

    n_done = 0
    save(0)
    for step in range(steps):
        optimizer.zero_grad()
        for mb in recipe.microbatch_ids(step, 0, ranks):
            recipe.loss(model, recipe.fetch_microbatch(mb)).backward()
        optimizer.step()
        n_done = step + 1
        healthy, digests, _ = replica_states()
        for r, writer in enumerate(writers):
            rec = writer.new(F.Kind.STEP, step)
            flags = F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_WEIGHTS | F.Flag.WEIGHTS_CHECKED
            if digests[r] != healthy:
                flags |= F.Flag.WEIGHTS_DIVERGED
            rec["flags"] = int(flags)
            rec["weights_digest"] = digests[r]
            rec["microbatch_count"] = recipe.microbatches_per_step
            writer.append(rec)
        if n_done % checkpoint_every == 0:
            save(n_done)
    for writer in writers:
        writer.close()
    return Run(trace_dir=trace_dir, checkpoints_dir=ckpt_dir, checkpoints=checkpoints, first_divergent_step=diverge[0] if diverge else None)


@pytest.fixture
def make_run(tmp_path):
    """``make_run(ranks=3, steps=8, checkpoint_every=2, diverge=None, save_from=0)`` -> :class:`Run`."""
    counter = iter(range(1_000_000))

    def _make(**kwargs) -> Run:
        return write_run(tmp_path / f"run{next(counter)}", **kwargs)

    return _make
