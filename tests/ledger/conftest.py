"""Ledger fixtures: a small trace with fake checkpoint files and notes, and record builders.

``ledger_run`` is a bulk synthetic trace (``tests/factories.write_trace``) of 40 steps with
checkpoints 0, 10, 20, 30: each a file of random bytes under ``checkpoints/`` beside the trace
(one larger than the 2 MiB a stamp samples) and a note with a weights digest and tensor digests.
Nothing here replays: the records are written as a replay would write them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from sdc_forensics.ledger import (
    CheckpointRef,
    Comparison,
    EvidenceEntry,
    IntervalRecord,
    Outcome,
    checkpoint_ref,
    ledger_path,
)
from sdc_forensics.trace.checkpoints import CheckpointNote, read_checkpoint_notes, write_checkpoint_note
from tests.factories import write_trace

CHECKPOINT_STEPS = (0, 10, 20, 30)


@dataclasses.dataclass(frozen=True)
class LedgerRun:
    trace: Path
    checkpoints: Path

    @property
    def ledger(self) -> Path:
        return ledger_path(self.trace)

    def notes(self) -> dict[int, CheckpointNote]:
        return {n.step: n for n in read_checkpoint_notes(self.trace)}

    def file(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}.pt"

    def ref(self, step: int) -> CheckpointRef:
        """The checkpoint as a writer records it now (note digests, file stamps)."""
        path = self.file(step)
        return checkpoint_ref(self.notes()[step], path if path.exists() else None)

    def record(
        self,
        start: int,
        stop: int,
        *,
        comparison: Comparison = Comparison.EXACT,
        evidence: tuple[EvidenceEntry, ...] = (),
        attempt: int = 0,
        last: int | None = None,
    ) -> IntervalRecord:
        """The record of a replay of ``[start, stop]`` that found ``evidence`` (none: clean)."""
        last = stop - 1 if last is None else last
        return IntervalRecord(
            attempt=attempt,
            start_step=start,
            stop_step=stop,
            last_step=last,
            start=self.ref(start),
            stop=self.ref(stop),
            comparison=comparison,
            reduction="gloo-ring" if comparison is Comparison.EXACT else "",
            device="cpu (x86_64, 2 threads)",
            settings={"num_threads": 2, "deterministic": True},
            outcome=Outcome.EVIDENCE if evidence else Outcome.CLEAN,
            evidence=evidence,
            wall_s=1.25,
            device_s=0.0,
        )


@pytest.fixture
def ledger_run(tmp_path) -> LedgerRun:
    trace = write_trace(tmp_path / "trace", ranks=2, steps=40, bulk=True)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    rng = np.random.default_rng(22)
    for step in CHECKPOINT_STEPS:
        size = 3 << 20 if step == 10 else 4096 + step
        path = folder / f"step-{step:08d}.pt"
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        write_checkpoint_note(
            trace,
            CheckpointNote(
                step=step,
                path=f"checkpoints/{path.name}",
                path_from_trace=f"../checkpoints/{path.name}",
                weights_digest=f"{rng.integers(0, 1 << 63):016x}",
                tensors={"model.w": f"{step:016x}", "optim.m": f"{step + 1:016x}"},
            ),
        )
    return LedgerRun(trace=Path(trace), checkpoints=folder)
