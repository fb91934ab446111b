"""``sdc-forensics export TRACE_DIR [-o FILE]``: the trace's STEP records as CSV (numpy only, no torch).

A file is written whole or not at all: to a temporary file in the same folder, renamed into place
when complete (an existing file is refused, exit 2, unless ``--force``). On stdout, a reader that
stops early (``| head``) ends the export quietly with exit 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from sdc_forensics.cli.common import check_new_output, force_option
from sdc_forensics.cli.output import err, stdout_closed
from sdc_forensics.newfile import write_new_file


@click.command("export")
@click.argument("trace_dir", type=click.Path(path_type=str))
@click.option(
    "-o",
    "--output",
    default="-",
    show_default=True,
    help="CSV file to write (it must not exist, unless --force), or - for stdout.",
)
@force_option
def export_cmd(trace_dir: str, output: str, force: bool) -> None:
    """Export TRACE_DIR's STEP records (latest attempt per step) as CSV, one row per rank-step.

    Columns: docs/json.md, "export". Exit 0 written, 2 usage error (the output file exists:
    pass --force), 3 not a usable trace.
    """
    from sdc_forensics.trace.export import export_csv
    from sdc_forensics.trace.reader import Trace

    check_new_output(output, force, "-o")
    trace = Trace.open(trace_dir)
    if output == "-":
        try:
            rows = export_csv(trace, sys.stdout)
            sys.stdout.flush()
        # the reader has what it wanted (| head)
        except BrokenPipeError:
            stdout_closed()
            return
        err.print(f"exported {rows} rank-steps to stdout")
        return
    rows = write_new_file(Path(output), force, lambda handle: export_csv(trace, handle), flag="-o")
    err.print(f"exported {rows} rank-steps to {output}")
