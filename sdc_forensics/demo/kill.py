"""Kill drills: SIGKILL one rank of the demo at a chosen point of a chosen step.

``DemoConfig(kill_rank=R, kill_step=S, kill_point=P)`` arms rank ``R``; the points
(:class:`KillPoint`) are deterministic, so a drill says exactly what a trace must survive:

* ``after-record``: right after rank R wrote its STEP record of step S;
* ``forward``: inside the forward pass of step S's first microbatch (a forward pre-hook);
* ``backward``: inside the backward pass of step S's last microbatch, the one whose gradients
  DDP all-reduces, while the buckets already ready are in flight (a gradient hook on the first
  parameter, the last one backward reaches);
* ``record-write``: in the middle of writing step S's STEP record: ``kill_bytes`` of its bytes
  reach the file (default: half), then SIGKILL. A write to a local file is not torn by a signal,
  so this stands in for the worst a dying process or machine can leave: one torn record at the tail;
* ``checkpoint``: while checkpoint S (theta_S, written after step S - 1) is saved: rank 0, the
  saver of a clean run, dies after writing half of the file (its note, written after the save,
  never is); any other rank dies on entering the checkpoint, while rank 0 may be writing.

The other ranks are then stuck in a collective or fail on it; the demo's launcher ends them (as
torchrun would). Only the demo uses this module.
"""

from __future__ import annotations

import enum
import io
import os
import signal
from typing import Any

from sdc_forensics.trace import format as F


class KillPoint(str, enum.Enum):
    """Where in a step the armed rank is killed."""

    AFTER_RECORD = "after-record"
    FORWARD = "forward"
    BACKWARD = "backward"
    RECORD_WRITE = "record-write"
    CHECKPOINT = "checkpoint"


def die() -> None:
    """SIGKILL this process: no handler, no ``finally``, no flush runs."""
    os.kill(os.getpid(), signal.SIGKILL)


class Killer:
    """The kill point of one rank (inert on every rank but the armed one).

    Args:
        point: where to kill.
        step: the step (for ``checkpoint``: the checkpoint step N).
        armed: this rank is the one to kill.
        kill_bytes: ``record-write``: bytes of the STEP record written before the kill.
    """

    def __init__(self, point: KillPoint, step: int | None, *, armed: bool, kill_bytes: int | None = None) -> None:
        self.point = KillPoint(point)
        self.step = step
        self.armed = armed and step is not None
        self.kill_bytes = kill_bytes
        self._now: int | None = None
        self._forwards = 0
        self._count = 0

    def attach(self, module, rec) -> None:
        """Install the hooks the point needs on the bare module and the recorder's writer."""
        if not self.armed:
            return
        if self.point in (KillPoint.FORWARD, KillPoint.BACKWARD):
            module.register_forward_pre_hook(self._on_forward)
        if self.point is KillPoint.BACKWARD:
            next(iter(module.parameters())).register_hook(self._on_grad)
        if self.point is KillPoint.RECORD_WRITE:
            self._wrap_append(rec.writer)

    def begin(self, step: int, num_microbatches: int) -> None:
        """Step ``step`` starts, with ``num_microbatches`` forward passes."""
        self._now, self._forwards, self._count = step, 0, num_microbatches

    def after_record(self, step: int) -> None:
        if self.armed and self.point is KillPoint.AFTER_RECORD and step == self.step:
            die()

    def before_checkpoint(self, step: int, rank: int) -> None:
        """Entering checkpoint ``step``: a rank that does not save it dies here."""
        if self.armed and self.point is KillPoint.CHECKPOINT and step == self.step and rank != 0:
            die()

    def save(self, state: Any, path) -> None:
        """``Recorder.checkpoint``'s ``save``: ``torch.save``, or half the file then death."""
        import torch

        if not (self.armed and self.point is KillPoint.CHECKPOINT and int(state.get("step", -1)) == self.step):
            torch.save(state, path)
            return
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        with open(path, "wb", buffering=0) as handle:
            handle.write(data[: len(data) // 2])
        die()

    def _on_forward(self, module, args) -> None:
        self._forwards += 1
        if self.point is KillPoint.FORWARD and self._now == self.step:
            die()

    def _on_grad(self, grad):
        # the synchronising microbatch
        if self._now == self.step and self._forwards == self._count:
            die()
        return grad

    def _wrap_append(self, writer) -> None:
        append = writer.append

        def torn_append(records) -> None:
            if int(records["kind"][0]) == int(F.Kind.STEP) and int(records["step"][0]) == self.step:
                F.seal(records)
                size = records.dtype.itemsize
                cut = size // 2 if self.kill_bytes is None else self.kill_bytes
                # the writer's file, at its end
                with open(writer.path, "ab", buffering=0) as handle:
                    handle.write(records.tobytes()[: max(1, min(cut, size - 1))])
                die()
            append(records)

        writer.append = torn_append
