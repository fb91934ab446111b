"""The process exit code of a training job stopped by an online check, for launchers and epilogs.

Under policy ``raise`` the recorder raises :class:`~sdc_forensics.errors.SdcAlarm` on every rank
at the same step. A job that lets it escape dies with Python's exit code 1, like any crash, so a
launcher, a Slurm epilog or a Kubernetes controller cannot tell "the hardware computed a wrong
number: quarantine the node and run ``sdc-forensics bisect``" from "the script has a bug".
:func:`exit_on_alarm` turns the alarm into one line on stderr and exit code
:data:`ALARM_EXIT_CODE`::

    from sdc_forensics.recorder import exit_on_alarm

    @exit_on_alarm()
    def main(): ...            # or:  with exit_on_alarm(): train()

Why 18: distinct from Python's 1 (uncaught exception) and 2 (usage), from the CLI's 0..4
(``sdc_forensics.exitcodes.ExitCode``, the commands' table, which this code stays outside), from
the BSD sysexits range 64..78 and from 128+N (killed by signal N); and distinct from Megatron's
16 and 17 (its rerun machinery: "resume to disambiguate" and "failed result validation"), so that
a job running both can tell which one stopped it.
"""

from __future__ import annotations

import contextlib
import sys

from sdc_forensics.errors import SdcAlarm

#: Exit code of a process stopped by an online check (policy ``raise``); see the module docstring.
ALARM_EXIT_CODE = 18


class exit_on_alarm(contextlib.ContextDecorator):  # noqa: N801 - used like a function: `with exit_on_alarm():`
    """Context manager and decorator: an :class:`SdcAlarm` leaving the block prints one line on
    stderr and exits the process with :data:`ALARM_EXIT_CODE`; anything else passes through.

    Put it outside the recorder (``with exit_on_alarm(): with Recorder(...) as rec: ...``, or
    around ``main``) so that the recorder closes its files on the alarm before the exit.

    Args:
        code: the exit code (default :data:`ALARM_EXIT_CODE`).
    """

    def __init__(self, code: int = ALARM_EXIT_CODE) -> None:
        self.code = code

    def __enter__(self) -> "exit_on_alarm":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, SdcAlarm):
            return False
        message = " ".join(str(exc).split())
        # the alarm's message already names the trace and the command to run next (Recorder._alarm)
        print(f"sdc-forensics: training stopped by an online check (exit {self.code}): {message}", file=sys.stderr, flush=True)
        raise SystemExit(self.code)
