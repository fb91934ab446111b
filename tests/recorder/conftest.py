"""Helpers for the recorder tests on real demo runs (the runs themselves: fixture ``demo_run``, tests/conftest.py)."""

from __future__ import annotations

from sdc_forensics.demo.recipe import recipe


def nan_input_element(step: int, rank: int, world_size: int) -> int:
    """An element of rank's first input microbatch at ``step`` with 1 <= |x| < 2: bit 30 makes it NaN/Inf."""
    inputs, _ = recipe.fetch_microbatch(recipe.microbatch_ids(step, rank, world_size)[0])
    flat = inputs.reshape(-1).abs()
    return int(((flat >= 1) & (flat < 2)).nonzero()[0, 0])
