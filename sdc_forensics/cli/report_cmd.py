"""``sdc-forensics report TRACE_DIR``: run ``bisect`` and write the post-incident review (HTML, Markdown or JSON)."""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import (
    check_new_output,
    distributed_replay,
    force_option,
    ledger_options,
    run_analysis,
    stdout_is_data,
    trace_analysis_options,
)
from sdc_forensics.cli.limits import read_limit_options
from sdc_forensics.cli.output import SCHEMA_VERSION, emit_json, err, write_stdout
from sdc_forensics.exitcodes import analysis_exit
from sdc_forensics.newfile import write_new_file


@click.command("report")
@trace_analysis_options
@ledger_options
@click.option("--trace-only", is_flag=True, help="Use the trace alone: no replay, no checkpoint files, no torch.")
@click.option(
    "-o",
    "--output",
    default="-",
    show_default=True,
    help="File to write (.html/.htm, .md or .json sets the format), or - for stdout.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["html", "md", "json"]),
    help="Output format (default: from -o's suffix; Markdown on stdout).",
)
@force_option
@read_limit_options
@stdout_is_data
@distributed_replay
@click.pass_context
def report_cmd(
    ctx: click.Context,
    trace_dir: Path,
    as_json: bool,
    trace_only: bool,
    output: str,
    fmt: str | None,
    force: bool,
    **options,
) -> None:
    """Write a post-incident review of TRACE_DIR: what happened and when, who, what was lost, what to do.

    Runs the same analysis as bisect (same options and exit codes). HTML is one self-contained file
    with plots (matplotlib: pip install 'sdc-forensics[report]'); Markdown has the same sections
    without plots; JSON is the bisect document plus the report's facts. With --json the JSON
    document goes to stdout and the review to -o FILE.
    """
    import dataclasses

    from sdc_forensics.errors import UsageError
    from sdc_forensics.replay.distributed import is_lead
    from sdc_forensics.replay.options import AnalysisOptions
    from sdc_forensics.forensics.review import ReportRequest, review
    from sdc_forensics.present.report import output_format
    from sdc_forensics.present.review import render_review
    from sdc_forensics.trace.reader import Trace

    fmt = output_format(output, fmt)
    if as_json and output == "-" and fmt != "json":
        raise UsageError("--json and the review cannot both go to stdout: pass -o FILE for the review")
    check_new_output(output, force, "-o")
    chosen = AnalysisOptions(trace_only=trace_only, **options)
    absolute = (
        None if chosen.checkpoints_dir is None else chosen.checkpoints_dir.absolute()
        # commands that rerun it from anywhere
    )
    request = ReportRequest(
        trace_dir=trace_dir.absolute(),
        output=output if output == "-" else str(Path(output).absolute()),
        fmt=fmt,
        options=dataclasses.replace(chosen, checkpoints_dir=absolute),
    )
    # once: the analysis and the review read the same open trace
    trace = Trace.open(trace_dir)
    result = run_analysis(trace, chosen)
    rendered = render_review(review(result, request, trace), SCHEMA_VERSION)
    for note in rendered.notes:
        err.print(f"note: {note}", markup=False)
    if output == "-" and fmt == "json":
        emit_json(rendered.document)
    elif output == "-":
        # a reader that goes away (| head) is not an error
        write_stdout(rendered.text)
    # under torchrun, process 0 alone writes
    elif is_lead():
        write_new_file(
            Path(output),
            force,
            lambda handle: handle.write(rendered.text),
            flag="-o",
            # whole or nothing, never over a file that appeared meanwhile
        )
        err.print(f"post-incident review ({fmt}) written to {output}", markup=False)
    if as_json and not (fmt == "json" and output == "-"):
        emit_json(rendered.document)
    ctx.exit(analysis_exit(result.verdict, result.mode))
