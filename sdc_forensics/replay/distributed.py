"""Replay across processes launched by ``torchrun`` (or any launcher that sets the
``torch.distributed`` environment): SPMD, one command run by every process (docs/distributed.md).

* :func:`launched` tells whether this process is one of several (``WORLD_SIZE`` > 1 and ``RANK``
  set); when it is not, nothing here changes anything: :func:`local_steps` is then exactly the
  single-process loop over the original ranks.
* :func:`start` joins the process group (gloo on CPU, nccl for a CUDA replay, one GPU per process)
  with a timeout on every collective; :func:`finish` waits (with the same timeout) until process 0
  has written the output, and leaves the group.
* :func:`local_steps`, called from the replay's per-step loop: original rank ``r`` is computed by
  process ``r % P``; each process packs its ranks' results (loss, exact gradient digest, input
  digest and the gradient's bucket buffers, as raw bytes) into one flat ``uint8`` tensor and one
  ``all_gather`` hands every process every rank's results, bit for bit. Every process then reduces
  them in the recorded order, steps the optimizer and compares, exactly as the single-process
  path does, so every process reaches the same evidence and the same decision.
* :func:`check_placement`: before a replay, the processes exchange their host name and GPU UUID;
  a process on a suspect's GPU, or on the node of a suspect's GPU, refuses, and every process
  raises the same :class:`PlacementRefused` (``--force-device`` overrides).
* Whole checkpoint intervals, when many must be examined (``bisect``/``certify`` widening
  backwards, ``--scan-recurrence``): :func:`deal` hands them out (longest first, to the least
  loaded process), each process replays its own intervals alone (:func:`alone`: no exchange per
  step), and one :func:`exchange_objects` gives every process every interval's result. Whether
  that beats sharing the ranks of each step is decided by :func:`intervals_pay` from the costs
  measured on the first, rank-shared interval (:func:`measured_costs`), the same on every process.
* A peer that exits, is killed or stops answering makes the collective fail (gloo: the peer's
  socket closes, or the timeout passes); that is turned into :class:`ReplayProcessLost`, one line
  and exit 4 (nothing was decided).

Layout of one process's packed buffer (``uint8``; ``S = ceil(W / P)`` slots, padded so that every
process sends the same size): slot ``i`` holds original rank ``p + i * P``:
``[loss f64 | digest u64 | input digest u64 | RNG-dependent flag u64][bucket 0 bytes, padded to 16]...``.

Over 400 lines on purpose: one SPMD protocol (who reads, who replays which window, how results,
failures and signals travel back), which has to be read as a whole to see that no process can hang
or exit alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import socket
import sys
import time
from typing import Any

import numpy as np

from sdc_forensics.errors import SdcError, UsageError
from sdc_forensics.exitcodes import ExitCode

#: Test-only hook (docs/distributed.md, "Failures"): ``PROCESS:STEP[:hang]`` makes replay process
#: PROCESS end with ``os._exit(17)`` (or sleep forever with ``:hang``) just before it computes its
#: ranks of replayed step STEP. Read only when several processes replay; never set it in production.
TEST_FAIL_ENV = "SDC_FORENSICS_TEST_FAIL_REPLAY_PROCESS"

DEFAULT_TIMEOUT_S = 300.0
_HEADER_BYTES = 32
_ALIGN = 16
#: A follower waits this long after the last barrier before it exits, so that process 0's exit
#: status is the first one a launcher (torchrun) observes.
_FOLLOWER_EXIT_DELAY_S = 1.0


class ReplayProcessLost(SdcError):
    """A replay process exited, was killed or stopped answering: nothing was decided (exit 4)."""

    exit_code = ExitCode.INCONCLUSIVE


class PlacementRefused(UsageError):
    """A replay process runs on a suspect's GPU or node (every process raises the same one)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayGroup:
    """The processes of one distributed replay.

    Attributes:
        rank: this process's index in ``[0, size)`` (process 0 writes the output).
        size: the number of processes ``P``.
        backend: ``gloo`` or ``nccl``.
        timeout_s: the limit on every collective, in seconds.
    """

    rank: int
    size: int
    backend: str
    timeout_s: float

    @property
    def lead(self) -> bool:
        return self.rank == 0


_group: ReplayGroup | None = None
#: The group while this process replays whole intervals alone (:func:`alone`); only the test hook reads it.
_solo: ReplayGroup | None = None
#: What the rank-shared steps cost this process so far (:func:`measured_costs`).
_COSTS = {"rank_steps": 0, "steps": 0, "compute_s": 0.0, "exchange_s": 0.0}
#: This process's place once it joined a group; kept after :func:`finish` so that the error line
#: printed on the way out (``error_line``) still knows who speaks.
_role: ReplayGroup | None = None
#: Set by :func:`finish` when this process leaves a group in which a peer was lost: the group is
#: not torn down (gloo's threads may still wait on the lost peer, and tearing it down at exit has
#: aborted the interpreter with ``terminate called without an active exception``); :func:`leave`
#: then ends the process at once with its exit status.
_abandoned = False


def launched() -> bool:
    """True when a launcher started this process as one of several (``WORLD_SIZE`` > 1, ``RANK`` set)."""
    size = os.environ.get("WORLD_SIZE", "").strip()
    return size.isdigit() and int(size) > 1 and os.environ.get("RANK", "").strip().isdigit()


def current() -> ReplayGroup | None:
    """The group this process replays in, None on the single-process path."""
    return _group


def is_lead() -> bool:
    """True on process 0 and on the single-process path: the process that writes the output."""
    return _role is None or _role.lead


def process_device(spec: str) -> str:
    """The device one process replays on: a bare ``cuda`` becomes ``cuda:LOCAL_RANK`` (one GPU per
    process) when several processes replay; anything else is kept as given."""
    if not launched() or spec != "cuda":
        return spec
    local = os.environ.get("LOCAL_RANK", "0").strip()
    return f"cuda:{int(local) if local.isdigit() else 0}"


def start(device_spec: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> ReplayGroup | None:
    """Join the launcher's process group (None when this process is not one of several).

    Raises:
        ReplayProcessLost: the rendezvous failed or timed out (a peer never came).
    """
    global _group, _role
    if not launched():
        return None
    import signal

    import torch
    import torch.distributed as dist

    backend = "nccl" if device_spec.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device_spec))
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as exc:
        raise ReplayProcessLost(
            f"the replay processes could not form a group within {timeout_s:g} s ({_short(exc)}); "
            "check MASTER_ADDR/MASTER_PORT and that every process was started"
        ) from None
    _group = _role = ReplayGroup(rank=dist.get_rank(), size=dist.get_world_size(), backend=backend, timeout_s=timeout_s)
    signal.signal(signal.SIGTERM, _stopped_by_launcher)
    return _group


def _stopped_by_launcher(signum, frame) -> None:
    """torchrun stops every worker (SIGTERM) once one fails: say so, as one line and exit 4."""
    raise ReplayProcessLost(
        "the launcher stopped this replay process (SIGTERM), usually because another replay process "
        "failed: nothing was decided; see the launcher's report and the other processes' logs, then rerun"
    )


def finish(completed: bool, peer_lost: bool = False) -> None:
    """Leave the group. ``completed``: this process finished its command (process 0 has written
    its output before it comes here); every process then meets at a barrier, so that no process
    exits (and makes the launcher stop the others) before process 0's output is written.
    ``peer_lost``: the command ended with :class:`ReplayProcessLost`; the group is abandoned, not
    torn down, and :func:`leave` ends the process."""
    global _group, _abandoned
    group, _group = _group, None
    if group is None:
        return
    import signal

    import torch.distributed as dist

    # on the way out (the output written, or an error to report): a stop from the launcher now
    # changes nothing, and must not replace this process's exit status or line
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if peer_lost:
        _abandoned = True
        return
    try:
        if completed:
            dist.barrier()
    # a peer went away after the decision: the output is already written
    except RuntimeError:
        _abandoned = True
        return
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError):
        pass
    if completed and not group.lead:
        time.sleep(_FOLLOWER_EXIT_DELAY_S)


def leave(code: int) -> None:
    """End this process with exit status ``code`` at once (stdout and stderr flushed, no interpreter
    teardown) when it replayed in a group; otherwise return and let it exit as usual.

    A group whose peer was lost is abandoned, not torn down, and its gloo threads may still wait on
    the peer. A group torn down in good order can still hold gloo's C++ threads and their work
    objects, and finalizing the interpreter under them has aborted a clean process (SIGABRT), so
    that torchrun reported the whole replay as failed (exit 1) after process 0 printed a clean
    verdict. Nothing of this command is left to Python's teardown (it registers no exit handler)."""
    if _role is None and not _abandoned:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


#: Seconds a follower that raised a usage error (which every process raises alike) waits for
#: process 0 to say it before saying it itself. torchrun stops every process once one exits, and
#: process 0 may still be starting then (a loaded CI machine saw it stopped while importing the
#: recipe, and the refusal was never printed); when process 0 speaks first, torchrun stops the
#: follower during the wait and the line is said once.
LEAD_GRACE_S = 10.0


def error_line(exc: BaseException) -> str | None:
    """The error line this process prints for ``exc``, None for none. Process 0 speaks for the
    group; a follower is silent about a lost peer, says a usage error or a refused placement (which
    every process raises alike) only if process 0 has not ended the run :data:`LEAD_GRACE_S`
    seconds later, and names itself for an error of its own (a file missing on its node)."""
    role = _role
    if role is None or role.lead:
        return str(exc)
    if isinstance(exc, ReplayProcessLost):
        return None
    who = f"replay process {role.rank} of {role.size} (host {socket.gethostname()})"
    # every process parsed the same command line
    if isinstance(exc, UsageError):
        import signal

        # stopped by the launcher meanwhile: process 0 said it; end quietly with this error's status
        before = signal.signal(signal.SIGTERM, lambda *_: os._exit(int(exc.exit_code)))
        try:
            time.sleep(LEAD_GRACE_S)
        finally:
            signal.signal(signal.SIGTERM, before)
        return f"{who}, process 0 silent: {exc}"
    return f"{who}: {exc}"


# -- suspects kept out --------------------------------------------------------------------------
def placement_refusals(places: list[tuple[str, str]], suspects: dict[str, tuple[int, str]]) -> list[str]:
    """Why each refusing process refuses. ``places[p]``: process ``p``'s ``(host, gpu_uuid)``;
    ``suspects``: ``{gpu_uuid: (rank, host)}`` of the suspects' recorded GPUs. A process on a
    suspect's GPU, or on the node that holds it, refuses."""
    hosts = {host: (rank, uuid) for uuid, (rank, host) in suspects.items() if host}
    out = []
    for p, (host, uuid) in enumerate(places):
        if uuid and uuid in suspects:
            out.append(f"replay process {p} runs on {uuid} (host {host}), the GPU of suspect rank {suspects[uuid][0]}")
        elif host in hosts:
            rank, gpu = hosts[host]
            out.append(f"replay process {p} runs on host {host}, the node of suspect rank {rank} (GPU {gpu})")
    return out


def check_placement(device, trace, suspect_gpus: dict[str, int], force: bool) -> None:
    """Refuse, on every process alike, a distributed replay with a process on a suspect's GPU or node.

    Args:
        device: this process's replay device (a ``torch.device``).
        trace: the open trace (the suspects' host names come from its manifest).
        suspect_gpus: ``{gpu_uuid: rank}`` the replay must not run on.
        force: ``--force-device``: replay there anyway.

    Raises:
        PlacementRefused: on every process, naming the first refusing process (exit 2).
    """
    group = _group
    if group is None or force or not suspect_gpus:
        return
    from sdc_forensics.replay.env import gpu_uuid

    places = _all_gather_object((socket.gethostname(), gpu_uuid(device)))
    suspects = {uuid: (rank, trace.manifest.identity(rank).host) for uuid, rank in suspect_gpus.items()}
    refusals = placement_refusals(places, suspects)
    if refusals:
        more = f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""
        raise PlacementRefused(
            f"{refusals[0]}{more}: its results cannot be trusted to judge the suspect; launch the replay "
            "on other nodes (srun --exclude, a node selector), or pass --force-device to replay there anyway"
        )


# -- the ranks of one step, shared out ------------------------------------------------------------
@dataclasses.dataclass
class SharedRankStep:
    """An original rank's step computed by another process: what the comparisons read
    (``buckets``, ``loss``, ``digest``, ``input_digest``, ``fp`` on demand)."""

    replayer: Any
    buckets: list
    loss: float
    digest: int
    input_digest: int
    rng_dependent: bool = False
    _fp: Any = None
    # how the replayer fingerprints this rank's buckets (None: ``replayer.fp_of``, the whole buckets);
    # a TP replay's rank recorded only its slice (``tp.TpReplayer.received``)
    fp_of: Any = None

    @property
    def fp(self):
        if self._fp is None:
            self._fp = (self.fp_of or self.replayer.fp_of)(self.buckets)
        return self._fp


def check_collective(world_size: int) -> None:
    """Refuse ``--collective`` unless this process is one of exactly ``world_size`` replay processes
    replaying the ranks together (one process per recorded rank, not intervals dealt out).

    Raises:
        UsageError: one line saying what to launch.
    """
    group = _group
    if group is None or group.size != world_size:
        have = "one process" if group is None else f"{group.size} processes"
        raise UsageError(
            f"--collective all-reduces with the replay's own process group: launch {world_size} processes, "
            f"one per recorded rank (torchrun --nproc-per-node {world_size} -m sdc_forensics ...), not {have}"
        )


def collective_mean(per_rank: list, world_size: int, compress=None) -> list:
    """The ranks' average by the replay group's own all-reduce, as the job made it: process ``p``
    contributes original rank ``p``'s buckets, each multiplied by ``1 / W`` and summed with
    ``all_reduce(SUM)`` (DDP's built-in path), one collective per bucket in bucket order, so
    the collective sees the job's bucket sizes. Every process returns the same bits. ``compress``:
    the dtype the job's hook compressed to (``env.compression_of``): cast, divide by ``W`` and
    all-reduce in it, then cast back, as that hook does.

    Raises:
        ReplayProcessLost: a peer exited or did not answer within the timeout.
    """
    import torch.distributed as dist

    group = _group
    out = []
    for bucket in per_rank[group.rank]:
        if compress is not None:
            buffer = bucket.to(compress).div_(world_size)
        else:
            buffer = bucket.clone()
            buffer.mul_(1.0 / world_size)
        _collective(lambda b=buffer: dist.all_reduce(b), group)
        out.append(buffer.to(bucket.dtype) if compress is not None else buffer)
    return out


def pin_recorded_nccl(trace_dir) -> list[str]:
    """Set the NCCL variables the trace's last attempt recorded (``numerics`` ``nccl_env``) that
    this process's environment leaves unset, before the process group starts: the replay's own
    collective then runs with the job's algorithm choices. Returns ``NAME=VALUE`` of each one set.
    A variable the user set is kept (and the self-check says so if it changes the sum)."""
    from sdc_forensics.trace.manifest import read_manifest

    try:
        attempts = read_manifest(trace_dir).attempts
    except SdcError:
        # the command itself reports the unreadable trace
        return []
    recorded = dict(max(attempts, key=lambda a: a.attempt).determinism.get("nccl_env") or {}) if attempts else {}
    pinned = []
    for name, value in sorted(recorded.items()):
        if isinstance(name, str) and name.startswith("NCCL_") and isinstance(value, str) and name not in os.environ:
            os.environ[name] = value
            pinned.append(f"{name}={value}")
    return pinned


def owner(original_rank: int, num_processes: int) -> int:
    """The process that computes ``original_rank``'s local steps."""
    return original_rank % num_processes


def local_steps(replayer, model, recs, layout, step: int) -> list:
    """Every original rank's recomputed step ``step``, in rank order.

    Single process: ``replayer.local_step`` for each rank in turn. Several: each process
    computes its own ranks (``r % P``) and one ``all_gather`` shares the results bit for bit.

    Raises:
        ReplayProcessLost: a peer exited or did not answer within the timeout.
    """
    world_size = replayer.world_size
    group = _group
    if group is None:
        if _solo is not None:
            _test_failure(_solo, step)
        return [replayer.local_step(model, recs[r], layout, slot=r) for r in range(world_size)]
    _test_failure(group, step)
    started = time.perf_counter()
    mine = {r: replayer.local_step(model, recs[r], layout, slot=r) for r in range(group.rank, world_size, group.size)}
    computed = time.perf_counter()
    specs = _bucket_specs(mine, layout, group, world_size)
    stride = _HEADER_BYTES + sum(_padded(nbytes) for _, _, nbytes in specs)
    slots = -(-world_size // group.size)
    gathered = _exchange(replayer.device, mine, group, slots, stride)
    _COSTS["rank_steps"] += len(mine)
    _COSTS["steps"] += 1
    _COSTS["compute_s"] += computed - started
    _COSTS["exchange_s"] += time.perf_counter() - computed
    received = getattr(replayer, "received", None)
    return [
        mine[r]
        if r in mine
        else (received or (lambda _, shared: shared))(
            r, _unpack(replayer, gathered[owner(r, group.size)][(r // group.size) * stride :][:stride], specs)
        )
        for r in range(world_size)
    ]


#: ``layout -> bucket specs`` for a process that owns no rank (more processes than the trace's ranks).
_SPECS: dict = {}


def _bucket_specs(mine: dict, layout, group: ReplayGroup, world_size: int) -> list:
    """``[(dtype, numel, nbytes)]`` of one rank's gradient buckets. With more processes than
    original ranks, a process that owns none learns them from process 0 (one broadcast per bucket
    layout, on every process alike, so the collectives stay in step)."""
    import torch.distributed as dist

    own = _specs_of(next(iter(mine.values()))) if mine else None
    # every process owns a rank
    if group.size <= world_size:
        return own
    key = tuple(tuple(int(i) for i in bucket) for bucket in layout)
    if key not in _SPECS:
        box = [own]
        _collective(lambda: dist.broadcast_object_list(box, src=0), group)
        _SPECS.clear()
        _SPECS[key] = box[0]
    return _SPECS[key]


def share_from_rank(tensors, original_rank: int) -> None:
    """Give ``tensors`` (in place, on every process) the values of the process that computed
    ``original_rank``'s local step; nothing to do on the single-process path. DDP's buffer broadcast
    from rank 0 (``replay.buffers``) travels this way.

    Raises:
        ReplayProcessLost: a peer exited or did not answer within the timeout.
    """
    group = _group
    if group is None:
        return
    import torch.distributed as dist

    src = owner(original_rank, group.size)
    for tensor in tensors:
        _collective(lambda t=tensor: dist.broadcast(t, src=src), group)


def recompute(replayer, model, record, layout, original_rank: int, template):
    """The second, independent recomputation of ``original_rank``'s step (majority of three where
    record and replay disagree). Several processes: computed by the process after the rank's
    owner, another device than the first replay's, and broadcast bit for bit to every process.

    Args:
        template: the rank's first recomputation (its bucket dtypes and sizes).

    Raises:
        ReplayProcessLost: a peer exited or did not answer within the timeout.
    """
    group = _group
    if group is None:
        return replayer.local_step(model, record, layout)
    import torch
    import torch.distributed as dist

    by = (owner(original_rank, group.size) + 1) % group.size
    specs = _specs_of(template)
    buffer = torch.zeros(
        _HEADER_BYTES + sum(_padded(nbytes) for _, _, nbytes in specs), dtype=torch.uint8, device=replayer.device
    )
    second = None
    if group.rank == by:
        second = replayer.local_step(model, record, layout)
        _pack(buffer, 0, second)
    _collective(lambda: dist.broadcast(buffer, src=by), group)
    return second if second is not None else _unpack(replayer, buffer, specs)


def _specs_of(rank_step) -> list:
    """``[(dtype, numel, nbytes)]`` of a rank step's gradient buckets: what :func:`_unpack` needs."""
    return [(t.dtype, t.numel(), t.numel() * t.element_size()) for t in rank_step.buckets]


def _unpack(replayer, row, specs) -> SharedRankStep:
    header = row[:_HEADER_BYTES].cpu().numpy().view(np.uint64)
    buckets, offset = [], _HEADER_BYTES
    for dtype, numel, nbytes in specs:
        buckets.append(row[offset : offset + nbytes].view(dtype)[:numel])
        offset += _padded(nbytes)
    return SharedRankStep(
        replayer=replayer,
        buckets=buckets,
        loss=float(header[:1].view(np.float64)[0]),
        digest=int(header[1]),
        input_digest=int(header[2]),
        rng_dependent=bool(header[3]),
    )


def _pack(buffer, base: int, rs) -> None:
    import torch

    header = np.zeros(_HEADER_BYTES // 8, dtype=np.uint64)
    header[:1] = np.array([rs.loss], dtype=np.float64).view(np.uint64)
    header[1], header[2] = np.uint64(rs.digest), np.uint64(rs.input_digest)
    # a step object may predate the flag
    header[3] = np.uint64(1 if getattr(rs, "rng_dependent", False) else 0)
    buffer[base : base + _HEADER_BYTES].copy_(torch.from_numpy(header.view(np.uint8)))
    offset = base + _HEADER_BYTES
    for bucket in rs.buckets:
        raw = bucket.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + raw.numel()].copy_(raw)
        offset += _padded(raw.numel())


def _exchange(device, mine: dict, group: ReplayGroup, slots: int, stride: int) -> list:
    import torch.distributed as dist

    send, received = _buffers(device, slots * stride, group.size)
    for i, r in enumerate(sorted(mine)):
        _pack(send, i * stride, mine[r])
    _collective(lambda: dist.all_gather(received, send), group)
    return received


#: ``(device, bytes) -> (send, [received per process])``, reused from step to step (fresh buffers
#: of tens of MB per step cost page faults on every touch): what a step received is valid until
#: the next step's exchange, as the replayer's own gradient buffers are.
_BUFFERS: dict = {}


def _buffers(device, nbytes: int, num_processes: int):
    import torch

    key = (str(device), nbytes, num_processes)
    if key not in _BUFFERS:
        _BUFFERS.clear()
        send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        _BUFFERS[key] = (send, [torch.empty_like(send) for _ in range(num_processes)])
    return _BUFFERS[key]


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


# -- whole checkpoint intervals, shared out -------------------------------------------------------
@contextlib.contextmanager
def alone():
    """Replay in this process only, as the single-process path does (no exchange per step, no
    placement exchange): for the intervals :func:`deal` gave this process."""
    global _group, _solo
    saved = _group
    _group, _solo = None, saved
    try:
        yield
    finally:
        _group, _solo = saved, None


def deal(costs: list[float], num_processes: int) -> list[list[int]]:
    """Intervals (by index) per process: the costliest first, each to the least loaded process
    (the lowest-numbered on a tie), so that every process computes the same dealing."""
    loads = [0.0] * num_processes
    out: list[list[int]] = [[] for _ in range(num_processes)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        p = min(range(num_processes), key=lambda q: (loads[q], q))
        out[p].append(index)
        loads[p] += costs[index]
    return [sorted(indices) for indices in out]


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds per replayed step: ``rank`` one original rank's local step, ``exchange`` the all_gather,
    ``rest`` the average, optimizer step, comparisons (and the interval's start, spread over its steps)."""

    rank: float
    exchange: float
    rest: float


def measured_costs(window_s: float, window_steps: int) -> StepCosts | None:
    """This process's costs, from the rank-shared steps so far and one window's wall time."""
    c = _COSTS
    if not c["steps"] or not c["rank_steps"] or window_steps < 1:
        return None
    rank = c["compute_s"] / c["rank_steps"]
    exchange = c["exchange_s"] / c["steps"]
    rest = max(0.0, window_s / window_steps - (c["compute_s"] + c["exchange_s"]) / c["steps"])
    return StepCosts(rank=rank, exchange=exchange, rest=rest)


def intervals_pay(lengths: list[int], world_size: int, num_processes: int, costs: StepCosts) -> bool:
    """True when replaying whole intervals, one process each, ends sooner than sharing the ranks
    of every step: ``max load x (W r + o)`` against ``total x (ceil(W/P) r + x + o)``."""
    if len(lengths) < 2 or num_processes < 2:
        return False
    loads = [sum(lengths[i] for i in indices) for indices in deal([float(n) for n in lengths], num_processes)]
    by_interval = max(loads) * (world_size * costs.rank + costs.rest)
    by_rank = sum(lengths) * (-(-world_size // num_processes) * costs.rank + costs.exchange + costs.rest)
    return by_interval < by_rank


@dataclasses.dataclass(frozen=True)
class PatientGroup:
    """A gloo group whose collectives wait ``timeout_s``: ``--replay-timeout`` plus the work the
    processes do alone before they meet (:func:`patient_group`)."""

    handle: Any
    timeout_s: float


def patient_group(extra_s: float) -> PatientGroup:
    """A group for the exchange after work done alone: a process that finishes its intervals first
    waits for the others' remaining work (up to ``extra_s`` more than ``--replay-timeout``) rather
    than calling them lost. Formed now, while every process is here.

    Raises:
        ReplayProcessLost: a peer did not join within the timeout.
    """
    import torch.distributed as dist

    group = _group
    timeout_s = group.timeout_s + max(0.0, extra_s)
    handle: list = []
    _collective(
        lambda: handle.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))), group
    )
    return PatientGroup(handle=handle[0], timeout_s=timeout_s)


def exchange_objects(value, patient: PatientGroup | None = None) -> list:
    """Every process's ``value`` (picklable; between the replay's own processes), in process order,
    over ``patient`` when given (work done alone comes before it), else the replay's group.

    Raises:
        ReplayProcessLost: a peer exited or did not answer within the timeout.
    """
    return _all_gather_object(value, patient)


def _all_gather_object(value, patient: PatientGroup | None = None) -> list:
    import torch.distributed as dist

    group = _group
    out: list = [None] * group.size
    if patient is None:
        _collective(lambda: dist.all_gather_object(out, value), group)
    else:
        _collective(lambda: dist.all_gather_object(out, value, group=patient.handle), group, patient.timeout_s)
    return out


def _collective(call, group: ReplayGroup, timeout_s: float | None = None) -> None:
    try:
        call()
    except (RuntimeError, OSError, ValueError) as exc:
        within = (
            f"{group.timeout_s:g} s (--replay-timeout)"
            if timeout_s is None
            else f"{timeout_s:.0f} s (--replay-timeout plus the estimated time of the intervals the processes replay alone)"
        )
        raise ReplayProcessLost(
            f"a replay process exited, was killed or did not answer within {within} "
            f"during the replay across {group.size} processes ({_short(exc)}): nothing was decided; see the other "
            "processes' logs and the launcher's report, then rerun"
        ) from None


def _short(exc: BaseException) -> str:
    # gloo's source locations
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\] ?", "", " ".join(str(exc).split()))
    return text[:160] + ("..." if len(text) > 160 else "")


def _test_failure(group: ReplayGroup, step: int) -> None:
    spec = os.environ.get(TEST_FAIL_ENV, "")
    if not spec:
        return
    parts = spec.split(":")
    if (
        len(parts) >= 2
        and parts[0].isdigit()
        and parts[1].isdigit()
        and int(parts[0]) == group.rank
        and int(parts[1]) == step
    ):
        if len(parts) > 2 and parts[2] == "hang":
            while True:
                time.sleep(60)
        os._exit(17)
