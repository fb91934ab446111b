"""Factories for real multi-process DDP runs (gloo, CPU) of the demo recipe, shared per module."""

from __future__ import annotations

import pytest

from sdc_forensics.demo.recipe import recipe


def nan_input_element(step: int, rank: int, world_size: int) -> int:
    """An element of rank's first input microbatch at ``step`` with 1 <= |x| < 2: bit 30 makes it NaN/Inf."""
    inputs, _ = recipe.fetch_microbatch(recipe.microbatch_ids(step, rank, world_size)[0])
    flat = inputs.reshape(-1).abs()
    return int(((flat >= 1) & (flat < 2)).nonzero()[0, 0])


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``demo_run(name, **run_demo kwargs)`` -> DemoResult, run once per name per module."""
    from sdc_forensics.demo.run import run_demo

    cache = {}

    def _run(name: str, **kwargs):
        if name not in cache:
            cache[name] = run_demo(tmp_path_factory.mktemp(name), **kwargs)
        return cache[name]

    return _run
