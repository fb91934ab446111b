"""``sdc-forensics certify TRACE_DIR``: parse, certify (``forensics.certify``), render.

Every noted checkpoint gets a status; the last clean one is the resume point. Exit 0 when a
checkpoint is certified clean to resume from, 1 when none is and something is wrong, 4 when none
is and nothing wrong was found (``forensics.certify.certify_exit``; errors: 2 usage, 3 bad input).
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import Bars, analysis_options, check_new_output, distributed_replay, force_option, ledger_options
from sdc_forensics.cli.limits import read_limit_options
from sdc_forensics.cli.output import emit_json, err


@click.command("certify")
@click.argument("trace_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Write one JSON document on stdout.")
@click.option("--certificate-out", type=click.Path(path_type=Path, dir_okay=False),
              help="Write a certificate (JSON) to this file (it must not exist, unless --force).")
@force_option
@click.option("--trace-only", is_flag=True, help="The trace's evidence alone: no replay, no files read (no checkpoint is then certified clean).")
@click.option("--max-replay-steps", type=click.IntRange(min=1), help="Replay at most this many steps (checkpoints before stay unverified).")
@analysis_options
@ledger_options
@read_limit_options
@distributed_replay
@click.pass_context
def certify_cmd(ctx: click.Context, trace_dir: Path, as_json: bool, certificate_out: Path | None, force: bool, **options) -> None:
    """Certify every checkpoint of a run and name the last clean one: where to resume.

    The same analysis as bisect: trace evidence, then a replay of every step before each
    checkpoint, so a fault the trace alone cannot see still taints the checkpoints after it. A
    checkpoint is clean only when its file is as saved, holds the replicas' majority weights and
    no NaN/Inf, and every step before it was examined and found clean.

    Exit 0 when a checkpoint is certified clean to resume from (tainted or corrupt later ones
    are still listed), 1 when none is clean and corruption was found or a checkpoint is tainted
    or corrupt, 4 when none is clean and nothing wrong was found (unverified), 2 usage error,
    3 bad input.
    """
    from sdc_forensics.errors import UsageError
    from sdc_forensics.forensics.certify import certify, write_run_certificate
    from sdc_forensics.replay.distributed import is_lead
    from sdc_forensics.replay.options import AnalysisOptions
    from sdc_forensics.present.certify import certify_document, render_certify

    if certificate_out is not None and str(certificate_out) == "-":
        raise UsageError("--certificate-out - : a certificate is written to a file; name one (the JSON document is --json)")
    check_new_output(certificate_out, force, "--certificate-out")
    with Bars(enabled=err.is_terminal) as bars:
        cert = certify(trace_dir, AnalysisOptions(**options), progress=bars)
    if certificate_out is not None and is_lead():  # under torchrun, process 0 alone writes
        write_run_certificate(certificate_out, cert, force=force)
    render_certify(cert, err, certificate_out)
    if as_json:
        emit_json(certify_document(cert, certificate_out))
    ctx.exit(cert.exit_code)
