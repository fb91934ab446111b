"""``sdc-forensics verify-checkpoint PATH``: parse, verify (``forensics.verify_run``), render.

Without --trace: the file's structure and content; with --trace: certified as part of its run
(the status is ``decide.decision``'s); with --certificate: confirmed against it. Exit codes
are ``forensics.verify_run``'s: 0 verified / certified clean, 1 not certifiable, 4 unverified
(errors: 2 usage, 3 unreadable).
"""

from __future__ import annotations

from pathlib import Path

import click

from sdc_forensics.cli.common import Bars, analysis_options, distributed_replay, ledger_options, stdout_is_data
from sdc_forensics.cli.limits import read_limit_options
from sdc_forensics.cli.output import emit_json, err


@click.command("verify-checkpoint")
@click.argument("path", type=click.Path(path_type=Path, readable=False))
@click.option(
    "--trace",
    "trace_dir",
    type=click.Path(path_type=Path),
    help="Trace directory: certify it as part of that run (runs the analysis of certify).",
)
@click.option(
    "--step",
    type=click.IntRange(min=0),
    help="Checkpoint step N (default: from the note whose path matches, or the payload's 'step').",
)
@click.option(
    "--trace-only",
    is_flag=True,
    help="With --trace: the trace's evidence alone, no replay (a clean answer is then 'unverified').",
)
@click.option(
    "--certificate",
    "certificate_path",
    type=click.Path(path_type=Path),
    help="Certificate to confirm the file against.",
)
@click.option("--json", "as_json", is_flag=True, help="Write one JSON document on stdout.")
@analysis_options
@ledger_options
@read_limit_options
@stdout_is_data
@distributed_replay
@click.pass_context
def verify_cmd(
    ctx: click.Context,
    path: Path,
    trace_dir: Path | None,
    step: int | None,
    trace_only: bool,
    certificate_path: Path | None,
    as_json: bool,
    **options,
) -> None:
    """Verify a checkpoint's structure and content; with --trace, certify it as part of its run.

    Without --trace: exit 0 when the file is readable, complete and free of NaN/Inf, 1 when it
    is damaged or holds NaN/Inf, 4 when nothing is wrong but some file of it could not be
    verified (a pickle not loadable safely, an unknown format); this says nothing about the run. With --trace: the checkpoint's status from the
    run's analysis: 0 certified clean, 1 corrupt or tainted, 4 unverified (nothing wrong found,
    but not every step before it examined). With --certificate: 1 when its files changed since
    they were certified, or it was not certified clean. 2 usage error, 3 unreadable input.
    """
    from sdc_forensics.replay.options import AnalysisOptions
    from sdc_forensics.forensics.verify_run import VerifyRequest, verify_run
    from sdc_forensics.present.verify import render_verify, verify_document

    if trace_dir is None:
        _refuse_replay_options(ctx)
    request = VerifyRequest(
        path=path, trace_dir=trace_dir, step=step, trace_only=trace_only, certificate_path=certificate_path
    )
    with Bars(enabled=err.is_terminal) as bars:
        outcome = verify_run(request, AnalysisOptions(**options), progress=bars)
    render_verify(outcome, err)
    if as_json:
        emit_json(verify_document(outcome))
    ctx.exit(outcome.exit_code)


def _refuse_replay_options(ctx: click.Context) -> None:
    """Refuse replay and ledger options given without --trace: the file alone is never replayed.

    Raises:
        UsageError: one line naming the options (exit 2), rather than ignoring them in silence.
    """
    from click.core import ParameterSource

    from sdc_forensics.errors import UsageError

    replay_only = [
        param.opts[0]
        for param in ctx.command.params
        if param.name in _REPLAY_PARAMS and ctx.get_parameter_source(param.name) == ParameterSource.COMMANDLINE
    ]
    if replay_only:
        raise UsageError(
            f"{', '.join(replay_only)} {'sets' if len(replay_only) == 1 else 'set'} how a run is replayed and "
            f"{'needs' if len(replay_only) == 1 else 'need'} --trace; without it the file is read alone, never "
            "replayed: drop them, or name the run with --trace TRACE_DIR"
        )


# the parameters of analysis_options and ledger_options, which only a replay against a trace reads
_REPLAY_PARAMS = frozenset(
    {
        "force_tolerant",
        "collective",
        "num_threads",
        "force_device",
        "device",
        "recipe",
        "checkpoints_dir",
        "ledger_path",
        "no_ledger",
    }
)
