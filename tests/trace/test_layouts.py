"""``buckets.attempt-AAA.json`` (``sdc_forensics/trace/layouts.py``): one file name, written
atomically by the recorder and read as untrusted input by replay (a ``TraceError``, exit 3)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.errors import TraceError
from sdc_forensics.trace.layouts import BucketLayout, layouts_path, read_bucket_layouts, write_bucket_layouts
from tests.factories import tree_sha256


def test_round_trip_sorted_by_from_step(tmp_path):
    write_bucket_layouts(
        tmp_path, 2, [{"from_step": 5, "buckets": [[3, 2], [1, 0]]}, {"from_step": 0, "buckets": [[3, 2, 1, 0]]}]
    )
    assert layouts_path(tmp_path, 2).name == "buckets.attempt-002.json"
    assert read_bucket_layouts(tmp_path, 2) == (
        BucketLayout(from_step=0, buckets=((3, 2, 1, 0),)),
        BucketLayout(from_step=5, buckets=((3, 2), (1, 0))),
    )
    assert read_bucket_layouts(tmp_path, 3) == ()  # absent: replay uses DDP's default layout


def test_the_recorder_and_replay_name_the_same_file(tmp_path):
    from sdc_forensics.replay.env import bucket_layouts
    from sdc_forensics.recorder.records import write_layouts

    path = write_layouts(tmp_path, 1, [{"from_step": 0, "buckets": [[0]]}])
    assert path == tmp_path / "buckets.attempt-001.json"  # docs/trace-format.md
    assert bucket_layouts(tmp_path, 1) == (BucketLayout(from_step=0, buckets=((0,),)),)


HOSTILE = {
    "not-json": b'{"layouts": [',
    "not-utf8": b'{"layouts": "\xff"}',
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "huge-integer": b'{"layouts": [{"from_step": ' + b"9" * 5000 + b', "buckets": []}]}',
    "not-an-object": b"[1, 2]",
    "no-layouts": b"{}",
    "layouts-not-a-list": b'{"layouts": {"from_step": 0}}',
    "entry-not-an-object": b'{"layouts": [7]}',
    "step-a-string": b'{"layouts": [{"from_step": "0", "buckets": [[0]]}]}',
    "step-negative": b'{"layouts": [{"from_step": -1, "buckets": [[0]]}]}',
    "bucket-not-a-list": b'{"layouts": [{"from_step": 0, "buckets": [0]}]}',
    "index-a-float": b'{"layouts": [{"from_step": 0, "buckets": [[0.5]]}]}',
    "index-negative": b'{"layouts": [{"from_step": 0, "buckets": [[-1]]}]}',
    "index-a-bool": b'{"layouts": [{"from_step": 0, "buckets": [[true]]}]}',
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_layout_file_is_a_trace_error_naming_it(tmp_path, name):
    layouts_path(tmp_path, 0).write_bytes(HOSTILE[name])
    with pytest.raises(TraceError) as caught:
        read_bucket_layouts(tmp_path, 0)
    text = str(caught.value)
    assert "buckets.attempt-000.json" in text and "restore it from the run" in text and len(text) < 600


def test_a_layout_naming_a_parameter_the_model_lacks_is_refused():
    from sdc_forensics.replay.env import layout_at

    layouts = (BucketLayout(from_step=0, buckets=((1, 0),)), BucketLayout(from_step=3, buckets=((7, 0),)))
    assert layout_at(layouts, 2, num_params=2) == (((1, 0),), True)
    with pytest.raises(TraceError, match="names parameter 7, but the recipe's model has 2 parameters"):
        layout_at(layouts, 3, num_params=2)


def _replay(out):
    return CliRunner().invoke(
        cli, ["replay", str(out / "trace"), "--from", "4", "--to", "5", "--checkpoints", str(out / "checkpoints")]
    )


@pytest.mark.parametrize(
    "content",
    [HOSTILE["step-a-string"], HOSTILE["deep"], b'{"layouts": [{"from_step": 0, "buckets": [[99]]}]}'],
    ids=["wrong-type", "deep", "beyond-the-model"],
)
def test_replay_with_a_hostile_layout_file_is_one_error_line_and_exit_3(sim, tmp_path, content):
    out = tmp_path / "run"
    shutil.copytree(sim(), out)
    layouts_path(out / "trace", 0).write_bytes(content)
    before = tree_sha256(out)
    result = _replay(out)
    assert result.exit_code == 3, (result.output, result.exception)
    assert result.stdout == "" and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.strip().startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert "bucket" in errors[0] and "does not check yet" not in errors[0]
    assert tree_sha256(out) == before


def test_the_recorded_layout_file_still_reads(sim):
    out = sim()
    doc = json.loads(layouts_path(out / "trace", 0).read_text())
    assert read_bucket_layouts(out / "trace", 0)[0].buckets == tuple(tuple(b) for b in doc["layouts"][0]["buckets"])
