"""``slurm``: a real Slurm (munge, ``slurmctld``, ``slurmd``) for the session (``tests/slurm/cluster.py``).

Started by the first test that asks for it and stopped after the session; every test of this
folder skips, with the reason, where Slurm is not installed or its daemons do not come up.
Its tests are marked ``slurm`` and ``heavy`` (``.ci/run``'s heavy run includes them).
"""

from __future__ import annotations

import pytest

from tests.slurm.cluster import SlurmCluster, Unavailable


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Unavailable as exc:
        pytest.skip(f"no Slurm: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster, every node back in service before the test."""
    slurm_cluster.resume_nodes()
    return slurm_cluster
