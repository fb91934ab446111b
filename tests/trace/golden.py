"""Builds the golden version-1 trace byte for byte (no clocks, no randomness).

``python -m tests.trace.golden fixtures/golden-v1`` rewrites the committed fixture; the test
checks the committed bytes equal what this builds, and that the reader reads them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, write_checkpoint_note
from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, Manifest, RankIdentity, write_manifest
from sdc_forensics.trace.writer import make_header, rank_file_name

WORLD_SIZE, STEPS, K = 2, 3, 8


def golden_records(rank: int) -> np.ndarray:
    """The records of ``rank``: one STEP per step, then an IDS-carrying step and a CHECKPOINT."""
    recs = np.zeros(STEPS + 1, dtype=F.record_dtype(K))
    recs["magic"] = F.RECORD_MAGIC
    recs["kind"][:STEPS] = int(F.Kind.STEP)
    recs["kind"][STEPS] = int(F.Kind.CHECKPOINT)
    recs["flags"][:STEPS] = int(F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_WEIGHTS | F.Flag.HAS_GRADS)
    recs["step"][:STEPS] = np.arange(STEPS)
    recs["step"][STEPS] = STEPS
    recs["rank"] = rank
    recs["time_ns"] = 1_700_000_000_000_000_000 + np.arange(STEPS + 1) * 1000
    recs["loss"][:STEPS] = [2.5, 2.25, 2.0]
    recs["input_digest"][:STEPS] = (
        np.arange(STEPS, dtype=np.uint64) + np.uint64(0x1111_0000_0000_0000) + np.uint64(rank)
    )
    recs["microbatch_first"][:STEPS] = np.arange(STEPS) * WORLD_SIZE + rank
    recs["microbatch_count"][:STEPS] = 1
    recs["local_digest"][:STEPS] = np.arange(STEPS, dtype=np.uint64) * np.uint64(7) + np.uint64(rank)
    recs["reduced_digest"][:STEPS] = np.uint64(0xFEDC_BA98_7654_3210)
    recs["weights_digest"] = np.uint64(0x0123_4567_89AB_CDEF)
    recs["local_norm"][:STEPS] = 1.5
    recs["reduced_norm"][:STEPS] = 1.25
    recs["aux_rank"] = -1
    recs["aux_rank"][STEPS] = 0
    recs["aux_digest"][STEPS] = np.uint64(0x0123_4567_89AB_CDEF)
    recs["local_sketch"][:STEPS] = np.arange(K, dtype=np.float32) + rank
    recs["reduced_sketch"][:STEPS] = np.arange(K, dtype=np.float32) + 0.5
    return F.seal(recs)


def build(out_dir: Path) -> None:
    """Write the golden trace into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = tuple(
        RankIdentity(rank=r, host="golden-host", node_rank=0, local_rank=r, device="cpu") for r in range(WORLD_SIZE)
    )
    write_manifest(
        out_dir,
        Manifest(
            format_version=F.FORMAT_VERSION,
            world_size=WORLD_SIZE,
            fingerprint=FingerprintSettings(seed=0x5DCF0E51C5, sketch_k=K),
            recipe="sdc_forensics.demo.recipe:recipe",
            checkpoint_every=STEPS,
            node_of_rank=(0, 0),
            attempts=(
                Attempt(
                    attempt=0, start_step=0, started_ns=1_700_000_000_000_000_000, torch_version="2.13.0", ranks=ranks
                ),
            ),
        ),
    )
    for rank in range(WORLD_SIZE):
        header = make_header(rank=rank, attempt=0, world_size=WORLD_SIZE, sketch_k=K, seed=0x5DCF0E51C5)
        header["created_ns"] = 1_700_000_000_000_000_000
        header["checksum"] = F.checksums(header)
        (out_dir / rank_file_name(rank, 0)).write_bytes(header.tobytes() + golden_records(rank).tobytes())
    write_checkpoint_note(
        out_dir,
        CheckpointNote(
            step=STEPS,
            path="checkpoints/step-00000003.pt",
            weights_digest="0123456789abcdef",
            saved_by_rank=0,
            agreeing_ranks=(0, 1),
        ),
    )


if __name__ == "__main__":
    build(Path(sys.argv[1]))
