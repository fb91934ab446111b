"""Fuzzing checkpoint notes (``trace/checkpoints.py``), ``TRACE/checkpoints/step-N.attempt-A.json``:
a valid note with fields replaced by any JSON value, removed or added; its bytes damaged; several
notes of one step from several attempts. Property: what ``inspect``, ``export`` and ``bisect
--trace-only`` compute (``readers.read_trace``: the notes drive checkpoint statuses) returns or
raises ``TraceError``; the trace is unchanged."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import edit_json, json_edits, json_values, mutate, mutations
from tests.fuzz.test_fuzz_trace import check_trace, corpus

NOTE = "checkpoints/step-00000002.attempt-000.json"
_NAMES = st.sampled_from(
    [
        NOTE,
        "checkpoints/step-00000004.attempt-000.json",
        "checkpoints/step-00000002.attempt-001.json",
        "checkpoints/step-99999999.attempt-999.json",
        "checkpoints/step-x.attempt-y.json",
    ]
)
_VALUES = json_values(6) | st.sampled_from(
    [2, 3, 4, 2**53 - 1, 2**53, "0123456789abcdef", "0123456789ABCDEF", ["w"], {"w": "fedcba9876543210"}]
)


@given(edits=json_edits(3, values=_VALUES))
def test_checkpoint_note_fields_edited(scratch, edits):
    """Any field of a note replaced by any JSON value, removed, or an extra key or item added."""
    files = dict(corpus()["records"])
    files[NOTE] = json.dumps(edit_json(json.loads(files[NOTE]), edits)).encode()
    with scratch() as folder:
        check_trace(folder, files, kind="notes")


@given(ops=mutations(max_ops=3))
def test_checkpoint_note_bytes_mutated(scratch, ops):
    """A note's bytes damaged: invalid UTF-8 or JSON, truncated, spliced."""
    files = dict(corpus()["records"])
    files[NOTE] = mutate(files[NOTE], ops)
    with scratch() as folder:
        check_trace(folder, files, kind="notes")


@given(
    notes=st.dictionaries(
        _NAMES,
        st.lists(st.tuples(st.sampled_from(["set", "drop", "add"]), st.integers(0, 1 << 16), _VALUES), max_size=2),
        min_size=1,
        max_size=4,
    )
)
def test_several_checkpoint_notes(scratch, notes):
    """Several notes (other steps, later attempts of the same step, names that do not parse), each edited."""
    files = dict(corpus()["records"])
    base = json.loads(files[NOTE])
    for name, edits in notes.items():
        files[name] = json.dumps(edit_json(base, edits)).encode()
    with scratch() as folder:
        check_trace(folder, files, kind="notes")
