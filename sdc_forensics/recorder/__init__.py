"""The training-side half: a recorder hooked into DDP that writes the trace and runs the online checks.

Needs torch; import it inside the training job, not in analysis code.
"""

from sdc_forensics.recorder.exit import ALARM_EXIT_CODE, exit_on_alarm
from sdc_forensics.recorder.options import RecorderOptions
from sdc_forensics.recorder.recorder import Recorder, StepRecording
from sdc_forensics.recorder.replayable import replayable

__all__ = ["ALARM_EXIT_CODE", "Recorder", "RecorderOptions", "StepRecording", "exit_on_alarm", "replayable"]
