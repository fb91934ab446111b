"""The suite's fixtures, once for every folder: thin wrappers of the builders in ``tests/factories.py``.

* ``make_trace(ranks=4, steps=20, fault=Fault(...), bulk=False, ...)`` -> synthetic trace dir;
* ``make_run(ranks=3, steps=8, checkpoint_every=2, diverge=None, save_from=0)`` -> ``Run``;
* ``sim(fault=None, steps=8, checkpoint_every=4, world_size=4)`` -> dir of a simulated DDP run;
* ``demo_run(injections, steps=6, checkpoint_every=3, result=False, **options)`` -> dir (or
  ``DemoResult``) of a real gloo demo run.

``sim`` and ``demo_run`` are cached per session: tests that change a run's files copy it first.
"""

from __future__ import annotations

import pytest

from tests import factories

#: The slowest tests (5-50 s each on 2 cores: torchrun launches, several recorded runs, the
#: Triton interpreter), marked ``heavy``: the README's test command leaves them out to stay under
#: 8 minutes, and ``.ci/run`` runs them right after it (``python -m pytest -q -m heavy -n 2 --dist
#: loadfile``: two pytest-xdist workers, whole files each).
#: Node-id prefixes, so that one line covers a folder, a file or a test.
HEAVY = (
    "tests/distributed/",
    "tests/recorder/test_user_job.py",
    "tests/recorder/test_readme_job.py",
    "tests/fingerprint/test_triton_kernel.py::test_interpreter_suite",
    "tests/forensics/test_replay.py::test_scan_finds_the_earlier_incident_and_the_recurrence",
    "tests/forensics/test_replay.py::test_collective_fault_below_the_sketch_tolerance_is_found_once_the_order_is_known",
    "tests/forensics/test_tolerant.py::test_weak_residual_is_inconclusive_names_its_candidate_and_certifies_nothing_after_it",
    "tests/forensics/test_tolerant_locations.py",
    "tests/forensics/test_ordered_reduction.py",
    "tests/forensics/test_compress_hooks.py",
    "tests/forensics/test_batchnorm.py::test_faults_at_every_location_are_found_at_their_exact_step_and_rank",
    "tests/recorder/test_ordered.py::test_every_rank_receives_what_the_replay_computes",
    "tests/cli/test_checkpoint_paths.py::test_bisect_finds_the_checkpoints_from_anywhere",
    "tests/cli/test_json_schemas.py::test_certify_and_verify_checkpoint_documents",
    "tests/cli/test_report_demo.py::test_the_reproduce_commands_of_a_report_rerun_as_written",
    "tests/test_factories.py::test_gloo_ring_reference_equals_a_real_gloo_all_reduce_bit_for_bit",
    "tests/cli/test_report_demo.py",
    "tests/cli/test_stdout_document.py",
    "tests/cli/test_json_schemas.py::test_bisect_and_replay_documents",
    "tests/cli/test_demo_inject_upfront.py::test_a_spec_at_the_edge_of_the_range_is_accepted",
    "tests/trace/test_killed.py",
    "tests/recorder/test_training.py::test_nonfinite_check_raises_with_step_rank_and_host_w3",
    "tests/recorder/test_training.py::test_killed_rank_leaves_a_trace_readable_to_the_last_complete_step",
    "tests/recorder/test_training.py::test_resumed_run_is_a_new_attempt_that_supersedes_the_re_executed_steps",
    "tests/forensics/test_follow.py::test_a_follower_killed_and_restarted_certifies_every_checkpoint_with_no_record_lost_or_duplicated",
    "tests/forensics/test_follow.py::test_the_follower_names_the_step_and_rank_of_a_fault_within_one_interval",
    "tests/forensics/test_follow.py::test_a_follower_examines_a_resumed_attempts_steps_again",
    "tests/recorder/test_fsdp_checks.py",
    "tests/checkpoint/test_dcp_sharded.py",
    "tests/recorder/test_fsdp_monitor.py",
    "tests/recorder/test_fsdp_campaign.py",
    "tests/recorder/test_fsdp_recorder.py::test_with_three_hsdp_replicas_the_vote_names_the_rank_online_and_a_clean_run_certifies",
    "tests/integrations/test_torchtitan.py::test_the_checks_run_before_each_optimizer_step_and_name_the_faulty_rank",
    "tests/forensics/test_exactness.py::test_a_sharded_job_replayed_with_a_wrong_learning_rate_certifies_nothing_after_checkpoint_0",
    # the README command's slowest (25-60 s each on a loaded 2-core VM, stop 50's --durations)
    "tests/forensics/test_follow.py::test_sigterm_stops_the_follower_cleanly",
    "tests/cli/test_certify_demo.py::test_checkpoint_saved_from_the_diverged_replica_is_not_certified",
    "tests/cli/test_first_hour.py::test_exit_status_does_not_depend_on_stderr_being_a_closed_pipe",
    "tests/forensics/test_rng_recipes.py::test_a_step_that_depends_on_the_global_rng_is_never_judged",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(HEAVY):
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(autouse=True)
def _ledger_off_unless_asked(request, monkeypatch):
    """Analyses leave the ledger alone (``--no-ledger``) unless a test is marked ``ledger``.

    The session's demo runs and simulated runs are shared by many tests: a ledger in their trace
    directory would let one test's replays stand in for the next test's (and a torchrun run for
    the single-process run it is compared with). In-process analyses get ``no_ledger``; CLI
    processes started by the test inherit ``SDC_FORENSICS_NO_LEDGER=1`` (``--no-ledger``'s variable).
    """
    if request.node.get_closest_marker("ledger") is not None:
        monkeypatch.delenv("SDC_FORENSICS_NO_LEDGER", raising=False)
        return
    from sdc_forensics.forensics import ledger_use

    monkeypatch.setenv("SDC_FORENSICS_NO_LEDGER", "1")
    monkeypatch.setattr(ledger_use.LedgerUse, "open", classmethod(lambda cls, *args, **kwargs: None))


@pytest.fixture
def make_trace(tmp_path):
    """``make_trace(ranks=4, steps=20, fault=None, *, bulk=False, path=None, attempt=0, start_step=0, seed=0,
    audit_every=None, weights_every=1, recipe=None)`` -> trace dir (:func:`tests.factories.write_trace`)."""
    counter = iter(range(1_000_000))

    def _make(ranks: int = 4, steps: int = 20, fault=None, *, path=None, **kwargs):
        target = path if path is not None else tmp_path / f"trace{next(counter)}"
        return factories.write_trace(target, ranks=ranks, steps=steps, fault=fault, **kwargs)

    return _make


@pytest.fixture
def make_run(tmp_path):
    """``make_run(ranks=3, steps=8, checkpoint_every=2, diverge=None, save_from=0, blessed=None)`` -> :class:`tests.factories.Run`."""
    counter = iter(range(1_000_000))

    def _make(**kwargs) -> factories.Run:
        return factories.write_run(tmp_path / f"run{next(counter)}", **kwargs)

    return _make


@pytest.fixture(scope="session")
def sim(tmp_path_factory):
    """``sim(fault=None, steps=8, checkpoint_every=4, world_size=4)`` -> dir of a :func:`tests.factories.simulate` run."""
    cache = {}

    def _sim(
        fault: factories.SimFault | tuple[factories.SimFault, ...] | None = None,
        steps: int = 8,
        checkpoint_every: int = 4,
        world_size: int = 4,
    ):
        key = (fault, steps, checkpoint_every, world_size)
        if key not in cache:
            cache[key] = factories.simulate(
                tmp_path_factory.mktemp("sim"),
                steps=steps,
                checkpoint_every=checkpoint_every,
                world_size=world_size,
                fault=fault,
            )
        return cache[key]

    return _sim


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """``demo_run(injections=(), steps=6, checkpoint_every=3, *, result=False, **run_demo options)``: :class:`tests.factories.DemoRuns`."""
    return factories.DemoRuns(tmp_path_factory)
