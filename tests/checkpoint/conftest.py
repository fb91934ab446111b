"""The checkpoint tests' file helpers live in ``tests/factories.py``; this name stays importable
for tests that import them from here (``test_folder.py``)."""

from __future__ import annotations

from tests.factories import flip_byte, tree_sha256, write_safetensors_raw, zip_member_offset

__all__ = ["flip_byte", "tree_sha256", "write_safetensors_raw", "zip_member_offset"]
