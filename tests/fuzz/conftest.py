"""Hypothesis profiles of the fuzz suite, and its shared fixture.

* ``ci`` (default): ``CI_EXAMPLES`` examples per property (about 3,300 in all over the folder,
  under a minute on 2 cores), derandomized (the same draws on every run: CI never fails on a
  new random draw), no example database written, a 5 s deadline per example.
* ``deep`` (``SDC_FUZZ_PROFILE=deep``, or ``benchmarks/fuzz.py``): ``SDC_FUZZ_EXAMPLES``
  (default 2,000) per property, randomised, for local runs and the benchmark.

Every example is also bounded in wall time by ``tests/fuzz/harness.py`` (``SDC_FUZZ_HANG_S``,
20 s: interrupted, reported as a hang), and every test by ``SDC_FUZZ_TEST_S`` (default 120 s).
Corpora (valid inputs that examples mutate) are built once per module: fixtures ``corpus``.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

CI_EXAMPLES = 120
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]


def register_profiles() -> None:
    """Register ``ci`` and ``deep`` (idempotent); ``benchmarks/fuzz.py`` calls it too."""
    settings.register_profile(
        "ci",
        max_examples=CI_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=timedelta(seconds=5),
        suppress_health_check=_SLOW,
        print_blob=True,
    )
    settings.register_profile(
        "deep",
        max_examples=int(os.environ.get("SDC_FUZZ_EXAMPLES", "2000")),
        derandomize=False,
        database=None,
        deadline=timedelta(seconds=5),
        suppress_health_check=_SLOW,
        print_blob=True,
    )


register_profiles()
settings.load_profile(os.environ.get("SDC_FUZZ_PROFILE", "ci"))

#: Examples of each CLI property (each one a whole CLI run): a handful in CI.
CLI_EXAMPLES = 6 if settings.default.max_examples <= CI_EXAMPLES else max(20, settings.default.max_examples // 20)
TEST_BOUND_S = float(os.environ.get("SDC_FUZZ_TEST_S", "120"))


@pytest.fixture(autouse=True)
def _test_wall_bound(request):
    """Every fuzz test finishes within ``SDC_FUZZ_TEST_S`` (examples are bounded one by one)."""
    started = time.perf_counter()
    yield
    elapsed = time.perf_counter() - started
    assert elapsed <= TEST_BOUND_S, (
        f"{request.node.name} took {elapsed:.0f} s, over the {TEST_BOUND_S:.0f} s bound of a fuzz test"
    )


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """Fresh directories for a module's examples (``with scratch() as folder``), removed after each."""
    from tests.fuzz.harness import Scratch

    return Scratch(tmp_path_factory.mktemp("fuzz"))
