"""The exit codes of the ``sdc-forensics`` commands: one table, and the two rules that choose one.

Every command ends with one of :class:`ExitCode` (docs/bisect.md, the CLI's ``--help``):

* 0 clean: nothing wrong found in replayed steps (``bisect``, ``replay``, ``report``), a
  checkpoint certified clean to resume from by an analysis that reached a verdict (``certify``),
  a file verified or certified clean (``verify-checkpoint``);
* 1 corruption found, or not certifiable;
* 2 usage error (bad flag, bad value, an output that exists without ``--force``);
* 3 unreadable or invalid input (every ``errors.InvalidInputError``);
* 4 inconclusive: no verdict (``certify`` names no resume point then, even with checkpoint 0
  clean), nothing wrong found but not everything examined (unverified; ``bisect --trace-only``
  with nothing found), or a replay process lost under torchrun.

``certify --follow`` reads them as a follower (``forensics/follow.py``): 1 it found an incident,
4 it stopped (``--until-step``, ``--idle-timeout``, SIGTERM/SIGINT) with checkpoint intervals
left unexamined, 0 every closed interval it saw was replayed exactly and clean. A signal is a
clean stop, not an error: no 128+N code.

The analysis' verdict chooses the code through :data:`EXIT_BY_VERDICT` (:func:`analysis_exit`:
a clean verdict of the trace alone, ``--trace-only``, is 4), a checkpoint's status through
:data:`EXIT_BY_STATUS`; both are keyed by the published spellings (the JSON ``verdict``
and ``status`` values) and take the enums of ``decide.decision`` too. A training job stopped by
an online check exits with ``recorder.exit.ALARM_EXIT_CODE`` (18), outside this table on purpose:
it is the training process's code, not a command's.

This module imports nothing of the package (and no torch): ``errors.py`` and the CLI's entry
point read it first.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class ExitCode(enum.IntEnum):
    """The documented exit codes of every command."""

    CLEAN = 0
    CORRUPTION = 1
    USAGE = 2
    BAD_INPUT = 3
    INCONCLUSIVE = 4
    # the same codes as ``certify`` and ``verify-checkpoint`` read them
    NOT_CERTIFIABLE = 1
    UNVERIFIED = 4


#: The analysis verdict (``decide.decision.Verdict``'s values) -> exit code.
EXIT_BY_VERDICT: Mapping[str, ExitCode] = {
    "clean": ExitCode.CLEAN,
    "corruption": ExitCode.CORRUPTION,
    "inconclusive": ExitCode.INCONCLUSIVE,
}

#: A checkpoint's status (``decide.decision.Status``'s values) -> exit code.
EXIT_BY_STATUS: Mapping[str, ExitCode] = {
    "clean": ExitCode.CLEAN,
    "unverified": ExitCode.UNVERIFIED,
    "tainted": ExitCode.NOT_CERTIFIABLE,
    "corrupt": ExitCode.NOT_CERTIFIABLE,
}


def _value(member) -> str:
    return getattr(member, "value", member)


def verdict_exit(verdict) -> ExitCode:
    """The exit code of an analysis verdict (a ``Verdict`` or its value)."""
    return EXIT_BY_VERDICT[_value(verdict)]


def analysis_exit(verdict, mode) -> ExitCode:
    """The exit code of an analysis (``bisect``, ``report``): its verdict's, except that a
    ``clean`` verdict of the trace alone (mode ``trace-only``: no step replayed, no checkpoint file
    read) is 4. The trace's checks see NaN/Inf, the collective's sketches, the replicas' weights
    vote and audits, not a wrong finite local gradient on an unaudited step, so "nothing found in
    the trace" must not read as "clean" to a script (``bisect --trace-only && resume``); 1 still
    means the trace's evidence localised a fault, so an epilog that alarms on 1 stays quiet on a
    healthy run (docs/decisions.md, "Output scripts act on").

    Args:
        verdict: a ``Verdict`` or its value.
        mode: the analysis' mode, ``"replay"`` or ``"trace-only"`` (``BisectResult.mode``).
    """
    code = verdict_exit(verdict)
    if code == ExitCode.CLEAN and _value(mode) == "trace-only":
        return ExitCode.INCONCLUSIVE
    return code


def status_exit(status) -> ExitCode:
    """The exit code of a checkpoint status (a ``Status`` or its value)."""
    return EXIT_BY_STATUS[_value(status)]
