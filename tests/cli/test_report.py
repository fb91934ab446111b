"""``sdc-forensics report``: the post-incident review, from the same result as ``bisect``, in HTML,
Markdown and JSON (synthetic traces, through click's runner; demo runs and the installed command
are in ``test_report_demo.py``)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from tests.factories import Fault
from tests.schema_check import assert_valid


def _report(*args):
    return CliRunner().invoke(cli, ["report", *map(str, args)])


def test_report_markdown_names_step_rank_and_host(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=30, fault=Fault(kind="nonfinite", step=17, rank=3))
    out = tmp_path / "review.md"
    result = _report(trace, "--trace-only", "-o", out, "--json")
    assert result.exit_code == 1, result.output
    doc = assert_valid(result.stdout, "report")
    assert doc["first_divergent_step"] == 17 and doc["suspects"][0]["rank"] == 3
    # the bisect document, unchanged, plus trace_end and report: consumers of either keep working
    assert_valid({k: v for k, v in doc.items() if k not in ("trace_end", "report")}, "bisect")
    text = out.read_text()
    assert text.startswith("# Post-incident review: Silent data corruption found")
    assert "**First divergent step: 17.**" in text
    assert "rank 3 on host `node1`, GPU `GPU-0003`" in text
    assert "## Evidence chain" in text and "| 17 | nonfinite | 3 |" in text
    assert "## Actions ready to paste" in text and "## What could not be checked" in text
    # the node of rank 3 (host node1: no Slurm/k8s name in the manifest), the incident in the reason
    assert (
        "scontrol update nodename=node1 state=drain reason='sdc-forensics: SDC at step 17, rank 3, GPU GPU-0003'"
        in text
    )
    assert (
        "kubectl cordon node1" in text
        and "kubectl taint nodes node1 sdc-forensics/suspect=step17-rank3:NoSchedule" in text
    )
    assert 'dcgmi diag -r 3 -i "$(nvidia-smi -i GPU-0003 --query-gpu=index --format=csv,noheader)"' in text
    assert "sbatch --exclude=node1 " in text
    # no checkpoint in a synthetic trace: what is lost counts from the first step, 0..29
    assert "30 step(s) (0..29)" in text and "no checkpoint certified clean" in text
    # the reproduce commands: absolute, --force, the options given
    assert f"sdc-forensics report {trace.absolute()} --trace-only --format md -o {out.absolute()} --force" in text


@pytest.mark.parametrize(
    "suffix, fmt, start",
    [
        (".html", "html", "<!DOCTYPE html>"),
        (".htm", "html", "<!DOCTYPE html>"),
        (".md", "md", "# Post-incident review"),
        (".json", "json", "{"),
    ],
)
def test_the_format_follows_the_suffix(make_trace, tmp_path, suffix, fmt, start):
    out = tmp_path / f"review{suffix}"
    result = _report(
        make_trace(ranks=4, steps=12, fault=Fault(kind="nonfinite", step=5, rank=1)), "--trace-only", "-o", out
    )
    assert result.exit_code == 1, result.output
    assert out.read_text().startswith(start)
    assert f"post-incident review ({fmt}) written to {out}" in result.stderr
    if fmt == "json":
        assert assert_valid(out.read_text(), "report")["report"]["first_divergent_step"] == 5


def test_format_overrides_the_suffix_and_stdout_defaults_to_markdown(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=12)
    out = tmp_path / "review.txt"
    assert (
        _report(trace, "--trace-only", "-o", out, "--format", "html").exit_code == 4
    )  # clean for the trace alone: not 0
    assert out.read_text().startswith("<!DOCTYPE html>")
    result = _report(trace, "--trace-only")
    assert result.exit_code == 4 and result.stdout.startswith("# Post-incident review: No corruption found")
    result = _report(trace, "--trace-only", "--format", "json")
    doc = assert_valid(result.stdout, "report")
    assert doc["verdict"] == "clean" and doc["exit_code"] == result.exit_code == 4
    assert doc["report"]["nodes"] == [] and doc["report"]["lost"] is None
    assert [a["platform"] for a in doc["report"]["actions"]] == ["none"]


def test_json_flag_with_format_json_on_stdout_prints_one_document(make_trace):
    result = _report(make_trace(ranks=4, steps=8), "--trace-only", "--format", "json", "--json")
    assert result.exit_code == 4
    assert_valid(json.loads(result.stdout), "report")  # one document, not two concatenated


def test_existing_output_refused_before_any_work_unless_force(make_trace, tmp_path):
    trace = make_trace(ranks=3, steps=5)
    existing = tmp_path / "exists.md"
    existing.write_text("keep me")
    result = _report(trace, "--trace-only", "-o", existing)
    assert result.exit_code == 2 and "exists" in result.stderr and "--force" in result.stderr
    assert existing.read_text() == "keep me" and result.stdout == ""
    result = _report(trace, "--trace-only", "-o", existing, "--force")
    assert result.exit_code == 4 and existing.read_text().startswith("# Post-incident review")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # written through a renamed temporary
    result = _report(trace, "--trace-only", "--json")
    assert result.exit_code == 2 and "-o FILE" in result.stderr


def test_collective_fault_has_no_node_to_drain(make_trace, tmp_path):
    out = tmp_path / "review.json"
    trace = make_trace(ranks=4, steps=12, fault=Fault(kind="allreduce-all", step=6))
    assert _report(trace, "--trace-only", "-o", out).exit_code == 1
    doc = assert_valid(out.read_text(), "report")
    assert doc["suspects"][0]["rank"] is None and doc["report"]["collective"] is True and doc["report"]["nodes"] == []
    platforms = [a["platform"] for a in doc["report"]["actions"]]
    assert "slurm" not in platforms and "kubernetes" not in platforms and "fabric" in platforms
    fabric = next(a for a in doc["report"]["actions"] if a["platform"] == "fabric")
    assert "no single node" in fabric["title"] and fabric["commands"] == [
        "srun --nodelist=node0,node1 --ntasks-per-node=1 dcgmi diag -r 2"
    ]


def test_weights_fault_names_the_diverged_replica(make_trace, tmp_path):
    out = tmp_path / "review.md"
    trace = make_trace(ranks=4, steps=12, fault=Fault(kind="weights", step=7, rank=2))
    result = _report(trace, "--trace-only", "-o", out, "--json")
    doc = assert_valid(result.stdout, "report")
    assert doc["report"]["nodes"][0]["rank"] == 2 and doc["report"]["nodes"][0]["node"] == "node1"
    assert "scontrol update nodename=node1 state=drain" in out.read_text()


def test_report_on_a_non_trace_exits_3(tmp_path):
    result = _report(tmp_path, "--trace-only")
    assert result.exit_code == 3 and "no manifest.json" in result.stderr and "Traceback" not in result.output


def test_inconclusive_report_calls_for_no_node_action_and_no_rollback(make_trace, tmp_path):
    out = tmp_path / "review.md"
    result = _report(
        make_trace(ranks=4, steps=20, fault=Fault(kind="outlier", step=7, rank=1)), "--trace-only", "-o", out, "--json"
    )
    assert result.exit_code == 4, result.output
    doc = assert_valid(result.stdout, "report")
    assert doc["report"]["lost"] is None and doc["report"]["nodes"] == []
    assert [a["platform"] for a in doc["report"]["actions"]] == ["resume", "none"]
    text = out.read_text()
    assert "### No node action yet" in text and "To settle: outlier hints at step(s) 7" in text
    assert "**Lost:** Not known until the evidence is settled" in text and "scontrol" not in text


def test_a_run_that_stopped_early_is_said_first(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=20, fault=Fault(kind="nonfinite", step=7, rank=1))
    rank_file = trace / "rank-00002.attempt-000.sdct"
    rank_file.write_bytes(rank_file.read_bytes()[: -(6 * 216 + 100)])  # killed mid-write after step 12
    out = tmp_path / "review.html"
    assert _report(trace, "--trace-only", "-o", out).exit_code == 1
    page = out.read_text()
    assert page.index("The run stopped early</strong> at step 13") < page.index('id="summary"')
    assert "last complete step 12" in page


def test_recurring_fault_calls_for_the_extended_diagnostic_and_a_replacement(make_trace, tmp_path):
    out = tmp_path / "review.json"
    trace = make_trace(
        ranks=4, steps=20, fault=(Fault(kind="nonfinite", step=4, rank=1), Fault(kind="nonfinite", step=12, rank=1))
    )
    assert _report(trace, "--trace-only", "-o", out).exit_code == 1
    doc = assert_valid(out.read_text(), "report")
    [node] = doc["report"]["nodes"]
    assert node["recurring"] is True and node["steps"] == [4, 12] and node["dcgm_level"] == 4
    titles = {a["platform"]: a for a in doc["report"]["actions"]}
    assert titles["hyperpod"]["title"] == "SageMaker HyperPod: replace node0"  # now, not "if the diagnostic fails"
    assert titles["dcgm"]["commands"][1].startswith("dcgmi diag -r 4 -i ")
    assert "recurring SDC at step 4, rank 1" in titles["slurm"]["commands"][0]


def test_report_reads_checkpoints_under_the_same_read_limits_as_bisect(make_run, tmp_path):
    """``report`` takes ``--max-inflate-bytes``, ``--max-tensors``, ``--allow-root`` and
    ``--allow-numpy`` (``cli/limits.py``) and its analysis reads every checkpoint under them: a file
    listing more tensors than allowed is refused, named with the option that raises the limit, as
    ``bisect`` refuses it."""
    run = make_run(steps=2)
    common = [run.trace_dir, "--checkpoints", run.checkpoints_dir, "--json"]
    within = _report(*common, "-o", tmp_path / "within.md", "--max-inflate-bytes", "1GiB", "--allow-numpy")
    assert within.exit_code == 4, within.output  # no recipe to replay with: inconclusive, files read
    assert json.loads(within.stdout)["checkpoints"][0]["status"] == "clean"
    beyond = _report(*common, "-o", tmp_path / "beyond.md", "--max-tensors", "1", "--allow-root", tmp_path)
    bisected = CliRunner().invoke(
        cli, ["bisect", *map(str, common), "--max-tensors", "1", "--allow-root", str(tmp_path)]
    )
    assert beyond.exit_code == bisected.exit_code == 1, (beyond.output, bisected.output)
    doc = json.loads(beyond.stdout)
    for entry in doc["checkpoints"]:
        assert entry["status"] == "corrupt" and "raise --max-tensors" in " ".join(entry["reasons"]), entry
    assert doc["checkpoints"] == json.loads(bisected.stdout)["checkpoints"]


def test_report_read_limit_options_are_validated_like_bisects(make_trace):
    result = _report(make_trace(ranks=2, steps=4), "--trace-only", "--max-inflate-bytes", "lots")
    assert result.exit_code == 2 and "is not a size" in result.stderr


def test_a_cpu_job_gets_host_diagnostics_not_dcgm_and_counts_rank_hours(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=30, fault=Fault(kind="nonfinite", step=17, rank=3))
    manifest_path = trace / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for attempt in manifest["attempts"]:
        for ident in attempt["ranks"]:
            ident["gpu_uuid"], ident["pci_bus_id"], ident["device"] = "", "", "cpu"
    manifest_path.write_text(json.dumps(manifest))
    out = tmp_path / "review.md"
    result = _report(trace, "--trace-only", "-o", out, "--json")
    assert result.exit_code == 1, result.output
    text = out.read_text()
    assert "dcgmi" not in text and "nvidia-smi" not in text and "GPU-hours" not in text
    assert "Check the CPU and memory of node1" in text and "stress-ng" in text and "rank-hours" in text
    assert "only after the host diagnostic passes" in text
    platforms = [a["platform"] for a in json.loads(result.stdout)["report"]["actions"]]
    assert "host" in platforms and "dcgm" not in platforms
    assert_valid(result.stdout, "report")
