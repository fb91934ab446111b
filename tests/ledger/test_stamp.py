"""Cheap file stamps, checked against hashlib on the bytes the docs say they cover."""

from __future__ import annotations

import hashlib
import os

from sdc_forensics.ledger import stamp_checkpoint
from sdc_forensics.ledger.stamp import SAMPLE_BYTES


def test_a_large_file_is_stamped_by_its_size_time_and_first_and_last_mebibyte(tmp_path):
    path = tmp_path / "big.pt"
    data = os.urandom(3 * SAMPLE_BYTES + 7)
    path.write_bytes(data)
    (stamp,) = stamp_checkpoint(path)
    assert stamp.name == "big.pt" and stamp.size_bytes == len(data) and stamp.mtime_ns == path.stat().st_mtime_ns
    assert stamp.sample_sha256 == hashlib.sha256(data[:SAMPLE_BYTES] + data[-SAMPLE_BYTES:]).hexdigest()


def test_a_checkpoint_folder_is_stamped_file_by_file_without_following_links(tmp_path):
    folder = tmp_path / "step-00000010"
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / "0.distcp").write_bytes(b"zero")
    (folder / ".metadata").write_bytes(b"meta")
    (folder / "elsewhere").symlink_to(tmp_path)
    (folder / "link.distcp").symlink_to(folder / ".metadata")
    stamps = stamp_checkpoint(folder)
    assert [(s.name, s.size_bytes) for s in stamps] == [(".metadata", 4), ("shards/0.distcp", 4)]
    assert stamps[1].sample_sha256 == hashlib.sha256(b"zero").hexdigest()
