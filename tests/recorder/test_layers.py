"""Dependencies point down inside the recorder: checkpointing.py is handed what it needs.

``recorder.py`` imports ``checkpointing.py``; the reverse would be a cycle, and a helper that
reaches into private members of the class that calls it breaks when that class changes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sdc_forensics.recorder.checkpointing as checkpointing

SOURCE = Path(checkpointing.__file__).read_text()


def test_checkpointing_does_not_import_the_recorder():
    tree = ast.parse(SOURCE)
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "sdc_forensics.recorder.recorder" not in imported


def test_checkpointing_calls_no_private_member():
    private = [
        f"{node.attr} (line {node.lineno})"
        for node in ast.walk(ast.parse(SOURCE))
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
    ]
    assert private == []
