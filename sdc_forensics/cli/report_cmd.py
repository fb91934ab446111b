"""``sdc-forensics report TRACE_DIR``: run ``bisect`` and write the post-incident review (HTML, Markdown or JSON)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from sdc_forensics.cli.common import EXIT_BY_VERDICT, check_new_output, force_option, run_analysis, trace_analysis_options
from sdc_forensics.cli.output import SCHEMA_VERSION, emit_json, err, write_stdout


@click.command("report")
@trace_analysis_options
@click.option("--trace-only", is_flag=True, help="Use the trace alone: no replay, no checkpoint files, no torch.")
@click.option("-o", "--output", default="-", show_default=True,
              help="File to write (.html/.htm, .md or .json sets the format), or - for stdout.")
@click.option("--format", "fmt", type=click.Choice(["html", "md", "json"]),
              help="Output format (default: from -o's suffix; Markdown on stdout).")
@force_option
@click.pass_context
def report_cmd(ctx: click.Context, trace_dir: Path, as_json: bool, trace_only: bool, output: str, fmt: str | None, force: bool,
               **options) -> None:
    """Write a post-incident review of TRACE_DIR: what happened and when, who, what was lost, what to do.

    Runs the same analysis as bisect (same options and exit codes). HTML is one self-contained file
    with plots (matplotlib: pip install 'sdc-forensics[report]'); Markdown has the same sections
    without plots; JSON is the bisect document plus the report's facts. With --json the JSON
    document goes to stdout and the review to -o FILE.
    """
    from sdc_forensics.errors import UsageError
    from sdc_forensics.present.report import ReportRequest, output_format

    fmt = output_format(output, fmt)
    if as_json and output == "-" and fmt != "json":
        raise UsageError("--json and the review cannot both go to stdout: pass -o FILE for the review")
    check_new_output(output, force, "-o")
    request = ReportRequest(
        trace_dir=trace_dir.absolute(), output=output if output == "-" else str(Path(output).absolute()), fmt=fmt,
        checkpoints_dir=None if options["checkpoints_dir"] is None else options["checkpoints_dir"].absolute(),
        recipe=options["recipe"], device=options["device"], num_threads=options["num_threads"],
        force_tolerant=options["force_tolerant"], force_device=options["force_device"], trace_only=trace_only,
    )
    result = run_analysis(trace_dir, trace_only=trace_only, **options)
    text, document = _render(result, request, with_json=as_json or fmt == "json")
    if output == "-" and fmt == "json":
        emit_json(document)
    elif output == "-":
        write_stdout(text)  # a reader that goes away (| head) is not an error
    else:
        _write_atomically(Path(output), text)
        err.print(f"post-incident review ({fmt}) written to {output}", markup=False)
    if as_json and not (fmt == "json" and output == "-"):
        emit_json(document)
    ctx.exit(EXIT_BY_VERDICT[result.verdict.value])


def _render(result, request, with_json: bool):
    """``(text of the review, JSON document or None)``."""
    import dataclasses
    import json

    from sdc_forensics.forensics.incident import build_incident
    from sdc_forensics.forensics.series import incident_series, plot_window
    from sdc_forensics.present.actions import build_actions
    from sdc_forensics.present.report import PLOTS_HINT, report_document
    from sdc_forensics.trace.reader import Trace

    trace = Trace.open(request.trace_dir)
    request = dataclasses.replace(request, manifest_recipe=trace.manifest.recipe)
    end = trace.run_end()
    incident = build_incident(result, trace)
    job_nodes = tuple(dict.fromkeys(i.slurm_node or i.k8s_node or i.host for a in trace.manifest.attempts for i in a.ranks if i.host))
    actions = build_actions(result, incident, job_nodes)
    document = report_document(result, incident, actions, request, end, time.time_ns()) if with_json or request.fmt == "json" else None
    if request.fmt == "json":
        return json.dumps({"schema_version": SCHEMA_VERSION, **document}, indent=2, sort_keys=True) + "\n", document
    if request.fmt == "md":
        from sdc_forensics.present.markdown import render_markdown

        return render_markdown(result, trace.manifest, incident, actions, request, end=end), document
    from sdc_forensics.present.html import render_html
    from sdc_forensics.present.plots import matplotlib_available, render_svg

    svg, note = None, ""
    window = plot_window(trace.step_range(), result.first_divergent_step)
    if not matplotlib_available():
        note = f"No plots: matplotlib is not installed ({PLOTS_HINT})."
        err.print(f"note: {note}", markup=False)
    elif window is not None:
        svg = render_svg(incident_series(trace, window), result)
    else:
        note = "No plots: the trace holds no step."
    return render_html(result, trace.manifest, incident, actions, request, plot_svg=svg, plot_note=note, end=end), document


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename: never a half-written review."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
