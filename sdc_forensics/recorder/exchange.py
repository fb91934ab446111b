"""The recorder's own collectives: every rank's words gathered, at once or in the background.

The recorder gathers two things per step (``recorder.py``): before the update, each rank's
words (its gradient fingerprints' numbers, what the layout checks, and its status: -1 it failed
to read them, 0 no gradients, 1 both read: the failure exchange), and after it, on the steps
that compare them, each rank's weights digest (the vote). :meth:`WordExchange.gather` does it
at once (a blocking ``all_gather``). :meth:`WordExchange.launch` starts the same ``all_gather``
with ``async_op=True`` and returns a :class:`Gathered` whose :meth:`Gathered.table` waits for it
later: with ``RecorderOptions(deferred_checks=True)`` the recorder resolves a step's exchanges when
the next step begins (or before a checkpoint, or at close), so that nothing the recorder does
blocks the step on a collective (docs/recorder.md, "Deferred checks").

Every rank issues the same collectives in the same order (one gather before each update, one
after it on voting steps), deferred or not: the order a process group matches them in.

On NCCL the gathered table is copied into pinned host memory behind an event when it is
launched, so resolving it waits for that event only, never for the stream's later work; on gloo
the work is waited for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcError


#: How long a process that recorded waits at its exit, with the GIL released, before the
#: interpreter's teardown (:func:`drain_at_exit`); ``SDC_FORENSICS_EXIT_DRAIN_S`` overrides it
#: (0: no wait, as before; ``benchmarks/exit_drill.py`` compares the two).
DRAIN_AT_EXIT_S = 0.2
_drain_registered = False


def drain_at_exit() -> None:
    """Register, once per process, an exit handler that gives gloo's worker threads time to let go of
    the last collectives while the interpreter is still whole.

    A finished collective's work is freed by the worker thread that ran it, after the caller went
    on; freeing a tensor that Python let go of first frees its Python object, which takes the GIL.
    At the job's end that can fall in the interpreter's teardown, where a thread that asks for the
    GIL is ended (``pthread_exit``) inside C++ code that cannot unwind: "terminate called without an
    active exception", SIGABRT, and torchrun reports the clean job as failed. A new user's 2-rank
    job hit it; a core of it shows ``ProcessGroupGloo::AsyncWork::~AsyncWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread`` while the main
    thread is in ``Py_FinalizeEx``. Exit handlers run before the teardown starts; sleeping there
    releases the GIL, so the workers finish freeing. ``benchmarks/exit_drill.py`` counts the aborts
    with and without it, side by side (docs/benchmarks.md, "Exit drill")."""
    global _drain_registered
    if _drain_registered:
        return
    import atexit
    import os
    import time

    try:
        seconds = float(os.environ.get("SDC_FORENSICS_EXIT_DRAIN_S", DRAIN_AT_EXIT_S))
    except ValueError:
        seconds = DRAIN_AT_EXIT_S
    if seconds > 0:
        atexit.register(time.sleep, min(seconds, 10.0))
    _drain_registered = True


class Gathered:
    """An ``all_gather`` of every rank's ``(n,)`` int64 words, in flight."""

    def __init__(self, work: Any, parts: list[torch.Tensor], host: torch.Tensor | None, event: Any) -> None:
        self._work, self._parts, self._host, self._event = work, parts, host, event
        self._table: np.ndarray | None = None

    @classmethod
    def done(cls, table: np.ndarray) -> "Gathered":
        """A table known without a collective."""
        gathered = cls(None, [], None, None)
        gathered._table = table
        return gathered

    def table(self) -> np.ndarray:
        """The ``(W, n)`` int64 table (waits for the collective the first time)."""
        if self._table is None:
            if self._event is not None:
                self._event.synchronize()
                self._table = self._host.numpy()
            else:
                self._work.wait()
                self._table = torch.stack(self._parts).cpu().numpy()
            self._work = self._parts = self._host = self._event = None
        return self._table


class Summed:
    """An ``all_reduce`` (sum) of a 1-D float64 tensor over the world, in flight: :meth:`table`
    waits for it (on CUDA for the pinned host copy queued behind it, as :class:`Gathered`)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._work = dist.all_reduce(tensor, async_op=True)
        self._tensor, self._event, self._table = tensor, None, None
        if tensor.device.type == "cuda":
            # the current stream waits for the collective (the host does not); the copy is queued behind it
            self._work.wait()
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._work, self._tensor = None, host

    def table(self) -> np.ndarray:
        """The summed numbers (waits for the collective the first time)."""
        if self._table is None:
            if self._event is not None:
                self._event.synchronize()
            else:
                self._work.wait()
            self._table = self._tensor.numpy()
            self._work = self._tensor = self._event = None
        return self._table


class WordExchange:
    """The recorder's gathers over its process group (on ``device`` for NCCL, else on the CPU)."""

    def __init__(self, group: Any, world_size: int, device: torch.device) -> None:
        self.group, self.world_size = group, world_size
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        drain_at_exit()

    def gather(self, words: np.ndarray) -> np.ndarray:
        """``(W, n)`` int64 table of every rank's ``(n,)`` words (a blocking collective)."""
        tensor = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64)).to(self.device)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return torch.stack(out).cpu().numpy()

    def vote_digests(self, digest: int, groups: list[tuple[int, ...]]) -> np.ndarray:
        """``(W,)`` uint64: every rank's weights digest for the vote within ``groups``, gathered;
        where no group has two members (a pure FSDP2 job: each shard held once) nothing can
        disagree, and no collective runs: every entry is this rank's own (each rank votes alone,
        and only its own group's vote is read on it)."""
        if all(len(group) < 2 for group in groups):
            return np.full(self.world_size, digest % (1 << 64), dtype=np.uint64)
        return digests_of(self.gather(digest_words(digest)))

    def launch_vote(self, digest: int, groups: list[tuple[int, ...]]) -> Gathered:
        """:meth:`vote_digests` started in the background: no collective where no group has two members."""
        if all(len(group) < 2 for group in groups):
            return Gathered.done(np.tile(digest_words(digest), (self.world_size, 1)))
        return self.launch(digest_words(digest))

    def launch(self, words: np.ndarray) -> Gathered:
        """:meth:`gather` started in the background (``async_op=True``); no wait, no host sync."""
        tensor = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int64)).to(self.device)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        if self.device.type != "cuda":
            return Gathered(work, out, None, None)
        # the current stream waits for the collective (the host does not); the copy is queued behind it
        work.wait()
        host = torch.empty((self.world_size, tensor.numel()), dtype=torch.int64, pin_memory=True)
        host.copy_(torch.stack(out), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Gathered(None, [], host, event)


def digest_words(digest: int) -> np.ndarray:
    """A 64-bit weights digest as the one int64 word the vote gathers."""
    return np.array([digest], dtype=np.uint64).view(np.int64)


def digests_of(table: np.ndarray) -> np.ndarray:
    """``(W,)`` uint64 digests from the vote's gathered table."""
    return table[:, 0].view(np.uint64)


def raise_if_failed(table: np.ndarray, failure: BaseException | None, step: int) -> None:
    """When any rank failed to read its gradients (status -1 in the last column), every rank
    raises: the one that failed, its own error; the others, one line naming it."""
    failed = np.flatnonzero(table[:, -1] < 0)
    if failed.size:
        if failure is not None:
            raise failure
        raise SdcError(
            f"the recorder failed on rank(s) {', '.join(str(int(r)) for r in failed)} at step {step}; see their logs"
        )


@dataclasses.dataclass(kw_only=True)
class Pending:
    """A deferred step's exchanges: its words (and this rank's read failure, if any), its vote."""

    words: Gathered
    failure: BaseException | None = None
    vote: Gathered | None = None
