"""The one replay-options type: every command builds it from the same flags and passes it down."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sdc_forensics.cli.common import analysis_options
from sdc_forensics.replay.options import AnalysisOptions
from sdc_forensics.replay.replayer import ReplayOptions
from sdc_forensics.forensics.replay import ReplayRequest
from sdc_forensics.present.report import ReportRequest, reproduce_commands


def test_the_analysis_flags_are_the_options_fields():
    params = analysis_options(lambda **kw: None).__click_params__
    names = {p.name for p in params}
    assert names == {
        "checkpoints_dir",
        "recipe",
        "device",
        "force_device",
        "num_threads",
        "force_tolerant",
        "collective",
    }
    assert names <= {f.name for f in dataclasses.fields(AnalysisOptions)}


def test_a_window_is_built_from_the_chosen_options():
    chosen = AnalysisOptions(device="cuda:1", force_device=True, num_threads=3, force_tolerant=True, recipe="m:a")
    window = ReplayOptions.of(chosen, start_step=4, stop_step=7, checkpoint_path=Path("c.pt"))
    assert (window.start_step, window.stop_step, window.checkpoint_path) == (4, 7, Path("c.pt"))
    assert (window.device, window.force_device, window.num_threads, window.force_tolerant) == ("cuda:1", True, 3, True)
    assert (
        ReplayOptions.of(chosen, start_step=4, stop_step=7, checkpoint_path=Path("c.pt"), num_threads=5).num_threads
        == 5
    )
    assert ReplayRequest(start_step=0, stop_step=1, options=chosen).options is chosen


def test_report_reruns_with_the_chosen_options():
    chosen = AnalysisOptions(
        trace_only=True,
        checkpoints_dir=Path("/ck"),
        recipe="m:a",
        device="cuda",
        num_threads=2,
        force_tolerant=True,
        force_device=True,
    )
    request = ReportRequest(trace_dir=Path("/t"), output="-", fmt="md", options=chosen)

    class _Result:
        mode, replayed = "trace-only", None

    _, commands = reproduce_commands(request, _Result())
    assert commands[0] == (
        "sdc-forensics bisect /t --trace-only --checkpoints /ck --recipe m:a --device cuda --threads 2 "
        "--tolerant --force-device"
    )
