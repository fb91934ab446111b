"""Shared factories: small synthetic traces built in a temporary directory."""

from __future__ import annotations

import pytest

from sdc_forensics.trace.synthetic import PlantedFault, write_synthetic_trace


@pytest.fixture
def make_trace(tmp_path):
    """``make_trace(ranks=4, steps=20, faults=(...), attempt=0, start_step=0)`` -> trace dir."""
    counter = iter(range(1_000_000))

    def _make(ranks: int = 4, steps: int = 20, faults: tuple[PlantedFault, ...] = (), attempt: int = 0, start_step: int = 0, path=None, **kw):
        target = path if path is not None else tmp_path / f"trace{next(counter)}"
        return write_synthetic_trace(target, num_ranks=ranks, num_steps=steps, faults=faults, attempt=attempt, start_step=start_step, **kw)

    return _make
