"""``exit_on_alarm`` (recorder/exit.py): an alarm becomes exit 18, and the process that is leaving
for it ignores SIGTERM, so that under torchrun (whose agent SIGTERMs the other ranks once one
exits non-zero) every rank exits 18 (tests/distributed/test_alarm_exit.py runs that for real).
In-process: signal handlers are process state, so every test puts SIGTERM's and the module's back.
"""

from __future__ import annotations

import signal

import pytest

from sdc_forensics.errors import SdcAlarm
from sdc_forensics.recorder import exit as alarm_exit
from sdc_forensics.recorder.exit import ALARM_EXIT_CODE, brace_for_alarm_exit, exit_on_alarm


def _own_handler(signum, frame):  # a job's own SIGTERM handler (checkpoint on preemption, say)
    raise AssertionError("not called in these tests")


@pytest.fixture(autouse=True)
def _sigterm_restored(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _own_handler)
    monkeypatch.setattr(alarm_exit, "_armed", 0)
    monkeypatch.setattr(alarm_exit, "_saved_sigterm", alarm_exit._NOT_BRACED)
    monkeypatch.setattr(alarm_exit, "_exiting", False)
    yield
    signal.signal(signal.SIGTERM, before)


def _alarm() -> SdcAlarm:
    return SdcAlarm("weights check fired at step 2: rank 1 differs", step=2, rank=1, host="node0", check="weights")


def test_an_alarm_exits_18_with_sigterm_ignored_from_then_on():
    with pytest.raises(SystemExit) as stop:
        with exit_on_alarm():
            raise _alarm()
    assert stop.value.code == ALARM_EXIT_CODE == 18
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the launcher's SIGTERM cannot make it -15


def test_an_outer_block_seeing_the_exit_keeps_sigterm_ignored():
    with pytest.raises(SystemExit):
        with exit_on_alarm():  # the README's decorator on main, and a block inside it
            with exit_on_alarm():
                raise _alarm()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_the_recorder_braces_inside_a_block_and_a_caught_alarm_gives_sigterm_back():
    with exit_on_alarm():
        try:
            brace_for_alarm_exit()  # what Recorder.__exit__ does when an alarm leaves its block
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            raise _alarm()
        except SdcAlarm:  # the job handles the alarm itself and goes on
            pass
    assert signal.getsignal(signal.SIGTERM) is _own_handler


def test_outside_any_block_nothing_is_braced():
    brace_for_alarm_exit()  # a job without exit_on_alarm: its alarm is its own business
    assert signal.getsignal(signal.SIGTERM) is _own_handler
    with pytest.raises(ValueError):
        with exit_on_alarm():
            raise ValueError("a bug, not an alarm")
    assert signal.getsignal(signal.SIGTERM) is _own_handler
