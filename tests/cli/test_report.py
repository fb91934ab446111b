"""``sdc-forensics report``: the post-incident review, from the same result as ``bisect``."""

from __future__ import annotations

import json

from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from tests.factories import Fault


def test_report_markdown_names_step_rank_and_host(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=30, fault=Fault(kind="nonfinite", step=17, rank=3))
    out = tmp_path / "review.md"
    result = CliRunner().invoke(cli, ["report", str(trace), "--trace-only", "-o", str(out), "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["first_divergent_step"] == 17 and doc["suspects"][0]["rank"] == 3
    text = out.read_text()
    assert text.startswith("# Post-incident review: Silent data corruption found")
    assert "**First divergent step: 17.**" in text
    assert "rank 3 on host `node1`, GPU `GPU-0003`" in text
    assert "## Evidence chain" in text and "| 17 | nonfinite | 3 |" in text
    assert "## Reproduce this analysis" in text


def test_report_clean_trace_exits_0_to_stdout(make_trace):
    result = CliRunner().invoke(cli, ["report", str(make_trace(ranks=3, steps=10)), "--trace-only"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("# Post-incident review: No corruption found")


def test_report_refuses_to_overwrite_and_json_on_stdout_twice(make_trace, tmp_path):
    trace = make_trace(ranks=3, steps=5)
    existing = tmp_path / "exists.md"
    existing.write_text("keep me")
    result = CliRunner().invoke(cli, ["report", str(trace), "--trace-only", "-o", str(existing)])
    assert result.exit_code == 2 and "never overwrites" in result.stderr and existing.read_text() == "keep me"
    result = CliRunner().invoke(cli, ["report", str(trace), "--trace-only", "--json"])
    assert result.exit_code == 2 and "-o FILE" in result.stderr


def test_report_on_a_non_trace_exits_3(tmp_path):
    result = CliRunner().invoke(cli, ["report", str(tmp_path), "--trace-only"])
    assert result.exit_code == 3 and "no manifest.json" in result.stderr and "Traceback" not in result.output
