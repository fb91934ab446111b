"""What several commands share: the analysis options, the progress bars, and the check that an
output file may be written.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click

from sdc_forensics.cli.output import err, stdout_reserved


class Bars:
    """Rich progress bars on stderr, one per replayed window (implements ``bisect.Progress``)."""

    def __init__(self, enabled: bool) -> None:
        # a follower of a distributed replay draws nothing
        self.enabled = enabled and not err.quiet
        self._progress = None
        self._task = None

    def __enter__(self) -> "Bars":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=err,
                transient=False,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def window(self, start: int, stop: int, reason: str) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(f"replay {start}..{stop}", total=stop - start + 1)
        else:
            span = f"step {start}" if stop == start else f"steps {start}..{stop}"
            err.print(f"[dim]replaying {span}: {reason}[/]")

    def step(self, step: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task)

    def note(self, text: str) -> None:
        err.print(f"note: {text}")


def stdout_is_data(func):
    """Run the command with stdout kept for its document (``output.stdout_reserved``): what the
    recipe, training code, a C extension or a subprocess prints goes to stderr. Place it above
    ``distributed_replay`` (or directly above ``click.pass_context``), so that it covers the whole
    command body but not click's own ``--help``."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with stdout_reserved():
            return func(*args, **kwargs)

    return wrapper


def trace_analysis_options(func):
    """TRACE_DIR and the options every command that runs the analysis shares."""
    func = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")(func)
    return analysis_options(click.argument("trace_dir", type=click.Path(path_type=Path, readable=False))(func))


def analysis_options(func):
    """Replay options (``bisect``, ``replay``, ``certify``, ``report``, ``verify-checkpoint --trace``).

    Their names are the fields of ``replay.options.AnalysisOptions``: a command builds it once
    from them (and its own ``--trace-only``, ``--max-replay-steps``...) and passes it down.
    """
    func = click.option(
        "--tolerant",
        "force_tolerant",
        is_flag=True,
        help="Compare within the sketch tolerance even where the replay is bitwise exact.",
    )(func)
    func = click.option(
        "--collective",
        is_flag=True,
        help="Under torchrun with one process per recorded rank: all-reduce every replayed step with the "
        "replay's own process group (the job's collective, recorded NCCL settings pinned), checked "
        "against the recorded reduced digest at every step (docs/distributed.md).",
    )(func)
    func = click.option(
        "--threads",
        "num_threads",
        type=click.IntRange(min=1),
        help="Replay CPU threads (default: the count each step recorded, which keeps a CPU replay bitwise exact).",
    )(func)
    func = click.option(
        "--force-device",
        is_flag=True,
        help="Replay even on the suspect rank's GPU (under torchrun: even with processes on a suspect's GPU or node).",
    )(func)
    func = click.option("--device", default="cpu", show_default=True, help="Replay device: cpu, cuda or cuda:N.")(func)
    func = click.option(
        "--recipe", metavar="MOD:ATTR", help="Replay recipe (default: the one the trace's manifest names)."
    )(func)
    return click.option(
        "--checkpoints",
        "checkpoints_dir",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="Directory holding the checkpoint files (default: found from the trace: the paths the job wrote, also relative to the trace directory).",
    )(func)


def ledger_options(func):
    """``--ledger PATH`` and ``--no-ledger`` (``bisect``, ``certify``, ``report``, ``verify-checkpoint --trace``):
    the fields ``ledger_path`` and ``no_ledger`` of ``replay.options.AnalysisOptions``. Both on one command
    line are a usage error (``SDC_FORENSICS_NO_LEDGER=1`` in the environment yields to ``--ledger``'s file)."""

    command = func

    @functools.wraps(command)
    def one_of_them(*args, **kwargs):
        from click.core import ParameterSource

        from sdc_forensics.errors import UsageError

        source = click.get_current_context().get_parameter_source("no_ledger")
        if kwargs.get("ledger_path") is not None and kwargs.get("no_ledger"):
            if source is ParameterSource.COMMANDLINE:
                raise UsageError("--ledger PATH and --no-ledger are alternatives: pass one of them")
            kwargs["no_ledger"] = False
        return command(*args, **kwargs)

    func = one_of_them
    func = click.option(
        "--no-ledger",
        is_flag=True,
        envvar="SDC_FORENSICS_NO_LEDGER",
        help="Neither reuse nor append the ledger of examined intervals: replay every interval the analysis needs "
        "(also SDC_FORENSICS_NO_LEDGER=1).",
    )(func)
    func = click.option(
        "--ledger",
        "ledger_path",
        type=click.Path(dir_okay=False, path_type=Path),
        metavar="PATH",
        help="The ledger of examined intervals (default: TRACE_DIR/ledger.jsonl): intervals it certifies are not "
        "replayed again, and every interval replayed now is appended (docs/checkpoints.md, 'The ledger').",
    )(func)
    return func


def run_analysis(trace_dir, options):
    """``bisect`` with progress bars on stderr: the one analysis behind every command.

    Args:
        trace_dir: the trace directory, or the command's open ``Trace``.
        options: the command's ``replay.options.AnalysisOptions``.
    """
    from sdc_forensics.forensics.bisect import bisect

    with Bars(enabled=err.is_terminal) as bars:
        return bisect(trace_dir, options, progress=bars)


def force_option(func):
    """``--force``: overwrite an existing output file (the default refuses, before any work)."""
    return click.option("--force", is_flag=True, help="Overwrite the output file if it exists.")(func)


def check_new_output(path: str | Path | None, force: bool, flag: str) -> None:
    """Refuse, before any work, an output path that exists (unless ``--force``) or whose folder does not.

    Raises:
        UsageError: one line naming ``flag`` and what to do (exit 2).
    """
    from sdc_forensics.errors import UsageError

    if path is None or str(path) == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {target} is a directory: name a file")
    if target.exists() and not force:
        raise UsageError(f"{flag} {target} exists: choose another path, or pass --force to overwrite it")
    if not target.parent.is_dir():
        raise UsageError(f"{flag} {target}: folder {target.parent} does not exist")


def distributed_replay(func):
    """``--replay-timeout`` and the replay across processes (docs/distributed.md).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) the command joins the process group before its work
    (a bare ``--device cuda`` becomes this process's ``cuda:LOCAL_RANK``), every process runs the
    same analysis, process 0 alone writes (followers' stdout and rich stderr are silenced), and
    every process meets process 0 at a last barrier before it exits. Without a launcher the
    command runs exactly as written. Place it directly above ``click.pass_context``.
    """

    @functools.wraps(func)
    def wrapper(*args, replay_timeout: float, **kwargs):
        from sdc_forensics.replay import distributed

        if not distributed.launched():
            return func(*args, **kwargs)
        if "device" in kwargs:
            kwargs["device"] = distributed.process_device(kwargs["device"])
        pinned = (
            distributed.pin_recorded_nccl(kwargs["trace_dir"])
            if kwargs.get("collective") and kwargs.get("trace_dir")
            else []
        )
        group = distributed.start(kwargs.get("device", "cpu"), replay_timeout)
        if not group.lead:
            silence_follower()
        err.print(
            f"note: replaying across {group.size} processes ({group.backend}): original rank r on process r % {group.size}; "
            "process 0 writes the output",
            markup=False,
        )
        if pinned:
            err.print(f"note: --collective: the recorded NCCL settings pinned: {', '.join(pinned)}", markup=False)
        completed = lost = False
        try:
            value = func(*args, **kwargs)
            completed = True
            return value
        except click.exceptions.Exit:
            completed = True
            raise
        except distributed.ReplayProcessLost:
            lost = True
            raise
        finally:
            distributed.finish(completed, peer_lost=lost)

    return click.option(
        "--replay-timeout",
        type=click.FloatRange(min=1.0),
        default=300.0,
        show_default=True,
        metavar="SECONDS",
        help="Under torchrun: the longest wait for another replay process at any exchange (plus the estimated "
        "work of whole checkpoint intervals shared out, docs/distributed.md); a process that died or "
        "hangs ends the run with exit 4.",
    )(wrapper)


def silence_follower() -> None:
    """A follower of a distributed replay writes nothing: stdout to the null device, no rich stderr
    (its error lines still come through ``cli/main.py``, as ``distributed.error_line`` decides)."""
    from sdc_forensics.cli.output import stdout_closed

    err.quiet = True
    stdout_closed()
