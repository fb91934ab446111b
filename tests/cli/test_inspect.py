"""``sdc-forensics inspect`` and ``export``: output, exit codes, no traceback, no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.trace import format as F

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden-v1"


def _run(*args):
    return CliRunner().invoke(cli, list(args))


def test_inspect_golden_json():
    result = _run("inspect", str(GOLDEN), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema_version"] == 1
    assert doc["world_size"] == 2 and doc["steps"] == {"first": 0, "last": 2, "rank_steps": 6}
    assert [r["host"] for r in doc["ranks"]] == ["golden-host", "golden-host"]
    assert doc["checkpoints"][0]["step"] == 3 and doc["damage"] == []
    assert doc["fingerprint"]["sketch_k"] == 8


def test_inspect_human_output_goes_to_stderr():
    result = _run("inspect", str(GOLDEN))
    assert result.exit_code == 0
    assert result.stdout == ""
    assert "world size 2" in result.stderr and "no damage found" in result.stderr


def test_inspect_lists_damage_and_still_exits_0(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "t")
    path = tmp_path / "t" / "rank-00001.attempt-000.sdct"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])
    result = _run("inspect", str(tmp_path / "t"), "--json")
    assert result.exit_code == 0
    damage = json.loads(result.stdout)["damage"]
    assert [(d["kind"], d["rank"]) for d in damage] == [("torn_tail", 1), ("missing_steps", 1)] or ("torn_tail", 1) in [
        (d["kind"], d["rank"]) for d in damage
    ]


def test_inspect_missing_steps_on_a_rank(make_trace, tmp_path):
    path = make_trace(ranks=3, steps=10, bulk=True)
    victim = path / "rank-00002.attempt-000.sdct"
    size = F.record_size(8)
    data = victim.read_bytes()
    victim.write_bytes(data[: F.HEADER_SIZE + 6 * size])  # rank 2 stops after step 5
    result = _run("inspect", str(path), "--json")
    assert result.exit_code == 0
    damage = json.loads(result.stdout)["damage"]
    # the steps after a rank's file ends are where it stopped (stopped_early), not holes (missing_steps)
    (stopped,) = [d for d in damage if d["kind"] == "stopped_early"]
    assert stopped["rank"] == 2 and "6-9" in stopped["detail"]
    assert not [d for d in damage if d["kind"] == "missing_steps"]


def test_inspect_not_a_trace_exits_3_with_one_line(tmp_path):
    for target, expected in ((tmp_path, "no manifest.json"), (tmp_path / "nope", "does not exist")):
        result = _run("inspect", str(target))
        assert result.exit_code == 3, result.output
        assert expected in result.stderr
        assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_inspect_unknown_version_exits_3(tmp_path):
    shutil.copytree(GOLDEN, tmp_path / "t")
    manifest = tmp_path / "t" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["format_version"] = 2
    manifest.write_text(json.dumps(doc))
    result = _run("inspect", str(tmp_path / "t"))
    assert result.exit_code == 3 and "version 2" in result.stderr


def test_usage_errors_exit_2():
    assert _run("inspect").exit_code == 2
    assert _run("inspect", str(GOLDEN), "--no-such-flag").exit_code == 2
    assert _run("no-such-command").exit_code == 2


def test_export_csv_to_stdout():
    result = _run("export", str(GOLDEN))
    assert result.exit_code == 0
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("step,rank,attempt") and len(lines) == 1 + 6


def test_inspect_does_not_import_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from sdc_forensics.cli.main import cli\n"
        f"r = CliRunner().invoke(cli, ['inspect', {str(GOLDEN)!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
