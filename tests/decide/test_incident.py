"""``decide.incident`` and ``triage.series``: times, losses, nodes to act on, checkpoint placement and the plotted
series, checked against the raw records (read here with numpy, not through the step windows)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.evidence import Location
from sdc_forensics.decide.incident import Implicates, Locality, build_incident, dcgm_level, node_name, path_locality
from sdc_forensics.replay.options import BisectOptions
from sdc_forensics.triage.series import Consensus, incident_series, plot_window
from sdc_forensics.trace import format as F
from sdc_forensics.trace.reader import Trace
from tests.factories import Fault, SimFault


def _raw_times(trace_dir, ranks: int) -> np.ndarray:
    """``(steps, ranks)`` STEP record times, straight from the rank files."""
    columns = []
    for rank in range(ranks):
        path = trace_dir / f"rank-{rank:05d}.attempt-000.sdct"
        recs = np.fromfile(path, dtype=F.record_dtype(8), offset=F.HEADER_SIZE)
        step_recs = recs[recs["kind"] == int(F.Kind.STEP)]
        columns.append(step_recs["time_ns"][np.argsort(step_recs["step"])])
    return np.stack(columns, axis=1)


@pytest.mark.parametrize(
    "paths, expected",
    [
        (["/tmp/run/ckpt-10.pt"], Locality.NODE_LOCAL),
        (["/raid/job/step-1", "/fsx/job/step-2"], Locality.NODE_LOCAL),  # any node-local file is a node's to lose
        (["/fsx/job/step-1", "/lustre/x"], Locality.SHARED),
        (["s3://bucket/ckpt"], Locality.SHARED),
        (["checkpoints/step-1.pt"], Locality.UNKNOWN),  # relative: resolved from the job's directory
        (["/data/ckpt"], Locality.UNKNOWN),
        (["/tmpfoo/ckpt"], Locality.UNKNOWN),  # a prefix is a whole path component
        ([], Locality.UNKNOWN),
    ],
)
def test_path_locality(paths, expected):
    assert path_locality(paths) is expected


def test_dcgm_level_follows_what_is_implicated():
    assert dcgm_level(Implicates.GPU, recurring=False) == 3
    assert dcgm_level(Implicates.GPU, recurring=True) == 4
    assert dcgm_level(Implicates.HOST_DATA_PATH, recurring=False) == 2
    assert dcgm_level(Implicates.DISK, recurring=True) is None  # storage damage never implicates the GPU


def test_plot_window():
    assert plot_window((0, 39), 23) == (0, 39)
    assert plot_window((0, 99_999), 50_000, max_steps=1000) == (
        49_251,
        50_250,
    )  # s* and 250 steps after it, the rest before
    assert plot_window((0, 99_999), 10, max_steps=1000) == (0, 999)
    assert plot_window((0, 99_999), None, max_steps=1000) == (99_000, 99_999)  # clean: the last steps
    assert plot_window(None, None) is None


def test_times_and_loss_without_a_clean_checkpoint(make_trace):
    trace_dir = make_trace(ranks=4, steps=30, fault=Fault(kind="nonfinite", step=17, rank=3))
    result = bisect(trace_dir, BisectOptions(trace_only=True))
    incident = build_incident(result, Trace.open(trace_dir))
    times = _raw_times(trace_dir, 4)
    assert incident.first_divergent_step == 17
    # step 17 ran on rank 3's clock between its records of steps 16 and 17
    assert (incident.divergent_started_ns, incident.divergent_ended_ns) == (times[16, 3], times[17, 3])
    assert incident.last_step == 29 and incident.last_step_ns == times[29].max()
    lost = incident.lost
    assert (lost.from_step, lost.to_step, lost.num_steps, lost.basis) == (0, 29, 30, "first_step")
    assert lost.wall_clock_s == pytest.approx((times[29].max() - times[0].min()) / 1e9)
    assert lost.gpu_hours == pytest.approx(lost.wall_clock_s * 4 / 3600)
    [node] = incident.nodes
    assert (node.rank, node.node, node.node_source, node.gpu_uuid, node.implicates, node.dcgm_level) == (
        3,
        "node1",
        "host",
        "GPU-0003",
        Implicates.GPU,
        3,
    )
    assert incident.resume_step is None and not incident.collective


def test_node_names_come_from_slurm_then_kubernetes_then_host(make_trace):
    trace_dir = make_trace(ranks=4, steps=12, fault=Fault(kind="nonfinite", step=3, rank=3))
    manifest = json.loads((trace_dir / "manifest.json").read_text())
    ranks = manifest["attempts"][0]["ranks"]
    ranks[3]["slurm_node"], ranks[3]["k8s_node"] = "gpu-017", "ignored"
    ranks[1]["k8s_node"] = "ip-10-0-0-5.ec2.internal"
    (trace_dir / "manifest.json").write_text(json.dumps(manifest))
    result = bisect(trace_dir, BisectOptions(trace_only=True))
    incident = build_incident(result, Trace.open(trace_dir))
    by_rank = {n.rank: n for n in incident.nodes}
    assert (by_rank[3].node, by_rank[3].node_source, by_rank[3].host) == ("gpu-017", "slurm", "node1")
    manifest = Trace.open(trace_dir).manifest
    assert node_name(manifest, 1) == ("ip-10-0-0-5.ec2.internal", "kubernetes")
    assert node_name(manifest, 0) == ("node0", "host")


def test_collective_fault_names_no_node(make_trace):
    trace_dir = make_trace(ranks=4, steps=12, fault=Fault(kind="allreduce-all", step=6))
    incident = build_incident(bisect(trace_dir, BisectOptions(trace_only=True)), Trace.open(trace_dir))
    assert incident.collective and incident.nodes == ()


def test_clean_run_loses_nothing(make_trace):
    trace_dir = make_trace(ranks=3, steps=10)
    incident = build_incident(bisect(trace_dir, BisectOptions(trace_only=True)), Trace.open(trace_dir))
    assert incident.lost is None and incident.nodes == () and incident.first_divergent_step is None


def test_loss_from_the_resume_checkpoint_of_a_replayed_run(sim):
    out = sim(SimFault(where="grad", step=5, rank=2, bit=30), steps=8, checkpoint_every=4)
    trace_dir = out / "trace"
    result = bisect(trace_dir, BisectOptions(checkpoints_dir=out / "checkpoints"))
    incident = build_incident(result, Trace.open(trace_dir))
    times = _raw_times(trace_dir, 4)
    assert result.first_divergent_step == 5 and incident.resume_step == 4
    lost = incident.lost
    assert (lost.from_step, lost.to_step, lost.num_steps, lost.basis) == (4, 7, 4, "resume_checkpoint")
    # θ_4 existed once every rank had written step 3's record
    assert lost.wall_clock_s == pytest.approx((times[7].max() - times[3].max()) / 1e9)
    assert incident.checkpoint_locality is Locality.NODE_LOCAL  # the sim writes under the temporary directory
    assert incident.resume_saved_by is not None and incident.nodes[0].location is Location.LOCAL_COMPUTE


def test_series_show_the_allreduce_fault_the_diverged_replica_and_the_lost_audit(make_trace):
    trace_dir = make_trace(
        ranks=4,
        steps=12,
        audit_every=4,
        fault=(
            Fault(kind="allreduce-all", step=3),
            Fault(kind="weights", step=6, rank=2),
            Fault(kind="audit-subject", step=8, rank=0),
        ),
    )
    series = incident_series(Trace.open(trace_dir), (0, 11))
    assert series.whole_run and list(series.steps) == list(range(12))
    assert (series.residual_ratio[3] > 1).all()  # every rank received the wrong result
    others = np.delete(series.residual_ratio, 3, axis=0)
    assert (others < 1).all()
    assert (series.consensus[6:, 2] == Consensus.DIFFERS).all() and (series.consensus[:6, 2] == Consensus.AGREES).all()
    assert (np.delete(series.consensus, 2, axis=1) == Consensus.AGREES).all()
    assert series.audits.tolist() == [[0, 0, 0], [4, 0, 0], [8, 0, 1]]  # step 8: rank 0's own gradient lost the vote
    assert series.loss.shape == (12, 4) and np.isfinite(series.loss).all()
