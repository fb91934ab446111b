"""Append-only writer of one rank file (one per rank per attempt).

Each record is sealed with its checksum and written with one ``write`` call, then flushed to the
operating system, so a process killed at any point leaves every complete record readable and at
most one torn record at the tail (which the reader reports). ``fsync=True`` also survives a
machine crash, at a cost of one ``fsync`` per step. :meth:`RankTraceWriter.finish` ends the file
with an END record: a file without one was cut short.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from sdc_forensics.trace import format as F


def rank_file_name(rank: int, attempt: int) -> str:
    """File name of ``rank``'s records in ``attempt``."""
    return f"rank-{rank:05d}.attempt-{attempt:03d}.sdct"


def make_header(*, rank: int, attempt: int, world_size: int, sketch_k: int, seed: int) -> np.ndarray:
    """A sealed file header."""
    header = np.zeros(1, dtype=F.HEADER_DTYPE)
    header["magic"] = F.FILE_MAGIC
    header["format_version"] = F.FORMAT_VERSION
    header["header_size"] = F.HEADER_SIZE
    header["record_size"] = F.record_size(sketch_k)
    header["sketch_k"] = sketch_k
    header["rank"] = rank
    header["attempt"] = attempt
    header["world_size"] = world_size
    header["seed"] = seed % (1 << 64)
    header["created_ns"] = time.time_ns()
    header["checksum"] = F.checksums(header)
    return header


class RankTraceWriter:
    """Writes the records of one rank in one attempt.

    Args:
        trace_dir: the trace directory (created if missing).
        rank: global rank.
        attempt: attempt number (a resumed run uses the previous attempt + 1).
        world_size: number of ranks.
        sketch_k: sketch projections per record.
        seed: fingerprint seed.
        fsync: ``fsync`` after every :meth:`append` (off by default: a flush survives a killed
            process; only a machine crash needs ``fsync``).
    """

    def __init__(
        self,
        trace_dir: str | os.PathLike,
        *,
        rank: int,
        attempt: int,
        world_size: int,
        sketch_k: int,
        seed: int,
        fsync: bool = False,
    ) -> None:
        self.rank = rank
        self.attempt = attempt
        self.sketch_k = sketch_k
        self.dtype = F.record_dtype(sketch_k)
        self.path = Path(trace_dir) / rank_file_name(rank, attempt)
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        # never overwrite an earlier attempt
        self._file = open(self.path, "xb", buffering=0)
        self._file.write(
            make_header(rank=rank, attempt=attempt, world_size=world_size, sketch_k=sketch_k, seed=seed).tobytes()
        )

    def new(self, kind: F.Kind, step: int, count: int = 1) -> np.ndarray:
        """Zeroed records of ``kind`` for ``step`` with the identity fields filled."""
        rec = np.zeros(count, dtype=self.dtype)
        rec["magic"] = F.RECORD_MAGIC
        rec["kind"] = int(kind)
        rec["step"] = step
        rec["rank"] = self.rank
        rec["attempt"] = self.attempt
        rec["time_ns"] = time.time_ns()
        rec["aux_rank"] = -1
        return rec

    def ids_records(self, step: int, ids: np.ndarray) -> np.ndarray:
        """``IDS`` records carrying ``ids`` (int64), to follow the record they belong to."""
        per = F.ids_per_record(self.sketch_k)
        ids = np.asarray(ids, dtype="<i8")
        count = max(1, -(-ids.size // per))
        recs = self.new(F.Kind.IDS, step, count)
        raw = recs.view(np.uint8).reshape(count, -1)
        payload = np.zeros(count * per, dtype="<i8")
        payload[: ids.size] = ids
        raw[:, 32 : 32 + 8 * per] = payload.view(np.uint8).reshape(count, -1)
        # the count is the owning record's microbatch_count
        return recs

    def append(self, records: np.ndarray) -> None:
        """Seal and write records in one ``write``; flushed to the OS before returning."""
        F.seal(records)
        self._file.write(records.tobytes())
        if self._fsync:
            os.fsync(self._file.fileno())

    def finish(self, *, last_step: int, num_steps: int, on_error: bool = False) -> None:
        """Append the END record (format 1.1) and close the file; a no-op once closed.

        Args:
            last_step: the last step this rank wrote a STEP record for in this attempt (the
                attempt's first step when ``num_steps`` is 0).
            num_steps: STEP records written in this attempt.
            on_error: the recorder is closed while an exception propagates (an alarm with policy
                ``raise``, a collective that failed because a peer died, ...).
        """
        if self._file.closed:
            return
        end = self.new(F.Kind.END, last_step)
        end["aux_value"] = num_steps
        end["flags"] = int(F.Flag.CLOSED_ON_ERROR) if on_error else 0
        self.append(end)
        self.close()

    def close(self) -> None:
        """Close the file without an END record (idempotent): readers of a 1.1 trace then take the
        rank as cut short; :meth:`finish` is the normal end."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "RankTraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
