"""A rank killed mid-step (issue #9, part 6), and the bounded cost of hostile step ranges and
world sizes.

* Synthetic, fast: a rank file cut at every byte of its last STEP record (and of its END record)
  is read to its last complete record, the trace's last complete step is the last step every
  rank recorded, and the summary, ``inspect``, ``bisect`` and ``report`` say that the run stopped
  early and where.
* Real SIGKILLs through the demo (4 gloo ranks): a torn STEP record, a kill in backward while the
  all-reduce is in flight, a kill while rank 0 writes a checkpoint. What the trace must show is
  derived from the kill plan, not from the trace.
* Bounded cost: records at steps 0 and 2^53 - 1 (and a checkpoint note at 2^53 - 1) are read in
  milliseconds and kilobytes; a manifest declaring 100,000 ranks next to two rank files is
  refused with one line and exit 3.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, write_checkpoint_note
from sdc_forensics.trace.reader import Trace
from sdc_forensics.present.inspect import inspect_document as summary_document
from sdc_forensics.trace.summary import summarize
from tests.factories import assert_refused

SIZE = F.record_size(8)
RANKS, STEPS = 3, 5


def _invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _rank_file(trace: Path, rank: int, attempt: int = 0) -> Path:
    return trace / f"rank-{rank:05d}.attempt-{attempt:03d}.sdct"


def _finalise(trace: Path) -> None:
    """Make a factory trace what the 1.1 recorder leaves after a normal end: an END record closing
    every rank file (step = the last STEP, aux_value = STEP records written), format_minor 1."""
    manifest = json.loads((trace / "manifest.json").read_text())
    manifest["format_minor"] = 1
    (trace / "manifest.json").write_text(json.dumps(manifest))
    for rank in range(manifest["world_size"]):
        path = _rank_file(trace, rank)
        records = np.frombuffer(path.read_bytes()[F.HEADER_SIZE :], dtype=F.record_dtype(8))
        steps = records["step"][records["kind"] == int(F.Kind.STEP)]
        end = np.zeros(1, dtype=F.record_dtype(8))
        end["magic"], end["kind"], end["rank"], end["aux_rank"] = F.RECORD_MAGIC, int(F.Kind.END), rank, -1
        end["step"], end["aux_value"] = int(steps.max()), len(steps)
        with open(path, "ab") as handle:
            handle.write(F.seal(end).tobytes())


@pytest.fixture
def finished(make_trace) -> Path:
    """A 1.1 trace of a run that ended normally: 3 ranks, steps 0..4, a checkpoint note at 3."""
    trace = make_trace(ranks=RANKS, steps=STEPS)
    _finalise(trace)
    write_checkpoint_note(
        trace,
        CheckpointNote(
            step=3, path="ckpt/step-00000003.pt", weights_digest="0123456789abcdef", agreeing_ranks=(0, 1, 2)
        ),
    )
    return trace


def _kill_rank_1(trace: Path, cut: int) -> None:
    """Rank 1's file as a kill leaves it: STEP records 0..3 whole, ``cut`` bytes of step 4's, no END."""
    path, whole = _rank_file(trace, 1), trace / "rank-1.whole"
    if not whole.is_file():
        whole.write_bytes(path.read_bytes())
    path.write_bytes(whole.read_bytes()[: F.HEADER_SIZE + (STEPS - 1) * SIZE + cut])


# ---------------------------------------------------------------------------------------------
# synthetic: a torn tail at every byte


def test_a_finished_trace_is_finalised_and_not_stopped_early(finished, make_trace):
    end = Trace.open(finished).run_end()
    assert (
        end.finalised is True and not end.stopped_early and end.last_complete_step == STEPS - 1 and end.describe() == ""
    )
    result = _invoke("inspect", finished)
    assert result.exit_code == 0 and "run ended normally: every rank closed its trace after step 4" in result.stderr
    # a 1.0 trace (no END records) whose ranks end together: nothing to say, and no claim either way
    old = Trace.open(make_trace(ranks=RANKS, steps=STEPS)).run_end()
    assert old.finalised is None and not old.stopped_early and old.last_complete_step == STEPS - 1


def test_a_rank_cut_at_every_byte_of_its_last_record_is_read_to_its_last_complete_step(finished):
    for cut in range(SIZE):  # 0: the kill came between two records
        _kill_rank_1(finished, cut)
        trace = Trace.open(finished)
        end = trace.run_end()
        assert (end.stopped_early, end.finalised, end.last_complete_step, end.stopped_ranks) == (
            True,
            False,
            3,
            (1,),
        ), cut
        assert [(r.last_step, r.closed, r.torn_bytes) for r in end.ranks] == [
            (4, True, 0),
            (3, False, cut),
            (4, True, 0),
        ], cut
        kinds = [d.kind for d in trace.damage()]
        assert kinds == ["stopped_early"] + (["torn_tail"] if cut else []), (cut, kinds)  # the tail is not a hole
        (window,) = list(trace.step_windows())
        assert window.present[:4].all() and window.present[4].tolist() == [True, False, True], cut
        assert trace.records(rank=1)["step"].tolist() == [0, 1, 2, 3], cut  # never the torn record


def test_a_kill_while_the_end_record_is_written(finished):
    path = _rank_file(finished, 2)
    data = path.read_bytes()
    for cut in (0, 1, SIZE // 2, SIZE - 1):  # every STEP record whole; the END record torn or absent
        path.write_bytes(data[: len(data) - SIZE + cut])
        end = Trace.open(finished).run_end()
        assert (end.stopped_early, end.finalised, end.last_complete_step, end.stopped_ranks) == (
            True,
            False,
            4,
            (2,),
        ), cut
        assert "rank(s) 2 did not close their trace" in end.describe()


def test_inspect_says_the_run_stopped_early_and_where(finished):
    _kill_rank_1(finished, 100)
    result = _invoke("inspect", finished, "--json")
    assert result.exit_code == 0, result.output
    end = json.loads(result.stdout)["end"]
    assert end["stopped_early"] is True and end["finalised"] is False
    assert (end["last_complete_step"], end["stop_step"], end["stopped_ranks"], end["stopped_hosts"]) == (
        3,
        4,
        [1],
        ["node0"],
    )
    assert [r["last_step"] for r in end["ranks"]] == [4, 3, 4] and end["ranks"][1]["torn_bytes"] == 100
    assert end["summary"].startswith(
        "the run stopped early; last complete step 3 (recorded by every rank); "
        "rank 1 (host node0) stopped after step 3; step(s) 4 recorded by rank(s) 0, 2 only"
    )
    text = _invoke("inspect", finished).stderr
    assert "The run stopped early; last complete step 3" in " ".join(text.split())
    assert "where each rank's file ends" in text


def test_bisect_answers_on_what_was_recorded_and_says_the_trace_ends_early(finished):
    _kill_rank_1(finished, 7)
    result = _invoke("bisect", finished, "--trace-only", "--json")
    assert result.exit_code == 4, result.output  # clean for the trace alone: 4, nothing was replayed (issue 33)
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "clean" and doc["exit_code"] == 4
    assert doc["trace"]["damage"][0].startswith("the run stopped early; last complete step 3")
    # the ragged end is where the run stopped, not damage that makes the trace's evidence untrustworthy
    (note,) = doc["checkpoints"]
    assert not [r for r in note["reasons"] if "damaged or inconsistent" in r], note["reasons"]
    text = _invoke("bisect", finished, "--trace-only").stderr
    assert "The run stopped early; last complete step 3" in " ".join(text.split())


def test_report_says_the_run_stopped_early_and_where(finished, tmp_path):
    _kill_rank_1(finished, 50)
    out = tmp_path / "review.md"
    result = _invoke("report", finished, "--trace-only", "--json", "-o", out)
    assert result.exit_code == 4, result.output  # clean for the trace alone
    assert json.loads(result.stdout)["trace_end"]["last_complete_step"] == 3
    text = out.read_text()
    assert "**The run stopped early** at step 4: the last step every rank recorded is 3" in text
    assert "## The run stopped early" in text and "**Last complete step: 3**" in text
    assert "- **Where:** rank 1 (host `node0`) stopped after step 3; the run stopped at step 4." in text
    assert "| 1 | node0 | 3 | **no** | 50 |" in text


# ---------------------------------------------------------------------------------------------
# real SIGKILLs through the demo (4 gloo ranks, steps 0..5, checkpoints 0 and 3 (and 6))

DRILL = dict(injections=(), steps=6, checkpoint_every=3, world_size=4, timeout_s=120)


def _drill_end(out_dir: Path) -> dict:
    result = _invoke("inspect", out_dir / "trace", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert not {d["kind"] for d in doc["damage"]} & {"bad_checksum", "bad_header", "missing_steps", "missing_rank"}, (
        doc["damage"]
    )
    return doc["end"]


@pytest.mark.slow
def test_sigkill_mid_record_write(demo_run):
    """Rank 2 dies with 100 bytes of its step-4 STEP record written: the others recorded step 4."""
    out = demo_run(**DRILL, kill_rank=2, kill_step=4, kill_point="record-write", kill_bytes=100)
    end = _drill_end(out)
    assert (end["last_complete_step"], end["stop_step"], end["stopped_ranks"]) == (3, 4, [2])
    ranks = {r["rank"]: r for r in end["ranks"]}
    assert ranks[2]["torn_bytes"] == 100 and ranks[2]["last_step"] == 3 and ranks[2]["closed"] is False
    assert all(ranks[r]["last_step"] == 4 for r in (0, 1, 3))
    result = _invoke("bisect", out / "trace", "--json")  # replays from checkpoints 0 and 3, up to step 3
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "clean" and doc["trace"]["damage"][0].startswith(
        "the run stopped early; last complete step 3"
    )
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(0, "clean"), (3, "clean")]
    assert max(w["last_replayed"] for w in doc["replayed"]["windows"]) == 3


@pytest.mark.slow
def test_sigkill_in_backward_while_the_allreduce_is_in_flight(demo_run):
    """Rank 1 dies in step 2's backward: no rank can finish step 2."""
    out = demo_run(**DRILL, kill_rank=1, kill_step=2, kill_point="backward")
    end = _drill_end(out)
    assert end["stopped_early"] and end["last_complete_step"] == 1 and 1 in end["stopped_ranks"]
    assert all(r["last_step"] == 1 and r["torn_bytes"] == 0 for r in end["ranks"])
    assert not end["ranks"][1]["closed"]
    review = _invoke("report", out / "trace", "--trace-only")
    assert review.exit_code == 4 and "**Last complete step: 1**" in review.stdout  # clean for the trace alone


@pytest.mark.slow
def test_sigkill_while_rank_0_writes_a_checkpoint(demo_run):
    """Rank 0 dies half-way through checkpoint 3: half a file, no note; steps 0..2 complete."""
    out = demo_run(**DRILL, kill_rank=0, kill_step=3, kill_point="checkpoint")
    end = _drill_end(out)
    assert end["last_complete_step"] == 2 and 0 in end["stopped_ranks"]
    assert (out / "checkpoints" / "step-00000003.pt").is_file()  # the torn file is there, unnoted
    result = _invoke("bisect", out / "trace", "--trace-only", "--json")
    assert result.exit_code == 4, result.output  # clean for the trace alone
    doc = json.loads(result.stdout)
    assert [c["step"] for c in doc["checkpoints"]] == [0]  # only what was noted counts
    assert doc["trace"]["damage"][0].startswith("the run stopped early; last complete step 2")


# ---------------------------------------------------------------------------------------------
# bounded cost: a crafted step range and a crafted world size


def _crafted_range(make_trace) -> Path:
    """2 ranks, steps 0..2 and one record each at step 2^53 - 1 (valid checksums), and a
    checkpoint note at 2^53 - 1: 2^53 steps declared, 8 records held."""
    trace = make_trace(ranks=2, steps=4)
    for rank in range(2):
        path = _rank_file(trace, rank)
        raw = path.read_bytes()
        records = np.frombuffer(raw[F.HEADER_SIZE :], dtype=F.record_dtype(8)).copy()
        records["step"][-1] = F.MAX_STEP
        path.write_bytes(raw[: F.HEADER_SIZE] + F.seal(records).tobytes())
    write_checkpoint_note(trace, CheckpointNote(step=F.MAX_STEP, path="x.pt", weights_digest="0123456789abcdef"))
    return trace


def test_records_scattered_over_the_whole_step_range_cost_what_the_records_cost(make_trace):
    """Every record of 3 ranks at its own step, 2^40 apart (2^53 declared in all): one window per
    record, the work bounded by the 1,500 records the files hold, not by the span between them;
    bounded windows and a start/stop inside the span give the same cells."""
    trace = make_trace(ranks=3, steps=500, bulk=True)
    gap = 1 << 40
    for rank in range(3):
        path = _rank_file(trace, rank)
        raw = path.read_bytes()
        records = np.frombuffer(raw[F.HEADER_SIZE :], dtype=F.record_dtype(8)).copy()
        records["step"] = records["step"] * gap
        path.write_bytes(raw[: F.HEADER_SIZE] + F.seal(records).tobytes())
    started = time.monotonic()
    opened = Trace.open(trace)
    windows = list(opened.step_windows())
    assert [w.steps.tolist() for w in windows] == [[i * gap] for i in range(500)]
    assert all(w.present.all() and (w.records["rank"] == [0, 1, 2]).all() for w in windows)
    inside = list(opened.step_windows(window=F.MAX_STEP, start=100 * gap - 1, stop=102 * gap + 1))
    assert [w.steps.tolist() for w in inside] == [[100 * gap], [101 * gap], [102 * gap]]
    assert (
        list(opened.step_windows(start=gap + 1, stop=2 * gap - 1)) == []
    )  # the span between two records: nothing to visit
    assert time.monotonic() - started < 60  # ~0.2 s; a walk of the declared span would never end


def test_a_huge_step_range_costs_what_the_records_cost(make_trace):
    from sdc_forensics.forensics.bisect import bisect
    from sdc_forensics.replay.options import BisectOptions

    path = _crafted_range(make_trace)
    tracemalloc.start()
    started = time.monotonic()
    try:
        trace = Trace.open(path)
        assert [w.steps.tolist() for w in trace.step_windows()] == [[0, 1, 2], [F.MAX_STEP]]
        assert [w.steps.tolist() for w in trace.step_windows(window=F.MAX_STEP)] == [[0, 1, 2], [F.MAX_STEP]]
        assert summarize(trace).num_rank_steps == 8 and trace.run_end().last_complete_step == F.MAX_STEP
        result = bisect(path, BisectOptions(trace_only=True))  # was: a list of 2^53 unexamined steps
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 60  # a loop over the span would take hours; a loaded CI machine takes seconds
    assert peak < 16 << 20, peak  # numpy's buffers are traced: a table by the span would be petabytes
    assert result.verdict.value == "clean"
    (note,) = result.checkpoints
    assert f"steps 0..{F.MAX_STEP - 1} were not replayed" in " ".join(note.reasons)


def test_a_huge_step_range_through_the_cli_in_bounded_time_and_memory(make_trace):
    path = _crafted_range(make_trace)
    script = (
        "import sys; from sdc_forensics.cli.main import cli\n"
        "for args in (['inspect', sys.argv[1], '--json'], ['bisect', sys.argv[1], '--trace-only', '--json']):\n"
        "    try: cli.main(args, standalone_mode=False)\n"
        "    except SystemExit: pass\n"
        # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork and exec, so it would report
        # the peak of the pytest process that started this one
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
        "print('maxrss_kib', hwm, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    maxrss_mib = int(done.stderr.split("maxrss_kib")[-1].split()[0]) / 1024
    assert maxrss_mib < 400, maxrss_mib  # the interpreter, numpy, click and rich: about 100 MiB


def _lose_ranks(path: Path, world_size: int) -> None:
    """The trace of a ``world_size``-rank job of which only the files of ranks 0 and 1 are left: the manifest and
    the files' headers say ``world_size`` (a manifest the headers contradict is refused: ``test_hostile``)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["world_size"] = world_size
    (path / "manifest.json").write_text(json.dumps(manifest))
    for rank_file in path.glob("rank-*.sdct"):
        raw = bytearray(rank_file.read_bytes())
        header = np.frombuffer(bytes(raw[: F.HEADER_SIZE]), dtype=F.HEADER_DTYPE).copy()
        header["world_size"] = world_size
        header["checksum"] = F.checksums(header)[0]
        raw[: F.HEADER_SIZE] = header.tobytes()
        rank_file.write_bytes(bytes(raw))


def test_a_huge_world_size_is_refused_with_one_line_without_allocating_by_it(make_trace):
    path = make_trace(ranks=2, steps=4)
    _lose_ranks(path, 100_000)
    tracemalloc.start()
    started = time.monotonic()
    try:
        line = assert_refused(["inspect", path], path)
        assert_refused(["bisect", path, "--trace-only"], path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "declares world_size 100000, but only 2 rank(s) have a readable file" in line
    assert time.monotonic() - started < 60 and peak < 16 << 20, (
        peak
    )  # seconds, not the hours of a loop over 100,000 ranks


def test_a_world_size_within_the_missing_rank_bound_is_read(make_trace):
    path = make_trace(ranks=2, steps=4)
    _lose_ranks(path, 2 + 64)  # 64 ranks without a file: damage, not a refusal
    trace = Trace.open(path)
    (window,) = list(trace.step_windows())
    assert window.present.shape == (4, 66) and window.present[:, :2].all() and not window.present[:, 2:].any()
    doc = summary_document(summarize(trace))
    assert sum(d["kind"] == "missing_rank" for d in doc["damage"]) == 64
