"""The trace format: round trip, golden bytes, torn tails, checksums, attempts, export."""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdc_forensics.errors import TraceError
from sdc_forensics.trace import format as F
from sdc_forensics.trace.export import export_csv
from sdc_forensics.trace.reader import Trace
from sdc_forensics.trace.writer import RankTraceWriter
from tests.trace import golden

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden-v1"


def _write_manifest(path: Path, world_size: int = 1) -> None:
    from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, Manifest, write_manifest

    write_manifest(
        path,
        Manifest(
            format_version=1,
            world_size=world_size,
            fingerprint=FingerprintSettings(seed=1, sketch_k=8),
            attempts=(Attempt(attempt=0, start_step=0),),
        ),
    )


def test_record_size_is_a_few_hundred_bytes():
    assert F.record_size(8) == 216
    assert F.record_size(8) % 8 == 0


def test_round_trip_writer_reader(tmp_path):
    _write_manifest(tmp_path, world_size=1)
    with RankTraceWriter(tmp_path, rank=0, attempt=0, world_size=1, sketch_k=8, seed=1) as writer:
        for step in range(5):
            rec = writer.new(F.Kind.STEP, step)
            rec["loss"] = step * 0.5
            rec["local_digest"] = np.uint64(2**64 - 1 - step)
            rec["local_sketch"] = np.arange(8) * step
            rec["flags"] = int(F.Flag.CONTIGUOUS_IDS)
            rec["microbatch_first"], rec["microbatch_count"] = 10 * step, 3
            writer.append(rec)
        writer.append(writer.new(F.Kind.STEP, 5))
        ids = np.array([7, 3, 99, -1] + list(range(40)), dtype=np.int64)
        writer.append(writer.ids_records(5, ids))
    trace = Trace.open(tmp_path)
    assert trace.damage() == []
    (window,) = list(trace.step_windows())
    assert window.steps.tolist() == [0, 1, 2, 3, 4, 5]
    assert window.present.all()
    assert window.records["loss"][:5, 0].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert int(window.records["local_digest"][4, 0]) == 2**64 - 5
    assert window.records["local_sketch"][3, 0].tolist() == (np.arange(8) * 3).tolist()
    assert trace.microbatch_ids(window.records[2, 0]).tolist() == [20, 21, 22]
    step5 = window.records[5, 0].copy()
    step5["microbatch_count"] = len(ids)
    assert trace.microbatch_ids(step5).tolist() == ids.tolist()


def test_golden_file_is_byte_exact_and_reads(tmp_path):
    golden.build(tmp_path)
    for name in ("rank-00000.attempt-000.sdct", "rank-00001.attempt-000.sdct", "manifest.json"):
        assert (tmp_path / name).read_bytes() == (GOLDEN / name).read_bytes(), (
            f"{name} drifted from the golden v1 bytes"
        )
    trace = Trace.open(GOLDEN)
    assert trace.manifest.world_size == 2 and trace.manifest.format_version == 1
    assert trace.damage() == []
    (window,) = list(trace.step_windows())
    np.testing.assert_array_equal(window.records["loss"][:, 1], [2.5, 2.25, 2.0])
    assert int(window.records["reduced_digest"][0, 0]) == 0xFEDC_BA98_7654_3210
    (ck,) = [r for r in trace.records(F.Kind.CHECKPOINT) if r["rank"] == 0]
    assert int(ck["step"]) == 3 and int(ck["aux_digest"]) == 0x0123_4567_89AB_CDEF


def test_cut_at_every_offset_of_last_record_reports_torn_tail(tmp_path):
    source = GOLDEN / "rank-00000.attempt-000.sdct"
    data = source.read_bytes()
    size = F.record_size(8)
    last_start = len(data) - size
    for cut in range(last_start + 1, len(data)):
        target = tmp_path / f"cut{cut}"
        shutil.copytree(GOLDEN, target)
        (target / source.name).write_bytes(data[:cut])
        trace = Trace.open(target)
        torn = [d for d in trace.damage() if d.kind == "torn_tail"]
        assert len(torn) == 1 and torn[0].rank == 0 and torn[0].record_index == 3, cut
        rank0 = trace.records(rank=0)
        assert len(rank0) == 3 and rank0["step"].tolist() == [0, 1, 2]
        shutil.rmtree(target)


def test_flipped_byte_caught_with_rank_and_index(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "t")
    path = tmp_path / "t" / "rank-00001.attempt-000.sdct"
    size = F.record_size(8)
    for offset_in_record in (0, 9, 33, 150, size - 1):
        data = bytearray((GOLDEN / path.name).read_bytes())
        data[F.HEADER_SIZE + size * 1 + offset_in_record] ^= 0x10
        path.write_bytes(bytes(data))
        trace = Trace.open(tmp_path / "t")
        bad = [d for d in trace.damage() if d.kind == "bad_checksum"]
        assert [(d.rank, d.record_index) for d in bad] == [(1, 1)], offset_in_record
        # the bad record is never used: step 1 is reported missing on rank 1
        (window,) = list(trace.step_windows())
        assert not window.present[1, 1] and window.present[1, 0]
        assert any(d.kind == "missing_steps" and d.rank == 1 for d in trace.damage())


def test_damaged_header_and_missing_rank(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "t")
    path = tmp_path / "t" / "rank-00001.attempt-000.sdct"
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    kinds = {(d.kind, d.rank) for d in Trace.open(tmp_path / "t").damage()}
    assert ("bad_header", 1) in kinds and ("missing_rank", 1) in kinds


def test_attempts_stay_apart_latest_wins(make_trace, tmp_path):
    path = make_trace(ranks=3, steps=10, bulk=True, path=tmp_path / "run")
    make_trace(ranks=3, steps=6, bulk=True, attempt=1, start_step=6, path=path, seed=7)
    trace = Trace.open(path)
    assert sorted({(f.rank, f.attempt) for f in trace.files}) == [(r, a) for r in range(3) for a in (0, 1)]
    (window,) = list(trace.step_windows())
    assert window.steps.tolist() == list(range(12))
    assert (window.attempt[:6] == 0).all() and (window.attempt[6:] == 1).all()
    assert window.superseded[6:10].all() and not window.superseded[:6].any() and not window.superseded[10:].any()
    assert len(trace.manifest.attempts) == 2 and trace.manifest.attempts[1].start_step == 6


def test_windows_cover_all_steps_with_bounded_tables(make_trace):
    trace = Trace.open(make_trace(ranks=4, steps=50, bulk=True))
    windows = list(trace.step_windows(window=16))
    assert [w.records.shape for w in windows] == [(16, 4), (16, 4), (16, 4), (2, 4)]
    assert np.concatenate([w.steps for w in windows]).tolist() == list(range(50))
    assert all(w.present.all() for w in windows)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "not valid JSON"),
        (lambda p: (p / "manifest.json").write_text('{"format": "other"}'), "not an sdc-forensics trace"),
        (
            lambda p: (p / "manifest.json").write_text('{"format": "sdc-forensics-trace", "format_version": 99}'),
            "version 99",
        ),
    ],
)
def test_unusable_traces_raise_trace_error(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(TraceError, match=message):
        Trace.open(tmp_path)


def test_export_csv_round_trips_values(make_trace):
    trace = Trace.open(make_trace(ranks=2, steps=5, bulk=True))
    buffer = io.StringIO()
    assert export_csv(trace, buffer) == 10
    rows = list(csv.DictReader(io.StringIO(buffer.getvalue())))
    (window,) = list(trace.step_windows())
    assert rows[3]["step"] == "1" and rows[3]["rank"] == "1"
    assert int(rows[3]["weights_digest"], 16) == int(window.records["weights_digest"][1, 1])
    assert float(rows[3]["loss"]) == float(window.records["loss"][1, 1])
    assert float(rows[3]["local_sketch_2"]) == float(window.records["local_sketch"][1, 1, 2])


def test_synthetic_allreduce_all_is_every_rank_and_the_old_spelling_still_reads(tmp_path):
    """``PlantedFault(kind="allreduce-all")`` moves the reduced sketch on every rank, as the
    injection location of that name does; the old spelling ``allreduce`` plants the same bytes."""
    from sdc_forensics.trace.synthetic import PlantedFault, write_synthetic_trace

    assert PlantedFault(kind="allreduce", step=3, rank=1) == PlantedFault(kind="allreduce-all", step=3, rank=1)
    with pytest.raises(ValueError, match="unknown planted fault kind 'allreduce-one'"):
        PlantedFault(kind="allreduce-one", step=3, rank=1)
    new = write_synthetic_trace(
        tmp_path / "new", num_ranks=3, num_steps=6, faults=(PlantedFault(kind="allreduce-all", step=3, rank=1),)
    )
    old = write_synthetic_trace(
        tmp_path / "old", num_ranks=3, num_steps=6, faults=(PlantedFault(kind="allreduce", step=3, rank=1),)
    )
    for rank in range(3):
        name = f"rank-{rank:05d}.attempt-000.sdct"
        assert (new / name).read_bytes()[F.HEADER_SIZE :] == (old / name).read_bytes()[
            F.HEADER_SIZE :
        ]  # records (the header has a time)
    (window,) = list(Trace.open(new).step_windows())
    moved = (
        window.records["reduced_sketch"][:, :, 0] != window.records["reduced_sketch"][:, :1, 0]
    )  # (S, R) vs rank 0: equal everywhere
    assert (
        not moved.any() and window.records["reduced_sketch"][3, :, 0].min() > 500
    )  # every rank's sketch moved at step 3
