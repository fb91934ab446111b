"""The incident around a verdict: when it happened, what it cost, which nodes to act on, and the
per-step series the report plots. Data only (numpy, no torch, no formatting).

:func:`build_incident` reads a trace's STEP records for a handful of steps (the first divergent
step and the one before it, the resume checkpoint's step, the last step) and the manifest's
identities, and turns a :class:`~sdc_forensics.decide.verdict.BisectResult` into:

* **times** (UTC epoch ns, as the ranks' clocks wrote them): a STEP record's ``time_ns`` is taken
  when the step's record is written, after its update and checks, so step ``s`` ran between the
  record of ``s - 1`` and its own; that interval is where an XID or DCGM event must fall;
* **what was lost**: from the resume checkpoint ``N`` (it holds ``θ_N``) to the last recorded step
  ``L``: ``L + 1 - N`` steps to redo, the wall-clock between ``θ_N`` being reached (the record of
  step ``N - 1``) and the record of ``L``, and GPU-hours = that wall-clock × world size (one GPU
  per rank). Without a clean checkpoint the count runs from the first recorded step;
* **nodes to act on**: one :class:`NodeTarget` per suspect rank, named as the scheduler knows it
  (Slurm node, else Kubernetes node, else host), with what it implicates (the GPU, the host's
  data path, or the disk: storage damage never implicates a GPU, design brief) and the DCGM
  diagnostic level; a collective fault or a clean run names none;
* **where checkpoints live**: node-local, shared, or unknown, from the paths the job wrote
  (:func:`path_locality`), and whether the resume checkpoint was written by a suspect node;

The per-step series the report plots are in ``triage/series.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import PurePosixPath

import numpy as np

from sdc_forensics.evidence import Location
from sdc_forensics.decide.verdict import BisectResult, Verdict
from sdc_forensics.trace.manifest import Manifest
from sdc_forensics.trace.reader import Trace

# Path prefixes of node-local disks (temporary directories, local NVMe/RAID mounts of common
# images: DGX /raid, AWS DLAMI /opt/dlami/nvme, Azure /mnt/resource, Databricks /local_disk0) and
# of shared file systems (FSx/Lustre/GPFS/NFS/EFS mounts, home directories on a cluster).
_LOCAL_PREFIXES = (
    "/tmp",
    "/var/tmp",
    "/dev/shm",
    "/local",
    "/localscratch",
    "/local_scratch",
    "/lscratch",
    "/scratch/local",
    "/mnt/local",
    "/mnt/localssd",
    "/mnt/nvme",
    "/nvme",
    "/raid",
    "/opt/dlami/nvme",
    "/mnt/resource",
    "/local_disk0",
    "/ssd",
    "/mnt/ssd",
)
_SHARED_PREFIXES = (
    "/fsx",
    "/lustre",
    "/gpfs",
    "/nfs",
    "/efs",
    "/mnt/nfs",
    "/mnt/lustre",
    "/mnt/fsx",
    "/mnt/efs",
    "/shared",
    "/home",
    "/p/",
    "/project",
    "/projects",
    "/work",
    "/cluster",
)
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


class Locality(str, enum.Enum):
    """Where checkpoint files live, judged from their paths."""

    # a disk of the node that wrote it: lost or unreachable with the node
    NODE_LOCAL = "node_local"
    # a shared file system or object store
    SHARED = "shared"
    # a relative path, or a prefix that says neither
    UNKNOWN = "unknown"


class Implicates(str, enum.Enum):
    """What on a node a suspect's fault points at."""

    # local compute, optimizer update, its share of the collective
    GPU = "gpu"
    # its input bytes differed: host memory, PCIe, data loader
    HOST_DATA_PATH = "host_data_path"
    # a checkpoint file damaged at rest: the node's disk or file system, never the GPU
    DISK = "disk"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeTarget:
    """One node to act on, for one suspect rank.

    Attributes:
        rank: the suspect global rank.
        node: the name the scheduler knows (``node_source``: ``slurm``, ``kubernetes`` or ``host``).
        host, gpu_uuid, pci_bus_id, local_rank, device, slurm_job_id: the manifest's identity.
        location: the suspect's fault location.
        implicates: :class:`Implicates`.
        recurring: two or more independent events on this rank.
        steps: the steps of its events.
        dcgm_level: the ``dcgmi diag -r`` level to run (None: no GPU diagnostic is called for: a
            disk, or a rank that ran on a CPU).
    """

    rank: int
    node: str
    node_source: str
    host: str
    gpu_uuid: str
    pci_bus_id: str
    local_rank: int
    device: str
    slurm_job_id: str
    location: Location
    implicates: Implicates
    recurring: bool
    steps: tuple[int, ...]
    dcgm_level: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lost:
    """What rolling back to the resume point costs.

    Attributes:
        from_step: the resume checkpoint's ``N`` (or the first recorded step when none is clean).
        to_step: the last step recorded (inclusive).
        num_steps: ``to_step + 1 - from_step``, the steps to redo.
        wall_clock_s: seconds from ``θ_from_step`` being reached to the record of ``to_step``
            (None when the records hold no times); restarts in between are included.
        gpu_hours: ``wall_clock_s × world_size / 3600`` (one GPU per rank), None with it.
        world_size: ranks.
        on_gpu: the job's ranks ran on GPUs (a CPU job gets host diagnostics, not DCGM's, and
            its lost time is counted in rank-hours).
        basis: ``resume_checkpoint`` or ``first_step`` (no checkpoint certified clean).
    """

    from_step: int
    to_step: int
    num_steps: int
    wall_clock_s: float | None
    gpu_hours: float | None
    world_size: int
    basis: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Incident:
    """What the report adds to a :class:`BisectResult`.

    Attributes:
        verdict: the result's verdict.
        first_divergent_step: ``s*`` (None when none was found).
        divergent_started_ns, divergent_ended_ns: step ``s*`` ran between these times (UTC epoch
            ns; the record of ``s* - 1`` and that of ``s*``, on the suspect rank's clock when there
            is one rank; None when unknown).
        run_started_ns: the first record's time (or the first attempt's start).
        last_step, last_step_ns: the last recorded step and its record's time.
        resume_step, resume_path: the resume checkpoint (None: none certified clean).
        resume_saved_by: the rank that wrote it, and ``resume_host`` its host.
        resume_job_path: its path as the job wrote it (on ``resume_host``; ``resume_path`` is the
            file the analysis read).
        lost: :class:`Lost`; None for a clean run, an inconclusive one with no divergent step
            (nothing to roll back until it is settled) or an empty trace.
        nodes: the nodes to act on (empty for a clean run, a collective fault or no suspect).
        collective: a suspect is the collective as a whole (no single rank).
        checkpoint_locality: :class:`Locality` of the paths the job wrote.
        checkpoint_paths: those paths.
        resume_on_suspect_node: the resume checkpoint was written by a rank on a node in ``nodes``.
        world_size: ranks.
    """

    verdict: Verdict
    first_divergent_step: int | None
    divergent_started_ns: int | None
    divergent_ended_ns: int | None
    run_started_ns: int | None
    last_step: int | None
    last_step_ns: int | None
    resume_step: int | None
    resume_path: str | None
    resume_saved_by: int | None
    resume_job_path: str | None
    resume_host: str | None
    lost: Lost | None
    nodes: tuple[NodeTarget, ...]
    collective: bool
    checkpoint_locality: Locality
    checkpoint_paths: tuple[str, ...]
    resume_on_suspect_node: bool
    world_size: int
    on_gpu: bool = True


def path_locality(paths) -> Locality:
    """:class:`Locality` of checkpoint paths: node-local if any is, shared if every one is, else unknown.

    A heuristic on path prefixes (``/tmp``, ``/raid``, ``/mnt/nvme``... are node-local; ``/fsx``,
    ``/lustre``, ``/gpfs``, ``/nfs``, URLs... shared); a relative path is unknown (it was
    resolved from the job's working directory).
    """
    kinds = {_one_locality(p) for p in paths if p}
    if not kinds:
        return Locality.UNKNOWN
    if Locality.NODE_LOCAL in kinds:
        return Locality.NODE_LOCAL
    return Locality.SHARED if kinds == {Locality.SHARED} else Locality.UNKNOWN


def _one_locality(path: str) -> Locality:
    if _URL.match(path):
        return Locality.SHARED
    if not path.startswith("/"):
        return Locality.UNKNOWN
    # ("/", "tmp", ...)
    parts = PurePosixPath(path).parts
    for prefixes, kind in ((_LOCAL_PREFIXES, Locality.NODE_LOCAL), (_SHARED_PREFIXES, Locality.SHARED)):
        for prefix in prefixes:
            want = PurePosixPath(prefix.rstrip("/")).parts
            if parts[: len(want)] == want:
                return kind
    return Locality.UNKNOWN


def node_name(manifest: Manifest, rank: int) -> tuple[str, str]:
    """``(name, source)``: the node ``rank`` ran on as the scheduler knows it (Slurm, Kubernetes, host)."""
    ident = manifest.identity(rank)
    if ident.slurm_node:
        return ident.slurm_node, "slurm"
    if ident.k8s_node:
        return ident.k8s_node, "kubernetes"
    return ident.host, "host"


def _implicates(location: Location) -> Implicates:
    if location is Location.STORAGE:
        return Implicates.DISK
    if location is Location.INPUT_DATA:
        return Implicates.HOST_DATA_PATH
    return Implicates.GPU


def on_gpu(ident) -> bool:
    """Whether a rank's identity names a GPU (its device, UUID or PCI bus id)."""
    return str(ident.device or "").startswith("cuda") or bool(ident.gpu_uuid or ident.pci_bus_id)


def job_on_gpu(manifest: Manifest) -> bool:
    """Whether any rank of any attempt ran on a GPU."""
    return any(on_gpu(ident) for attempt in manifest.attempts for ident in attempt.ranks)


def dcgm_level(implicates: Implicates, recurring: bool) -> int | None:
    """The ``dcgmi diag -r`` level for a suspect: 4 (extended) for a recurring GPU fault, 3 (long
    hardware diagnostics, ~15 min) for one event, 2 (includes the PCIe test) for a host data path
    fault, None for a disk (no GPU diagnostic)."""
    if implicates is Implicates.DISK:
        return None
    if implicates is Implicates.HOST_DATA_PATH:
        return 2
    return 4 if recurring else 3


def _targets(result: BisectResult, manifest: Manifest) -> tuple[NodeTarget, ...]:
    out = []
    for suspect in result.suspects:
        # every rank named at once: a shared cause, no node to act on
        if suspect.rank is None or suspect.shared:
            continue
        ident = manifest.identity(suspect.rank)
        name, source = node_name(manifest, suspect.rank)
        implicates = _implicates(suspect.location)
        out.append(
            NodeTarget(
                rank=suspect.rank,
                node=name or (suspect.host or ""),
                node_source=source,
                host=ident.host or (suspect.host or ""),
                gpu_uuid=ident.gpu_uuid,
                pci_bus_id=ident.pci_bus_id,
                local_rank=ident.local_rank,
                device=ident.device,
                slurm_job_id=ident.slurm_job_id,
                location=suspect.location,
                implicates=implicates,
                recurring=suspect.recurring,
                steps=tuple(suspect.steps),
                dcgm_level=dcgm_level(implicates, suspect.recurring) if on_gpu(ident) else None,
            )
        )
    return tuple(out)


def step_times(trace: Trace, steps) -> dict[int, np.ndarray]:
    """``{step: (R,) int64}``: each rank's STEP record time for the wanted steps (0 where absent)."""
    out: dict[int, np.ndarray] = {}
    for step in sorted({int(s) for s in steps if s is not None and s >= 0}):
        for window in trace.step_windows(window=1, start=step, stop=step, fields=("time_ns",)):
            if len(window.steps) and int(window.steps[0]) == step:
                out[step] = np.where(window.present[0], window.records["time_ns"][0], 0).astype(np.int64)
    return out


def _latest(times: np.ndarray | None, rank: int | None = None) -> int | None:
    return _pick(times, rank, np.max)


def _earliest(times: np.ndarray | None, rank: int | None = None) -> int | None:
    return _pick(times, rank, np.min)


def _pick(times: np.ndarray | None, rank: int | None, reduce) -> int | None:
    """``rank``'s record time when it has one, else ``reduce`` over every rank's; None without any."""
    if times is None:
        return None
    if rank is not None and 0 <= rank < len(times) and times[rank] > 0:
        return int(times[rank])
    valid = times[times > 0]
    return int(reduce(valid)) if valid.size else None


def build_incident(result: BisectResult, trace: Trace) -> Incident:
    """The times, costs, nodes and checkpoint placement around ``result`` (see the module doc)."""
    from sdc_forensics.errors import TraceError

    manifest = trace.manifest
    bounds = trace.step_range()
    first_step, last_step = (None, None) if bounds is None else bounds
    s_star = result.first_divergent_step
    last = result.last_clean_checkpoint
    nodes = _targets(result, manifest)
    single = nodes[0].rank if len(nodes) == 1 else None
    wanted = [first_step, last_step]
    if s_star is not None:
        wanted += [s_star - 1, s_star]
    if last is not None:
        wanted += [last.step - 1, last.step]
    times = step_times(trace, wanted)
    started = _earliest(times.get(s_star - 1), single) if s_star is not None else None
    ended = _latest(times.get(s_star), single) if s_star is not None else None
    attempt_starts = [a.started_ns for a in manifest.attempts if a.started_ns > 0]
    run_started = min(attempt_starts) if attempt_starts else _earliest(times.get(first_step))
    last_ns = _latest(times.get(last_step))

    try:
        notes = trace.checkpoint_notes()
    except TraceError:
        notes = []
    paths = tuple(dict.fromkeys(n.path for n in notes if n.path)) or tuple(c.path for c in result.checkpoints if c.path)
    resume_note = next((n for n in reversed(notes) if last is not None and n.step == last.step), None)
    saved_by = None if resume_note is None else resume_note.saved_by_rank
    resume_host = manifest.identity(saved_by).host if saved_by is not None else None
    suspect_nodes = {n.node for n in nodes} | {n.host for n in nodes}
    resume_node = node_name(manifest, saved_by)[0] if saved_by is not None else None

    lost = None
    rollback = result.verdict is Verdict.CORRUPTION or (result.verdict is Verdict.INCONCLUSIVE and s_star is not None)
    if rollback and last_step is not None and first_step is not None:
        if last is not None:
            from_step, basis = last.step, "resume_checkpoint"
            reached = _latest(times.get(last.step - 1)) if last.step > first_step else None
            if reached is None:
                reached = run_started if last.step <= first_step else _earliest(times.get(last.step))
        else:
            from_step, basis = first_step, "first_step"
            reached = run_started
        num = max(0, last_step + 1 - from_step)
        wall = (last_ns - reached) / 1e9 if last_ns is not None and reached is not None and last_ns >= reached else None
        if num == 0:
            wall = 0.0
        lost = Lost(
            from_step=from_step,
            to_step=last_step,
            num_steps=num,
            wall_clock_s=wall,
            gpu_hours=None if wall is None else wall * manifest.world_size / 3600.0,
            world_size=manifest.world_size,
            basis=basis,
        )

    return Incident(
        verdict=result.verdict,
        first_divergent_step=s_star,
        divergent_started_ns=started,
        divergent_ended_ns=ended,
        run_started_ns=run_started,
        last_step=last_step,
        last_step_ns=last_ns,
        resume_step=None if last is None else last.step,
        resume_path=None if last is None else last.path,
        resume_saved_by=saved_by,
        resume_host=resume_host,
        resume_job_path=None if resume_note is None else resume_note.path,
        lost=lost,
        nodes=nodes,
        collective=any(s.rank is None for s in result.suspects),
        checkpoint_locality=path_locality(paths),
        checkpoint_paths=paths,
        resume_on_suspect_node=bool(nodes) and (resume_node in suspect_nodes or resume_host in suspect_nodes),
        world_size=manifest.world_size,
        on_gpu=job_on_gpu(manifest),
    )
