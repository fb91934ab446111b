"""``sdc_forensics/newfile.py``: the one atomic write (temporary file beside the target, fsync,
``os.replace``), and every file the package replaces in place goes through it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from sdc_forensics import newfile
from sdc_forensics.newfile import write_atomic, write_new_file

PACKAGE = Path(newfile.__file__).parent


@pytest.fixture
def calls(monkeypatch):
    """The fsync and replace calls of ``newfile``, in order: ``[("fsync", path), ("replace", src, dst)]``."""
    seen = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        seen.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        seen.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(newfile.os, "fsync", fsync)
    monkeypatch.setattr(newfile.os, "replace", replace)
    return seen


def test_write_atomic_fsyncs_a_file_beside_the_target_then_replaces_it(tmp_path, calls):
    target = tmp_path / "doc.json"
    target.write_text("old")
    assert write_atomic(target, "new ✓\n") == target
    assert target.read_text(encoding="utf-8") == "new ✓\n"
    (fsync, replace) = calls
    assert fsync[0] == "fsync" and Path(fsync[1]).parent == tmp_path and fsync[1] == replace[1]
    assert replace[0] == "replace" and replace[2] == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]  # no temporary file left


def test_write_atomic_leaves_the_target_untouched_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "doc.json"
    target.write_text("old")

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(newfile.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_write_new_file_is_fsynced_too_and_never_replaces_without_force(tmp_path, calls):
    target = tmp_path / "out.md"
    assert write_new_file(target, False, lambda handle: handle.write("text")) == 4
    assert calls[0][0] == "fsync" and target.read_text() == "text"
    from sdc_forensics.errors import UsageError

    with pytest.raises(UsageError, match="exists"):
        write_new_file(target, False, lambda handle: handle.write("other"))
    assert target.read_text() == "text" and sorted(p.name for p in tmp_path.iterdir()) == ["out.md"]


def test_trace_files_are_written_through_the_one_helper(tmp_path, calls):
    """The manifest, checkpoint notes and bucket layouts: each fsync'ed, then replaced."""
    from sdc_forensics.trace.checkpoints import CheckpointNote, write_checkpoint_note
    from sdc_forensics.trace.layouts import write_bucket_layouts
    from sdc_forensics.trace.manifest import FingerprintSettings, Manifest, write_manifest

    written = [
        write_manifest(
            tmp_path, Manifest(format_version=1, world_size=2, fingerprint=FingerprintSettings(seed=1, sketch_k=8))
        ),
        write_checkpoint_note(tmp_path, CheckpointNote(step=2, path="x.pt", weights_digest="0123456789abcdef")),
        write_bucket_layouts(tmp_path, 0, [{"from_step": 0, "buckets": [[1, 0]]}]),
    ]
    assert [c[2] for c in calls if c[0] == "replace"] == [str(p) for p in written]
    assert [c[0] for c in calls] == ["fsync", "replace"] * 3


def test_no_other_module_replaces_a_file_itself():
    """One atomic write: ``os.replace``/``os.rename`` and ``fsync`` of a whole file appear in
    ``newfile.py`` only (the trace writer's per-record ``fsync`` option appends, it replaces nothing)."""
    pattern = re.compile(r"\bos\.(replace|rename)\(")
    users = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text(encoding="utf-8"))
    )
    assert users == ["newfile.py"]
