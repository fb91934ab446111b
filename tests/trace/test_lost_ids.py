"""A step's microbatch IDs held in records that fail their checksum: the reader says which step of
which rank file lost them (a ``TraceError``), and the replay stops before that step instead of
failing on it (a hostile file found in a new user's run: a ``ValueError`` from ``reshape``, exit 3)."""

from __future__ import annotations

import numpy as np
import pytest

from sdc_forensics.errors import TraceError
from sdc_forensics.trace import format as F
from sdc_forensics.trace.reader import Trace
from sdc_forensics.trace.writer import RankTraceWriter
from tests.factories import write_trace

IDS = [7, 3, 11]  # not contiguous: the recorder writes them in an IDS record after the STEP record


def _with_ids(path, *, damaged: bool):
    """A 2-rank trace whose rank 0 took microbatches ``IDS`` at step 1, their IDS record damaged or not."""
    write_trace(path, ranks=2, steps=3)
    name = path / "rank-00000.attempt-000.sdct"
    raw = name.read_bytes()
    header, body = raw[: F.HEADER_SIZE], raw[F.HEADER_SIZE :]
    sketch_k = int(np.frombuffer(header, dtype=F.HEADER_DTYPE)[0]["sketch_k"])
    records = np.frombuffer(body, dtype=F.record_dtype(sketch_k)).copy()
    at = int(np.flatnonzero((records["kind"] == int(F.Kind.STEP)) & (records["step"] == 1))[0])
    records[at]["flags"] = int(records[at]["flags"]) & ~int(F.Flag.CONTIGUOUS_IDS)
    records[at]["microbatch_count"] = len(IDS)
    F.seal(records)
    ids = RankTraceWriter.ids_records(_Writer(sketch_k), 1, np.array(IDS))
    F.seal(ids)
    if damaged:
        ids["checksum"] ^= np.uint64(1)
    name.write_bytes(header + records[: at + 1].tobytes() + ids.tobytes() + records[at + 1 :].tobytes())
    return Trace.open(path)


class _Writer:
    """What ``RankTraceWriter.ids_records`` reads of its writer."""

    def __init__(self, sketch_k: int) -> None:
        self.sketch_k, self.rank, self.attempt, self.dtype = sketch_k, 0, 0, F.record_dtype(sketch_k)

    new = RankTraceWriter.new


def _step_record(trace, step: int):
    recs = trace.records(F.Kind.STEP, rank=0)
    return recs[recs["step"] == step][0]


def test_ids_in_a_sound_record_are_read(tmp_path):
    trace = _with_ids(tmp_path / "trace", damaged=False)
    record = _step_record(trace, 1)
    assert trace.has_microbatch_ids(record)
    assert trace.microbatch_ids(record).tolist() == IDS


def test_ids_in_a_damaged_record_are_refused_with_the_file_and_the_step(tmp_path):
    trace = _with_ids(tmp_path / "trace", damaged=True)
    record = _step_record(trace, 1)
    assert not trace.has_microbatch_ids(record)
    assert trace.has_microbatch_ids(_step_record(trace, 2))  # contiguous: no IDS record needed
    with pytest.raises(TraceError, match=r"rank-00000\.attempt-000\.sdct: rank 0's microbatch IDs of step 1 are lost"):
        trace.microbatch_ids(record)
    assert any(d.kind == "bad_checksum" for d in trace.damage())
