"""The ``sdc-forensics`` command line: a click group whose subcommands live in their own modules.

Only this layer turns :class:`~sdc_forensics.errors.SdcError` into one line on stderr and the
documented exit code (0 clean, 1 corruption / not certifiable, 2 usage, 3 bad input,
4 inconclusive). Subcommand modules are imported lazily so ``inspect`` starts without torch.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import struct
import sys

import click

from sdc_forensics import __version__
from sdc_forensics.errors import SdcError

EXIT_CLEAN, EXIT_CORRUPTION, EXIT_USAGE, EXIT_INPUT, EXIT_INCONCLUSIVE = 0, 1, 2, 3, 4

# command name -> (module, attribute, one-line help)
_COMMANDS = {
    "inspect": ("sdc_forensics.cli.inspect_cmd", "inspect_cmd", "Summarise a trace directory: alarms, checkpoints and any damage in it."),
    "demo": ("sdc_forensics.cli.demo_cmd", "demo_cmd", "Run a 4-process DDP job on CPU with an injected fault."),
    "bisect": ("sdc_forensics.cli.bisect_cmd", "bisect_cmd", "Find the first divergent step, the suspect rank and the last clean checkpoint."),
    "replay": ("sdc_forensics.cli.replay_cmd", "replay_cmd", "Replay one window of steps and compare with the trace."),
    "verify-checkpoint": ("sdc_forensics.cli.verify_cmd", "verify_cmd", "Verify a checkpoint's structure and content."),
    "certify": ("sdc_forensics.cli.certify_cmd", "certify_cmd", "Certify every checkpoint of a run; name the resume point."),
    "report": ("sdc_forensics.cli.report_cmd", "report_cmd", "Write a post-incident review (HTML, Markdown or JSON)."),
    "export": ("sdc_forensics.cli.export_cmd", "export_cmd", "Export a trace's STEP records to CSV."),
}


#: The last line of defence, deliberately narrow. Readers validate what they parse and raise
#: ``SdcError``s (fix a crash there, at the parse boundary). Should one of these exception types
#: still escape while a reader below is on the stack (a malformed input no check caught yet),
#: it means "unreadable input": one line and exit 3, never a traceback with exit 1 (the
#: "corruption found" code). The same type raised anywhere else (analysis, rendering) is a bug
#: and keeps its traceback. Module name -> the functions that count (None: all of the module).
_READER_ERRORS = (RecursionError, UnicodeDecodeError, struct.error, OverflowError, ValueError, TypeError, AttributeError, KeyError, IndexError)
_READERS: dict[str, frozenset[str] | None] = {
    "sdc_forensics.untrusted": None,
    "sdc_forensics.checkpoint.base": None,
    "sdc_forensics.checkpoint.formats": None,
    "sdc_forensics.checkpoint.folder": None,
    "sdc_forensics.checkpoint.safetensors_reader": None,
    "sdc_forensics.checkpoint.torch_reader": None,
    "sdc_forensics.checkpoint.hf_index": None,
    "sdc_forensics.checkpoint.dcp_reader": None,
    "sdc_forensics.trace.manifest": frozenset({"read_manifest"}),
    "sdc_forensics.trace.checkpoints": frozenset({"read_checkpoint_notes"}),
    "sdc_forensics.trace.reader": None,
    "sdc_forensics.forensics.certificate": frozenset({"read_certificate"}),
}


def _reader_frame(exc: BaseException) -> str | None:
    """``module.function`` of the innermost reader frame the exception passed through, or None."""
    found, tb = None, exc.__traceback__
    while tb is not None:
        module, function = tb.tb_frame.f_globals.get("__name__", ""), tb.tb_frame.f_code.co_name
        if module in _READERS and (_READERS[module] is None or function in _READERS[module]):
            found = f"{module}.{function}"
        tb = tb.tb_next
    return found


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
            sys.exit(1)
        except BrokenPipeError:
            stdout_closed()
            sys.exit(0)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SdcError as exc:
            from sdc_forensics.cli.output import fatal
            from sdc_forensics.forensics.distributed import error_line

            line = error_line(exc)  # under torchrun, process 0 speaks for the group
            if line is not None:
                fatal(line)
            ctx.exit(exc.exit_code)
        except BrokenPipeError:  # stdout's reader went away outside emit_json (click would exit 1)
            from sdc_forensics.cli.output import stdout_closed

            stdout_closed()
            ctx.exit(0)
        except _READER_ERRORS as exc:
            where = _reader_frame(exc)
            if where is None:  # not raised under a reader: a bug, keep the traceback
                raise
            from sdc_forensics.cli.output import fatal

            text = " ".join(str(exc).split())[:200]
            fatal(f"an input file is malformed in a way sdc-forensics does not check yet ({type(exc).__name__} in {where}: {text}); "
                  "check the file, and please report this with it")
            ctx.exit(EXIT_INPUT)


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
        code = 0
    except SystemExit as exc:
        code = exc.code
    if "sdc_forensics.forensics.distributed" in sys.modules:  # a replay across processes lost a peer: exit at once
        sys.modules["sdc_forensics.forensics.distributed"].leave(0 if code is None else code if isinstance(code, int) else 1)
    sys.exit(code)


if __name__ == "__main__":
    main()
