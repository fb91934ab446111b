"""The ``sdc-forensics`` command line: a click group whose subcommands live in their own modules.

Only this layer turns :class:`~sdc_forensics.errors.SdcError` into one line on stderr and the
documented exit code (0 clean, 1 corruption / not certifiable, 2 usage, 3 bad input,
4 inconclusive; the one table is ``exitcodes.ExitCode``): each error class carries its code, and every reader of untrusted input raises an
``InvalidInputError`` (exit 3) for anything it cannot parse (``errors.reader``), so no list of
readers is kept here. Subcommand modules are imported lazily so ``inspect`` starts without torch.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys

import click

from sdc_forensics import __version__
from sdc_forensics.errors import SdcError
from sdc_forensics.exitcodes import ExitCode

# command name -> (module, attribute, one-line help)
_COMMANDS = {
    "inspect": (
        "sdc_forensics.cli.inspect_cmd",
        "inspect_cmd",
        "Summarise a trace directory: alarms, checkpoints and any damage in it.",
    ),
    "demo": ("sdc_forensics.cli.demo_cmd", "demo_cmd", "Run a 4-process DDP job on CPU with an injected fault."),
    "bisect": (
        "sdc_forensics.cli.bisect_cmd",
        "bisect_cmd",
        "Find the first divergent step, the suspect rank and the last clean checkpoint.",
    ),
    "replay": ("sdc_forensics.cli.replay_cmd", "replay_cmd", "Replay one window of steps and compare with the trace."),
    "verify-checkpoint": ("sdc_forensics.cli.verify_cmd", "verify_cmd", "Verify a checkpoint's structure and content."),
    "certify": (
        "sdc_forensics.cli.certify_cmd",
        "certify_cmd",
        "Certify every checkpoint of a run; name the resume point.",
    ),
    "report": ("sdc_forensics.cli.report_cmd", "report_cmd", "Write a post-incident review (HTML, Markdown or JSON)."),
    "export": ("sdc_forensics.cli.export_cmd", "export_cmd", "Export a trace's STEP records to CSV."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name, (mod, _, _) in _COMMANDS.items() if importlib.util.find_spec(mod) is not None]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module, attribute, _ = _COMMANDS[name]
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError):
            return None

    def resolve_command(self, ctx: click.Context, args: list[str]):
        """click's, plus the suggestion click gives for a mistyped flag: ``bisec`` -> ``bisect``."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in _COMMANDS:
            close = difflib.get_close_matches(name, list(_COMMANDS), n=1, cutoff=0.6)
            if close:
                ctx.fail(f"No such command {name!r}. Did you mean {' or '.join(repr(c) for c in close)}?")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra):
        """click's ``main``, but a usage error is one line (``error: ...``, exit 2) and a closed
        stdout is not an error (click prints usage, a hint and the error on three lines, and exits
        1 on a broken pipe)."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        from sdc_forensics.cli.output import fatal, stdout_closed

        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as exc:
            hint = ""
            if isinstance(exc, click.UsageError) and exc.ctx is not None:
                hint = f" (see {exc.ctx.command_path} --help)"
            fatal(exc.format_message() + hint)
            sys.exit(exc.exit_code)
        except click.Abort:
            fatal("aborted")
            # click's own code for an abort
            sys.exit(ExitCode.CORRUPTION)
        except BrokenPipeError:
            stdout_closed()
            sys.exit(ExitCode.CLEAN)
        sys.exit(code if isinstance(code, int) else ExitCode.CLEAN)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SdcError as exc:
            from sdc_forensics.cli.output import fatal
            from sdc_forensics.replay.distributed import error_line

            # under torchrun, process 0 speaks for the group
            line = error_line(exc)
            if line is not None:
                fatal(line)
            ctx.exit(exc.exit_code)
        # an input this user may not read (a file of the checkpoint or trace, or a folder on its path)
        except PermissionError as exc:
            from sdc_forensics.cli.output import fatal

            fatal(
                f"{exc.filename or 'an input'}: permission denied: this user cannot open it; make it readable (its mode "
                "and its folders' execute bits, or ownership), or run as a user who can read it"
            )
            ctx.exit(ExitCode.BAD_INPUT)
        # stdout's reader went away outside emit_json (click would exit 1)
        except BrokenPipeError:
            from sdc_forensics.cli.output import stdout_closed

            stdout_closed()
            ctx.exit(ExitCode.CLEAN)
        # the disk or the kernel failed a read (EIO from a failing disk or a network mount; /proc/self/mem)
        except OSError as exc:
            import errno

            if exc.errno not in (errno.EIO, errno.ENXIO, errno.ENODEV, errno.ESTALE, errno.EREMOTEIO):
                raise
            from sdc_forensics.cli.output import fatal

            fatal(
                f"{exc.filename or 'an input'}: the system could not read it ({exc.strerror or exc}): a failing disk, a "
                "lost network mount or a special file; copy the files to a healthy disk and analyse the copy"
            )
            ctx.exit(ExitCode.BAD_INPUT)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sdc-forensics")
def cli() -> None:
    """Find silent data corruption in data-parallel PyTorch training.

    Exit codes: 0 clean, 1 corruption found / not certifiable, 2 usage error,
    3 unreadable or invalid input, 4 inconclusive.
    """


def main() -> None:
    """Console-script entry point.

    A reader of stdout that went away (``| head``) is not an error: commands discard the rest of
    stdout and exit with their own status (``cli/output.py``); should a write escape that (click's
    own output), the rest is discarded in ``_LazyGroup.invoke`` or here and the exit status is 0.
    """
    try:
        code = cli.main(prog_name="sdc-forensics", standalone_mode=True)
    except BrokenPipeError:
        from sdc_forensics.cli.output import stdout_closed

        stdout_closed()
        code = ExitCode.CLEAN
    except SystemExit as exc:
        code = exc.code
    # a replay across processes lost a peer: exit at once
    if "sdc_forensics.replay.distributed" in sys.modules:
        sys.modules["sdc_forensics.replay.distributed"].leave(
            ExitCode.CLEAN if code is None else code if isinstance(code, int) else ExitCode.CORRUPTION
        )
    sys.exit(code)


if __name__ == "__main__":
    main()
