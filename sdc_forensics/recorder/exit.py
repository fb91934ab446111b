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

Every rank exits 18, also under a launcher that stops the group when one process ends (torchrun's
agent SIGTERMs the other ranks as soon as the first exits non-zero): a rank on its way out for an
alarm ignores SIGTERM (:func:`brace_for_alarm_exit`, from the moment the alarm leaves the
``Recorder`` block), so a peer that exits first cannot turn this rank's 18 into -15 while it
closes its trace or tears gloo down. A rank whose exit hangs is still ended by the launcher's
SIGKILL after its grace period.

Why 18: distinct from Python's 1 (uncaught exception) and 2 (usage), from the CLI's 0..4
(``sdc_forensics.exitcodes.ExitCode``, the commands' table, which this code stays outside), from
the BSD sysexits range 64..78 and from 128+N (killed by signal N); and distinct from Megatron's
16 and 17 (its rerun machinery: "resume to disambiguate" and "failed result validation"), so that
a job running both can tell which one stopped it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from sdc_forensics.errors import SdcAlarm

#: Exit code of a process stopped by an online check (policy ``raise``); see the module docstring.
ALARM_EXIT_CODE = 18

#: How many :class:`exit_on_alarm` blocks are open in this process (only then is SIGTERM braced).
_armed = 0
#: SIGTERM's handler before :func:`brace_for_alarm_exit` replaced it (a sentinel while not braced).
_NOT_BRACED = object()
_saved_sigterm = _NOT_BRACED
#: True once an :class:`exit_on_alarm` block turned an alarm into the exit: braced for good.
_exiting = False


def brace_for_alarm_exit() -> None:
    """An alarm is on its way to :class:`exit_on_alarm`: ignore SIGTERM until the process exits.

    torchrun's agent SIGTERMs every other rank once one rank exits non-zero; the ranks raise at the
    same step, but the first one out would otherwise have the others killed (-15) while they
    close their trace files or tear the process group down. Nothing happens outside an
    ``exit_on_alarm`` block (an alarm the job catches itself keeps its SIGTERM) or off the main
    thread (where Python cannot set a handler).
    """
    global _saved_sigterm
    if _armed <= 0 or _saved_sigterm is not _NOT_BRACED or threading.current_thread() is not threading.main_thread():
        return
    try:
        _saved_sigterm = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (ValueError, OSError):  # pragma: no cover - no signals here (an embedded interpreter)
        pass


def _unbrace() -> None:
    """SIGTERM's handler back, after an alarm the job caught itself inside the block."""
    global _saved_sigterm
    if _saved_sigterm is _NOT_BRACED or _exiting:
        return
    with contextlib.suppress(ValueError, OSError, TypeError):
        signal.signal(signal.SIGTERM, _saved_sigterm if _saved_sigterm is not None else signal.SIG_DFL)
    _saved_sigterm = _NOT_BRACED


class exit_on_alarm(contextlib.ContextDecorator):  # noqa: N801 - used like a function: `with exit_on_alarm():`
    """Context manager and decorator: an :class:`SdcAlarm` leaving the block prints one line on
    stderr and exits the process with :data:`ALARM_EXIT_CODE`; anything else passes through.

    Put it outside the recorder (``with exit_on_alarm(): with Recorder(...) as rec: ...``, or
    around ``main``) so that the recorder closes its files on the alarm before the exit. From the
    moment the alarm leaves the recorder's block until the process ends, SIGTERM is ignored
    (:func:`brace_for_alarm_exit`), so that under torchrun every rank exits 18.

    Args:
        code: the exit code (default :data:`ALARM_EXIT_CODE`).
    """

    def __init__(self, code: int = ALARM_EXIT_CODE) -> None:
        self.code = code

    def __enter__(self) -> "exit_on_alarm":
        global _armed
        _armed += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _armed, _exiting
        if exc_type is None or not issubclass(exc_type, SdcAlarm):
            _armed -= 1
            if _armed <= 0:
                _unbrace()
            return False
        # while still armed; the recorder's block braced already when it was inside it
        brace_for_alarm_exit()
        # this process exits 18: an outer block seeing the SystemExit does not unbrace
        _exiting = True
        _armed -= 1
        message = " ".join(str(exc).split())
        # the alarm's message already names the trace and the command to run next (Recorder._alarm)
        print(
            f"sdc-forensics: training stopped by an online check (exit {self.code}): {message}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(self.code)
