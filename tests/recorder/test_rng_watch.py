"""recorder/rng_watch.py: an unseeded draw inside a step is said once; a reseeded one is not."""

from __future__ import annotations

import logging

import torch

from sdc_forensics.recorder.rng_watch import RngWatch


def _steps(watch: RngWatch, body, steps=range(5)) -> None:
    for step in steps:
        watch.begin(step)
        body(step)
        watch.check(None, (), {})


def test_dropout_from_the_global_rng_is_said_once_on_rank_0(caplog):
    watch = RngWatch(0, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="sdc_forensics.recorder.rng_watch"):
        _steps(watch, lambda step: torch.nn.functional.dropout(torch.ones(8), 0.5))
    assert watch.drawn == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "step 0 drew from the global RNG without seeding it" in messages[0]
    assert "torch.manual_seed(K + microbatch_id)" in messages[0]


def test_draws_seeded_from_the_microbatch_id_are_replayable_and_not_said(caplog):
    watch = RngWatch(0, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="sdc_forensics.recorder.rng_watch"):
        _steps(watch, lambda step: (torch.manual_seed(1000 + step), torch.rand(4)))
    assert watch.drawn is None and not caplog.records


def test_a_step_that_draws_nothing_is_not_said_and_other_ranks_stay_quiet(caplog):
    quiet, other = RngWatch(0, torch.device("cpu")), RngWatch(1, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="sdc_forensics.recorder.rng_watch"):
        _steps(quiet, lambda step: torch.ones(3) * 2)
        _steps(other, lambda step: torch.rand(3))
    assert quiet.drawn is None and other.drawn == 0 and not caplog.records  # rank 1 notices, rank 0 alone speaks


def test_only_the_first_steps_are_watched():
    watch = RngWatch(0, torch.device("cpu"), steps=2)
    _steps(watch, lambda step: torch.rand(3) if step >= 2 else None)
    assert watch.drawn is None
