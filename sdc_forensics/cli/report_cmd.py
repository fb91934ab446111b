"""``sdc-forensics report TRACE_DIR``: run ``bisect`` and write the post-incident review (Markdown)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sdc_forensics.cli.common import EXIT_BY_VERDICT, run_analysis, trace_analysis_options
from sdc_forensics.cli.output import err


@click.command("report")
@trace_analysis_options
@click.option("--trace-only", is_flag=True, help="Use the trace alone: no replay, no checkpoint files, no torch.")
@click.option("-o", "--output", default="-", show_default=True, help="Markdown file to write (must not exist), or - for stdout.")
@click.pass_context
def report_cmd(ctx: click.Context, trace_dir: Path, as_json: bool, trace_only: bool, output: str, **options) -> None:
    """Write a post-incident review of TRACE_DIR: verdict, suspects, evidence, checkpoints, resume point.

    Runs the same analysis as ``bisect`` (same options and exit codes) and renders it as Markdown;
    a run that stopped early (a rank killed) is said first, with where. With --json, the bisect
    JSON document, plus "trace_end" (inspect's "end"), goes to stdout and the review to -o FILE.
    """
    from sdc_forensics.errors import UsageError
    from sdc_forensics.present.bisect import bisect_document
    from sdc_forensics.present.markdown import render_markdown
    from sdc_forensics.trace.reader import Trace

    if as_json and output == "-":
        raise UsageError("--json and the review cannot both go to stdout: pass -o FILE for the review")
    if output != "-" and Path(output).exists():
        raise UsageError(f"{output} exists; the report never overwrites a file: choose another -o path")
    result = run_analysis(trace_dir, trace_only=trace_only, **options)
    trace = Trace.open(trace_dir)
    end = trace.run_end()
    text = render_markdown(result, trace.manifest, command=["sdc-forensics", *sys.argv[1:]] if sys.argv else None, end=end)
    if output == "-":
        sys.stdout.write(text)
    else:
        Path(output).write_text(text, encoding="utf-8")
        err.print(f"post-incident review written to {output}")
    if as_json:
        from sdc_forensics.cli.output import emit_json

        emit_json({**bisect_document(result), "trace_end": end.to_json()})
    ctx.exit(EXIT_BY_VERDICT[result.verdict.value])
