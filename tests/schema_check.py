"""Check a command's ``--json`` document against its published schema, ``docs/schemas/NAME.schema.json``."""

from __future__ import annotations

import json
from pathlib import Path

from jsonschema import Draft202012Validator

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"


def schema(name: str) -> dict:
    """The published schema of document ``name`` (checked to be a valid Draft 2020-12 schema)."""
    doc = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(doc)
    return doc


def assert_valid(document: dict | str, name: str) -> dict:
    """Validate ``document`` (a dict, or the JSON text a command printed) against schema ``name``;
    every error is listed on failure. Returns the document."""
    doc = json.loads(document) if isinstance(document, str) else document
    errors = sorted(Draft202012Validator(schema(name)).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, f"{name} document does not match docs/schemas/{name}.schema.json:\n" + "\n".join(
        f"  at /{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:20]
    )
    return doc
