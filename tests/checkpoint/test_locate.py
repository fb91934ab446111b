"""Finding a noted checkpoint's file (``checkpoint/locate.py``): from the trace directory and its
ancestors, from the recorder's trace-relative path, with ``--checkpoints``, and never through a
hostile note's path into places it should not reach."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sdc_forensics.checkpoint.locate import locate_checkpoint
from sdc_forensics.errors import TraceError
from sdc_forensics.trace.checkpoints import (
    CheckpointNote,
    climbs_then_descends,
    parse_checkpoint_note,
    read_checkpoint_notes,
    write_checkpoint_note,
)


def _job(root: Path) -> Path:
    """``root/sdc-demo/{trace,checkpoints/step-00000004.pt}``; returns the trace directory."""
    trace = root / "sdc-demo" / "trace"
    (trace / "checkpoints").mkdir(parents=True)
    (root / "sdc-demo" / "checkpoints").mkdir()
    (root / "sdc-demo" / "checkpoints" / "step-00000004.pt").write_bytes(b"x")
    return trace


NOTE = CheckpointNote(
    step=4, path="sdc-demo/checkpoints/step-00000004.pt", path_from_trace="../checkpoints/step-00000004.pt"
)


def test_found_from_the_trace_directory_whatever_the_current_directory(tmp_path, monkeypatch):
    trace = _job(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path)  # not where the job ran: the path as written does not exist here
    assert not Path(NOTE.path).exists()
    found = locate_checkpoint(NOTE, None, trace)
    assert found == tmp_path / "elsewhere" / "sdc-demo" / "checkpoints" / "step-00000004.pt"
    old = CheckpointNote(step=4, path=NOTE.path)  # a note from before path_from_trace: the ancestors find it
    assert locate_checkpoint(old, None, trace) == found


def test_found_after_the_whole_folder_was_moved_and_renamed(tmp_path, monkeypatch):
    trace = _job(tmp_path / "a")
    shutil.move(tmp_path / "a" / "sdc-demo", tmp_path / "incident-42")
    monkeypatch.chdir(tmp_path)
    moved = tmp_path / "incident-42" / "trace"
    assert (
        locate_checkpoint(CheckpointNote(step=4, path=NOTE.path), None, moved) is None
    )  # the written path no longer fits
    assert locate_checkpoint(NOTE, None, moved) == tmp_path / "incident-42" / "checkpoints" / "step-00000004.pt"
    absolute = CheckpointNote(
        step=4, path="/nonexistent/job/sdc-demo/checkpoints/step-00000004.pt", path_from_trace=NOTE.path_from_trace
    )
    assert locate_checkpoint(absolute, None, moved) == tmp_path / "incident-42" / "checkpoints" / "step-00000004.pt"
    del trace


def test_in_place_keeps_the_path_as_the_job_wrote_it(tmp_path, monkeypatch):
    trace = _job(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert locate_checkpoint(NOTE, None, trace) == Path(NOTE.path)


def test_checkpoints_dir_is_by_name_and_exclusive(tmp_path, monkeypatch):
    trace = _job(tmp_path)
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "copy"
    other.mkdir()
    assert locate_checkpoint(NOTE, other, trace) is None  # not found there: no fallback to the note's paths
    (other / "step-00000004.pt").write_bytes(b"y")
    assert locate_checkpoint(NOTE, other, trace) == other / "step-00000004.pt"


def test_a_hostile_note_path_is_not_joined_anywhere(tmp_path, monkeypatch):
    trace = _job(tmp_path / "deep" / "er")
    secret = tmp_path / "secret.pt"
    secret.write_bytes(b"s")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # as written (from here) it does not exist: only a join could find it
    # ".." in the written path: never joined to the trace directory or its ancestors (from
    # sdc-demo/ it would reach the secret)
    climbing = CheckpointNote(step=4, path="../../../secret.pt")
    assert locate_checkpoint(climbing, None, trace) is None
    # a path_from_trace that climbs after descending is refused by the note reader and by locate
    sneaky = CheckpointNote(step=4, path="x.pt", path_from_trace="../checkpoints/../../../../secret.pt")
    assert locate_checkpoint(sneaky, None, trace) is None
    with pytest.raises(TraceError, match="path_from_trace"):
        parse_checkpoint_note({"step": 4, "path": "x.pt", "path_from_trace": sneaky.path_from_trace}, "note")


@pytest.mark.parametrize(
    "path, ok",
    [
        ("../checkpoints/step-00000004.pt", True),
        ("step.pt", True),
        ("../../a/b.pt", True),
        ("/etc/passwd", False),
        ("a/../../b", False),
        ("..", False),
        ("../", False),
        ("./x", False),
        ("a//b", False),
        ("C:x", False),
        ("a\0b", False),
        ("", False),
    ],
)
def test_climbs_then_descends(path, ok):
    assert climbs_then_descends(path) is ok


def test_note_round_trip_keeps_old_notes_byte_for_byte(tmp_path):
    old = CheckpointNote(step=3, path="checkpoints/step-00000003.pt")
    text = write_checkpoint_note(tmp_path, old).read_text()
    assert "path_from_trace" not in text  # an older note's bytes are unchanged
    new = CheckpointNote(step=6, path="/abs/step-00000006.pt", path_from_trace="../c/step-00000006.pt")
    write_checkpoint_note(tmp_path, new)
    assert read_checkpoint_notes(tmp_path) == [old, new]
    assert os.path.basename(new.path) == "step-00000006.pt"


def test_another_runs_folder_in_a_far_ancestor_is_not_taken(tmp_path, monkeypatch):
    """``/tmp/sdc-demo/checkpoints/`` of another run must not stand in for this trace's files."""
    _job(tmp_path)  # another run's sdc-demo/ in a far ancestor
    trace = tmp_path / "incidents" / "42" / "trace"
    trace.mkdir(parents=True)
    monkeypatch.chdir(trace)
    assert locate_checkpoint(CheckpointNote(step=4, path=NOTE.path), None, trace) is None
    assert locate_checkpoint(NOTE, None, trace) is None


def test_an_archived_trace_reads_its_own_files_where_the_jobs_absolute_paths_hold_a_later_run(tmp_path, monkeypatch):
    """A trace copied with its checkpoints to an archive is read against the archive's files,
    even though the job's absolute path still exists and now holds a later run's checkpoint."""
    original = _job(tmp_path / "job")
    written = tmp_path / "job" / "sdc-demo" / "checkpoints" / "step-00000004.pt"
    shutil.copytree(tmp_path / "job" / "sdc-demo", tmp_path / "archive" / "A")
    written.write_bytes(b"a later run's checkpoint")
    monkeypatch.chdir(tmp_path)
    note = CheckpointNote(step=4, path=str(written), path_from_trace="../checkpoints/step-00000004.pt")
    assert (
        locate_checkpoint(note, None, tmp_path / "archive" / "A" / "trace")
        == tmp_path / "archive" / "A" / "checkpoints" / "step-00000004.pt"
    )
    assert locate_checkpoint(note, None, original) == written  # in place, the same file as written


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_note_naming_a_fifo_is_not_found(tmp_path, monkeypatch):
    """A crafted note naming a FIFO (or a device) would make the read hang: only regular files and
    directories are used."""
    trace = tmp_path / "t" / "trace"
    trace.mkdir(parents=True)
    os.mkfifo(tmp_path / "t" / "pipe.pt")
    monkeypatch.chdir(tmp_path)
    assert locate_checkpoint(CheckpointNote(step=4, path=str(tmp_path / "t" / "pipe.pt")), None, trace) is None
    assert (
        locate_checkpoint(CheckpointNote(step=4, path="x/pipe.pt", path_from_trace="../pipe.pt"), None, trace) is None
    )
