"""``sdc-forensics certify TRACE_DIR``: parse, certify (``forensics.certify``), render.

Every noted checkpoint gets a status; the last clean one is the resume point. Exit 0 when the
analysis reached a verdict and a checkpoint is certified clean to resume from, 1 when none is and
something is wrong, 4 when the analysis is inconclusive or none is clean and nothing wrong was
found (``forensics.certify.certify_exit``; errors: 2 usage, 3 bad input).
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import (
    Bars,
    analysis_options,
    check_new_output,
    distributed_replay,
    force_option,
    ledger_options,
    stdout_is_data,
)
from sdc_forensics.cli.limits import read_limit_options
from sdc_forensics.cli.output import emit_json, err


@click.command("certify")
@click.argument("trace_dir", type=click.Path(path_type=Path, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Write one JSON document on stdout.")
@click.option(
    "--certificate-out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write a certificate (JSON) to this file (it must not exist, unless --force).",
)
@force_option
@click.option(
    "--trace-only",
    is_flag=True,
    help="The trace's evidence alone: no replay, no files read (no checkpoint is then certified clean).",
)
@click.option(
    "--max-replay-steps",
    type=click.IntRange(min=1),
    help="Replay at most this many steps (checkpoints before stay unverified).",
)
@click.option(
    "--follow",
    is_flag=True,
    help="Run beside training: replay each checkpoint interval once its closing checkpoint is "
    "noted, record it in the ledger, stop with the incident on strong evidence (docs/checkpoints.md, 'Following a run').",
)
@click.option(
    "--poll",
    "poll_s",
    type=click.FloatRange(min=0.01),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="With --follow: seconds between looks at the trace.",
)
@click.option(
    "--until-step",
    type=click.IntRange(min=0),
    metavar="N",
    help="With --follow: stop once every interval before checkpoint N is examined.",
)
@click.option(
    "--idle-timeout",
    "idle_s",
    type=click.FloatRange(min=0.01),
    metavar="SECONDS",
    help="With --follow: stop after this long with no new step or checkpoint and nothing left to replay.",
)
@click.option(
    "--keep-going", is_flag=True, help="With --follow: after an incident, go on following (exit 1 at the end)."
)
@click.option(
    "--budget",
    default="all",
    show_default=True,
    metavar="all|newest|sample:F",
    help="With --follow, when it cannot keep up: replay every interval oldest first (all) or newest first (newest, "
    "a fresh fault alarms soonest), or only a fraction F of them (sample:F; the rest stay with the online checks, "
    "and coverage says so).",
)
@analysis_options
@ledger_options
@read_limit_options
@stdout_is_data
@distributed_replay
@click.pass_context
def certify_cmd(
    ctx: click.Context,
    trace_dir: Path,
    as_json: bool,
    certificate_out: Path | None,
    force: bool,
    follow: bool,
    poll_s: float,
    until_step: int | None,
    idle_s: float | None,
    keep_going: bool,
    budget: str,
    **options,
) -> None:
    """Certify every checkpoint of a run and name the last clean one: where to resume.

    The same analysis as bisect: trace evidence, then a replay of every step before each
    checkpoint, so a fault the trace alone cannot see still taints the checkpoints after it. A
    checkpoint is clean only when its file is as saved, holds the replicas' majority weights and
    no NaN/Inf, and every step before it was examined and found clean.

    Exit 0 when the analysis reached a verdict and a checkpoint is certified clean to resume from
    (tainted or corrupt later ones are still listed), 1 when none is clean and corruption was
    found or a checkpoint is tainted or corrupt, 4 when the analysis is inconclusive (even with
    checkpoint 0 clean: no resume point is named) or none is clean and nothing wrong was found
    (unverified), 2 usage error, 3 bad input.

    With --follow, beside a training run: each checkpoint interval is replayed as soon as its
    closing checkpoint is noted and recorded in the ledger; exit 1 with the incident on strong
    evidence, else at --until-step, --idle-timeout or SIGTERM/SIGINT: 0 when every closed
    interval was examined and clean, 4 when some were left (lag, or a checkpoint file rotated away).
    """
    from sdc_forensics.errors import UsageError
    from sdc_forensics.forensics.certify import certify, write_run_certificate
    from sdc_forensics.forensics.follow import FollowOptions
    from sdc_forensics.replay.distributed import is_lead
    from sdc_forensics.replay.options import AnalysisOptions
    from sdc_forensics.present.certify import certify_document, render_certify

    if certificate_out is not None and str(certificate_out) == "-":
        raise UsageError(
            "--certificate-out - : a certificate is written to a file; name one (the JSON document is --json)"
        )
    check_new_output(certificate_out, force, "--certificate-out")
    if not follow and (until_step is not None or idle_s is not None or keep_going or budget != "all"):
        raise UsageError("--until-step, --idle-timeout, --keep-going and --budget go with --follow")
    if follow:
        return _follow(
            ctx,
            trace_dir,
            as_json,
            certificate_out,
            force,
            AnalysisOptions(**options),
            FollowOptions(poll_s=poll_s, until_step=until_step, idle_s=idle_s, keep_going=keep_going, budget=budget),
        )
    with Bars(enabled=err.is_terminal) as bars:
        cert = certify(trace_dir, AnalysisOptions(**options), progress=bars)
    # under torchrun, process 0 alone writes
    if certificate_out is not None and is_lead():
        write_run_certificate(certificate_out, cert, force=force)
    render_certify(cert, err, certificate_out)
    if as_json:
        emit_json(certify_document(cert, certificate_out))
    ctx.exit(cert.exit_code)


def _follow(
    ctx: click.Context,
    trace_dir: Path,
    as_json: bool,
    certificate_out: Path | None,
    force: bool,
    options,
    follow_options,
) -> None:
    """``certify --follow``: the loop of ``forensics.follow``, its lines on stderr, its document on stdout."""
    from sdc_forensics.forensics.certify import write_run_certificate
    from sdc_forensics.forensics.follow import follow
    from sdc_forensics.present.certify import follow_document, render_follow
    from sdc_forensics.replay.distributed import is_lead

    def say(line: str) -> None:
        err.print(f"follow: {line}", markup=False, highlight=False)

    with Bars(enabled=err.is_terminal) as bars:
        outcome = follow(trace_dir, options, follow_options, say=say, progress=bars)
    final = outcome.incidents[-1] if outcome.incidents else outcome.final
    if certificate_out is not None and final is not None and is_lead():
        write_run_certificate(certificate_out, final, force=force)
    render_follow(outcome, err)
    if as_json:
        emit_json(follow_document(outcome))
    ctx.exit(outcome.exit_code)
