"""The training-side half: a recorder hooked into a data-parallel job that writes the trace and runs the online checks.

Needs torch; import it inside the training job, not in analysis code.

Files, top to bottom (each imports only files below it):

* ``recorder.py``: the step protocol, once (``Recorder``), and ``make_layout``, which picks the layout;
* ``ddp_layout.py`` and ``fsdp_layout.py`` (with ``fsdp_tap.py``): the layouts;
* ``layout.py``: their contract (``Layout``); ``step.py``: one step's state and handle;
* beneath them: ``checkpointing.py`` (the checkpoint protocol and its savers), ``audit.py``,
  ``hooks.py`` and ``ordered.py`` (DDP's comm hook), ``fsdp_monitor.py``, ``fsdp_fallback.py`` and
  ``fsdp_checks.py`` (FSDP2's checks, usable without a recorder), ``records.py``, ``identity.py``,
  ``threads.py``, ``rng_watch.py``, ``exit.py``, ``replayable.py``, and at the bottom
  ``checks.py`` (the findings and the votes) and ``options.py``.
"""

from sdc_forensics.recorder.exit import ALARM_EXIT_CODE, exit_on_alarm
from sdc_forensics.recorder.options import RecorderOptions
from sdc_forensics.recorder.recorder import Recorder
from sdc_forensics.recorder.replayable import replayable
from sdc_forensics.recorder.step import StepRecording

__all__ = ["ALARM_EXIT_CODE", "Recorder", "RecorderOptions", "StepRecording", "exit_on_alarm", "replayable"]
