"""The compiled trace scan (``trace/scan.py``, numba) against the numpy path it replaces.

Every test opens the same trace twice, once with the kernels on and once with
``SDC_FORENSICS_KERNELS=off``, and asserts the whole :class:`TriageResult` (evidence, first
suspect step, damage, counts) is equal, apart from ``scan_path``, which must name the path that
ran. The numpy path is the reference: it is the code that ran before the kernels existed. The
record checksum kernel is also checked against ``format.checksums`` directly.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdc_forensics.errors import TraceError
from sdc_forensics.triage.trace_only import TriageOptions, triage_trace
from sdc_forensics.trace import format as F
from sdc_forensics.trace import scan
from sdc_forensics.trace.reader import Trace
from tests.factories import Fault, flip_byte

numba_missing = scan._import_kernels() is None
needs_numba = pytest.mark.skipif(numba_missing, reason="numba is not installed: only the numpy path exists")
SIZE = F.record_size(8)


def _triage(trace_dir: Path, monkeypatch, kernels: bool, **options):
    monkeypatch.setenv(scan.KERNELS_ENV, "on" if kernels else "off")
    result = triage_trace(Trace.open(trace_dir), TriageOptions(**options))
    monkeypatch.delenv(scan.KERNELS_ENV)
    return result


def assert_same(trace_dir: Path, monkeypatch, **options):
    """Triage on both paths; they must agree on everything but the path's name."""
    fast = _triage(trace_dir, monkeypatch, True, **options)
    slow = _triage(trace_dir, monkeypatch, False, **options)
    assert slow.scan_path == scan.NUMPY
    assert dataclasses.replace(fast, scan_path="") == dataclasses.replace(slow, scan_path="")
    return fast


def _swap_records(path: Path, a: int, b: int) -> None:
    """Exchange two complete records of a rank file (both keep valid checksums)."""
    data = bytearray(path.read_bytes())
    ra = slice(F.HEADER_SIZE + a * SIZE, F.HEADER_SIZE + (a + 1) * SIZE)
    rb = slice(F.HEADER_SIZE + b * SIZE, F.HEADER_SIZE + (b + 1) * SIZE)
    data[ra], data[rb] = data[rb], data[ra]
    path.write_bytes(bytes(data))


@needs_numba
@pytest.mark.parametrize("window", [1, 7, 64, 1024])
@pytest.mark.parametrize("outliers", [False, True])
def test_bulk_trace_with_planted_faults(make_trace, monkeypatch, window, outliers):
    faults = (
        Fault(kind="weights", step=11, rank=2),
        Fault(kind="allreduce-all", step=12),
        Fault(kind="nonfinite", step=30, rank=5),
    )
    trace = make_trace(ranks=8, steps=90, fault=faults, bulk=True)
    result = assert_same(trace, monkeypatch, window_steps=window, outliers=outliers)
    assert result.scan_path == scan.NUMBA
    assert result.first_suspect_step == 11
    assert {e.step for e in result.findings} >= {11, 12, 30}


@needs_numba
@pytest.mark.parametrize(
    "kind", ["nonfinite", "allreduce", "allreduce-all", "weights", "audit-subject", "audit-auditor", "input", "outlier"]
)
def test_every_fault_kind_in_a_recorded_trace(make_trace, monkeypatch, kind):
    """Record-by-record traces interleave AUDIT records (files not dense): the cursor scan."""
    trace = make_trace(ranks=6, steps=40, fault=Fault(kind=kind, step=20, rank=3), audit_every=4)
    for outliers in (False, True):
        result = assert_same(trace, monkeypatch, window_steps=16, outliers=outliers)
        assert result.scan_path == scan.NUMBA


@needs_numba
@pytest.mark.parametrize("weights_every", [1, 3])
def test_sparse_weight_checks_and_a_persistent_divergence(make_trace, monkeypatch, weights_every):
    trace = make_trace(
        ranks=5,
        steps=60,
        fault=(Fault(kind="weights", step=7, rank=1), Fault(kind="weights", step=40, rank=4)),
        weights_every=weights_every,
    )
    result = assert_same(trace, monkeypatch, window_steps=9)
    onsets = [e for e in result.findings if e.kind.name == "WEIGHT_DIVERGENCE"]
    assert [e.ranks for e in onsets] == [(1,), (4,)]  # onsets only, not one per step


@needs_numba
def test_no_strict_majority_of_replica_weights(make_trace, monkeypatch):
    trace = make_trace(ranks=2, steps=12, fault=Fault(kind="weights", step=5, rank=1))  # 1 against 1
    result = assert_same(trace, monkeypatch, window_steps=4)
    assert any(e.kind.name == "WEIGHT_DIVERGENCE" and e.ranks == () for e in result.findings)


@needs_numba
def test_resumed_run_superseded_cells(make_trace, monkeypatch):
    trace = make_trace(ranks=4, steps=50, bulk=True, fault=Fault(kind="weights", step=45, rank=1))
    make_trace(
        ranks=4,
        steps=30,
        bulk=True,
        path=trace,
        attempt=1,
        start_step=30,
        seed=5,
        fault=Fault(kind="nonfinite", step=33, rank=2),
    )
    result = assert_same(trace, monkeypatch, window_steps=8)
    assert result.superseded_cells == 20 * 4
    assert result.first_suspect_step == 33  # attempt 1 re-ran step 45 cleanly


@needs_numba
@pytest.mark.parametrize("start, stop", [(None, 10), (17, None), (5, 5), (33, 70), (500, None)])
def test_step_bounds(make_trace, monkeypatch, start, stop):
    trace = make_trace(
        ranks=4,
        steps=60,
        bulk=True,
        fault=(Fault(kind="weights", step=20, rank=3), Fault(kind="allreduce-all", step=40)),
    )
    assert_same(trace, monkeypatch, window_steps=6, start_step=start, stop_step=stop)


@needs_numba
@pytest.mark.parametrize("record", [0, 13, 39])
@pytest.mark.parametrize("offset", [0, 9, 40, 100, 150, SIZE - 1])
def test_corrupted_record(make_trace, monkeypatch, record, offset):
    trace = make_trace(ranks=4, steps=40, audit_every=5, fault=Fault(kind="weights", step=25, rank=0))
    flip_byte(trace / "rank-00002.attempt-000.sdct", F.HEADER_SIZE + record * SIZE + offset, 0x10)
    result = assert_same(trace, monkeypatch, window_steps=8)
    assert any(d.kind == "bad_checksum" and d.rank == 2 for d in result.damage)


@needs_numba
@pytest.mark.parametrize("cut", [1, SIZE // 2, SIZE - 1, SIZE, 3 * SIZE + 5])
def test_torn_and_truncated_tails(make_trace, monkeypatch, cut):
    trace = make_trace(ranks=4, steps=30, bulk=True, fault=Fault(kind="nonfinite", step=28, rank=1))
    path = trace / "rank-00001.attempt-000.sdct"
    path.write_bytes(path.read_bytes()[:-cut])
    result = assert_same(trace, monkeypatch, window_steps=8)
    assert result.damage


@needs_numba
def test_missing_rank_file(make_trace, monkeypatch):
    trace = make_trace(ranks=6, steps=30, bulk=True, fault=Fault(kind="weights", step=9, rank=4))
    (trace / "rank-00002.attempt-000.sdct").unlink()
    result = assert_same(trace, monkeypatch, window_steps=8)
    assert any(d.kind == "missing_rank" for d in result.damage)


@needs_numba
def test_a_file_whose_steps_go_back_takes_the_numpy_path(make_trace, monkeypatch):
    trace = make_trace(ranks=4, steps=30, bulk=True, fault=Fault(kind="weights", step=12, rank=1))
    _swap_records(trace / "rank-00003.attempt-000.sdct", 4, 20)
    result = assert_same(trace, monkeypatch, window_steps=8)
    assert result.scan_path == scan.NUMPY  # the recorder never writes such a file: no compiled scan


@needs_numba
def test_holes_are_the_same_missing_steps(make_trace, monkeypatch):
    trace = make_trace(ranks=4, steps=30, bulk=True)
    data = bytearray((trace / "rank-00001.attempt-000.sdct").read_bytes())
    del data[F.HEADER_SIZE + 10 * SIZE : F.HEADER_SIZE + 13 * SIZE]  # steps 10-12 never written
    (trace / "rank-00001.attempt-000.sdct").write_bytes(bytes(data))
    result = assert_same(trace, monkeypatch, window_steps=4)
    assert [d for d in result.damage if d.kind == "missing_steps"][0].detail.endswith("10-12")


@needs_numba
def test_wild_step_raises_the_same_error(make_trace, monkeypatch, tmp_path):
    trace = make_trace(ranks=3, steps=10, bulk=True)
    path = trace / "rank-00000.attempt-000.sdct"
    recs = np.fromfile(path, dtype=F.record_dtype(8), offset=F.HEADER_SIZE)
    recs["step"][4] = -5
    F.seal(recs)
    with open(path, "r+b") as fh:
        fh.seek(F.HEADER_SIZE)
        fh.write(recs.tobytes())
    messages = []
    for kernels in (True, False):
        monkeypatch.setenv(scan.KERNELS_ENV, "on" if kernels else "off")
        with pytest.raises(TraceError) as info:
            triage_trace(Trace.open(trace))
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "record 4 holds step -5" in messages[0]


@needs_numba
def test_checksum_kernel_matches_numpy(make_trace, monkeypatch):
    trace = make_trace(ranks=2, steps=300, bulk=True)
    path = trace / "rank-00001.attempt-000.sdct"
    rng = np.random.default_rng(3)
    for offset in rng.integers(0, 300 * SIZE, 40):
        flip_byte(path, F.HEADER_SIZE + int(offset), int(rng.integers(1, 256)))
    monkeypatch.setenv(scan.KERNELS_ENV, "on")
    opened = Trace.open(trace)
    rank_file = next(f for f in opened.files if f.rank == 1)
    mask, summary = scan.validate(rank_file.records, 1)
    recs = rank_file.records
    expected = (F.checksums(recs) == recs["checksum"]) & (recs["magic"] == F.RECORD_MAGIC) & (recs["rank"] == 1)
    np.testing.assert_array_equal(mask, expected)
    assert summary.num_bad == int((~expected).sum()) > 0
    assert not summary.dense


@needs_numba
def test_a_clean_file_keeps_no_mask(make_trace, monkeypatch):
    """Memory flat in steps: a file whose records are all valid keeps no per-record mask."""
    monkeypatch.setenv(scan.KERNELS_ENV, "on")
    opened = Trace.open(make_trace(ranks=2, steps=50, bulk=True))
    mask = opened.valid_mask(opened.files[0])
    assert mask.all() and mask.strides == (0,)
    assert opened.file_summary(opened.files[0]).dense


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "numpy"])
def test_fallback_is_taken_and_reported_when_the_kernels_are_off(make_trace, monkeypatch, caplog, value):
    trace = make_trace(ranks=4, steps=20, bulk=True, fault=Fault(kind="weights", step=6, rank=1))
    monkeypatch.setenv(scan.KERNELS_ENV, value)
    assert scan.kernels() is None and scan.scan_path() == scan.NUMPY
    assert scan.kernels_for(10**9) is None
    with caplog.at_level(logging.INFO, logger="sdc_forensics.triage.trace_only"):
        result = triage_trace(Trace.open(trace))
    assert result.scan_path == scan.NUMPY
    assert "numpy scan path" in caplog.text
    assert result.first_suspect_step == 6


@needs_numba
def test_auto_compiles_for_large_traces_only(make_trace, monkeypatch):
    monkeypatch.delenv(scan.KERNELS_ENV, raising=False)
    small = Trace.open(make_trace(ranks=4, steps=20, bulk=True))
    assert small.kernels() is None and triage_trace(small).scan_path == scan.NUMPY
    monkeypatch.setattr(scan, "AUTO_MIN_RECORDS", 80)
    assert triage_trace(Trace.open(make_trace(ranks=4, steps=20, bulk=True))).scan_path == scan.NUMBA
    assert scan.scan_path(79) == scan.NUMPY and scan.scan_path(80) == scan.NUMBA


@needs_numba
def test_fast_path_is_reported_when_on(make_trace, monkeypatch, caplog):
    monkeypatch.setenv(scan.KERNELS_ENV, "on")
    trace = make_trace(ranks=4, steps=20, bulk=True)
    with caplog.at_level(logging.INFO, logger="sdc_forensics.triage.trace_only"):
        result = triage_trace(Trace.open(trace))
    assert result.scan_path == scan.NUMBA == scan.scan_path(0)
    assert "numba scan path" in caplog.text


def test_numpy_path_when_numba_cannot_be_imported(make_trace, monkeypatch):
    """numba is optional at run time: an import failure leaves the numpy path."""
    import builtins

    real_import = builtins.__import__

    def no_kernels(name, *args, **kwargs):
        if name == "numba" or name.endswith("scan_kernels") or (args and args[2] and "scan_kernels" in args[2]):
            raise ImportError("numba hidden by the test")
        return real_import(name, *args, **kwargs)

    scan._import_kernels.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_kernels)
    monkeypatch.delenv(scan.KERNELS_ENV, raising=False)
    try:
        assert scan.kernels() is None
        result = triage_trace(
            Trace.open(make_trace(ranks=4, steps=20, bulk=True, fault=Fault(kind="nonfinite", step=3, rank=2)))
        )
        assert result.scan_path == scan.NUMPY and result.first_suspect_step == 3
    finally:
        monkeypatch.undo()
        scan._import_kernels.cache_clear()


@needs_numba
def test_copied_trace_gives_the_same_answer(make_trace, monkeypatch, tmp_path):
    """A second trace directory (fresh caches, same bytes): same result, both paths."""
    trace = make_trace(
        ranks=9,
        steps=70,
        bulk=True,
        fault=(Fault(kind="weights", step=33, rank=8), Fault(kind="allreduce-all", step=34)),
    )
    copy = Path(shutil.copytree(trace, tmp_path / "copy"))
    assert dataclasses.replace(assert_same(trace, monkeypatch), scan_path="") == dataclasses.replace(
        assert_same(copy, monkeypatch), scan_path=""
    )


@needs_numba
def test_residuals_at_the_tolerance_edge(make_trace, monkeypatch):
    """The compiled filter must flag every step whose residual may reach the tolerance: reduced
    sketches moved to 0.999 .. 1.001 of it (both sides) give the numpy path's answer exactly."""
    from sdc_forensics.fingerprint import tolerance

    ranks, steps = 6, 400
    trace = make_trace(ranks=ranks, steps=steps, bulk=True)
    dtype = F.record_dtype(8)
    paths = [trace / f"rank-{r:05d}.attempt-000.sdct" for r in range(ranks)]
    recs = np.stack([np.fromfile(p, dtype=dtype, offset=F.HEADER_SIZE) for p in paths], axis=1)  # (S, R)
    local = recs["local_sketch"].astype(np.float64)
    expected = local.mean(axis=1)  # (S, k)
    tol = tolerance.allreduce_tolerance("float32", recs["local_norm"][:, None, :], recs["reduced_norm"][:, 0])[
        :, 0
    ]  # (S,)
    factor = np.random.default_rng(7).uniform(0.999, 1.001, steps)
    reduced = (expected[:, 0] + factor * tol).astype(np.float32)  # float32 rounding moves it either way
    for r, path in enumerate(paths):
        rows = recs[:, r].copy()
        rows["reduced_sketch"][:, 0] = reduced
        F.seal(rows)
        with open(path, "r+b") as fh:
            fh.seek(F.HEADER_SIZE)
            fh.write(rows.tobytes())
    result = assert_same(trace, monkeypatch, window_steps=64)
    flagged = [e for e in result.findings if e.kind.name == "ALLREDUCE_MISMATCH"]
    assert 0 < len(flagged) < steps  # both sides of the edge are present
