"""Every synthetic run the tests build, in one module; ``tests/conftest.py`` exposes them as fixtures.

* :func:`write_trace` (fixture ``make_trace``): a synthetic trace with planted :class:`Fault` s,
  either written record by record (every fault kind, audits, sparse weight checks, a recipe) or in
  bulk with the package's own ``sdc_forensics.trace.synthetic`` (fast, and adds attempts to an
  existing trace).
* :func:`write_run` (fixture ``make_run``): the demo recipe trained in one process, with a trace of
  STEP records, checkpoint notes and ``torch.save`` checkpoints; one replica may diverge.
* :func:`simulate` (fixture ``sim``): the single-process twin of a recorded DDP run, for replay and
  bisect; its all-reduce is :func:`gloo_ring_sum`, an independent reference of gloo's ring
  summation order that ``tests/test_factories.py`` checks bit for bit against a real gloo
  ``all_reduce`` (never the package's ``replay.env.reduce_buckets``, which replay tests judge).
* :class:`DemoRuns` (fixture ``demo_run``): real multi-process gloo demo runs, made once per
  arguments per session.
* Files: :func:`tree_sha256`, :func:`write_safetensors_raw`, :func:`flip_byte`,
  :func:`zip_member_offset`.

Over 400 lines on purpose: every builder the suite shares, in one module that the fixtures wrap
(tests/conftest.py); one file is where a test's author looks for them.
"""

from __future__ import annotations

import contextlib

import copy
import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, hex64, write_checkpoint_note
from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, Manifest, RankIdentity, write_manifest
from sdc_forensics.trace.synthetic import PlantedFault, write_synthetic_trace
from sdc_forensics.trace.writer import RankTraceWriter
from sdc_forensics.demo import forked

# torch is imported inside the builders that need it: traces stay numpy-only.


# ---------------------------------------------------------------------------------------------
# Files


def tree_sha256(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path`` itself), to prove inputs unchanged."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def write_safetensors_raw(path: Path, header: dict, data: bytes, *, header_len: int | None = None) -> Path:
    """A safetensors file from a header dict and data bytes; ``header_len`` overrides the prefix."""
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)
    return path


def flip_byte(path: Path, offset: int, mask: int = 0x01) -> None:
    """XOR one byte of ``path`` in place (tests corrupt their own copies only)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        value = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([value ^ mask]))


def zip_member_offset(path: Path, suffix: str) -> tuple[int, int]:
    """``(data offset, size)`` of the stored zip member whose name ends with ``suffix``."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        member = next(m for m in archive.infolist() if m.filename.endswith(suffix))
    raw = path.read_bytes()
    name_len, extra_len = struct.unpack("<HH", raw[member.header_offset + 26 : member.header_offset + 30])
    return member.header_offset + 30 + name_len + extra_len, member.compress_size


# ---------------------------------------------------------------------------------------------
# Synthetic traces


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fault:
    """A fault planted in a synthetic trace at ``step`` on ``rank``.

    Record-by-record traces know every kind the recorder can see: ``nonfinite``, ``allreduce`` (one
    rank's reduced result), ``allreduce-all``, ``weights`` (one replica's weights from ``step``
    on), ``audit-subject``, ``audit-auditor``, ``input`` (an auditor fetched different input
    bytes), ``outlier`` (a huge local gradient norm). Bulk traces know ``nonfinite``,
    ``allreduce-all`` and ``weights`` (``sdc_forensics.trace.synthetic``'s kinds).
    """

    kind: str
    step: int
    rank: int = 0


#: Fault kinds here that ``sdc_forensics.trace.synthetic`` plants in bulk (the same names).
_BULK_KINDS = {"nonfinite": "nonfinite", "allreduce-all": "allreduce-all", "weights": "weights"}


def write_trace(
    path: Path,
    *,
    ranks: int = 4,
    steps: int = 20,
    fault: Fault | tuple[Fault, ...] | None = None,
    bulk: bool = False,
    attempt: int = 0,
    start_step: int = 0,
    seed: int = 0,
    audit_every: int | None = None,
    weights_every: int = 1,
    recipe: str | None = None,
) -> Path:
    """Write a synthetic trace to ``path`` and return it.

    Its records are consistent the way a healthy DDP run's are (local sketches average to the
    reduced sketch, equal reduced and weights digests on every rank), with ``fault`` (one or a
    tuple, at most one per step) planted.

    Args:
        bulk: False (default): written record by record with ``RankTraceWriter``; hosts
            ``node{r // 2}``, GPUs ``GPU-{r:04d}``; every fault kind, ``audit_every``,
            ``weights_every`` and ``recipe``; attempt 0 from step 0 only. True: written in bulk by
            ``sdc_forensics.trace.synthetic.write_synthetic_trace`` (hosts ``node{r // 8:03d}``);
            ``attempt`` and ``start_step`` add an attempt to the trace already at ``path``.
        seed: the random sketches' seed.
    """
    faults = fault if isinstance(fault, tuple) else (fault,) if fault is not None else ()
    if bulk:
        if audit_every or weights_every != 1 or recipe is not None:
            raise ValueError("bulk traces have no audits, sparse weight checks or recipe: use bulk=False")
        unknown = [f.kind for f in faults if f.kind not in _BULK_KINDS]
        if unknown:
            raise ValueError(f"bulk traces cannot plant {unknown}; they know {sorted(_BULK_KINDS)}")
        planted = tuple(PlantedFault(kind=_BULK_KINDS[f.kind], step=f.step, rank=f.rank) for f in faults)
        return write_synthetic_trace(
            path, num_ranks=ranks, num_steps=steps, faults=planted, attempt=attempt, start_step=start_step, seed=seed
        )
    if attempt or start_step:
        raise ValueError("only bulk traces add attempts: pass bulk=True")
    return _write_records(
        Path(path),
        ranks=ranks,
        steps=steps,
        faults=faults,
        audit_every=audit_every,
        weights_every=weights_every,
        recipe=recipe,
        seed=seed,
    )


def _digest(*parts: int) -> int:
    value = np.uint64(0)
    for part in parts:
        value = C.splitmix64(np.array([value ^ np.uint64(part % (1 << 64))], dtype=np.uint64))[0]
    return int(value)


def _write_records(
    path: Path,
    *,
    ranks: int,
    steps: int,
    faults: tuple[Fault, ...],
    audit_every: int | None,
    weights_every: int,
    recipe: str | None,
    seed: int,
) -> Path:
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    k = C.DEFAULT_SKETCH_K
    idents = tuple(
        RankIdentity(rank=r, host=f"node{r // 2}", node_rank=r // 2, gpu_uuid=f"GPU-{r:04d}") for r in range(ranks)
    )
    write_manifest(
        path,
        Manifest(
            format_version=F.FORMAT_VERSION,
            world_size=ranks,
            fingerprint=FingerprintSettings(seed=C.DEFAULT_SEED, sketch_k=k),
            recipe=recipe,
            audit_every=audit_every,
            weights_every=weights_every,
            node_of_rank=tuple(r // 2 for r in range(ranks)),
            attempts=(Attempt(attempt=0, start_step=0, ranks=idents),),
        ),
    )
    writers = [
        RankTraceWriter(path, rank=r, attempt=0, world_size=ranks, sketch_k=k, seed=C.DEFAULT_SEED)
        for r in range(ranks)
    ]
    diverged = np.zeros(ranks, dtype=bool)
    for step in range(steps):
        fault = next((f for f in faults if f.step == step), None)
        local = rng.standard_normal((ranks, k)).astype(np.float32)  # (R, k)
        norms = (1.0 + 0.01 * rng.standard_normal(ranks)).astype(np.float32)
        reduced = np.repeat(local.astype(np.float64).mean(axis=0, keepdims=True), ranks, axis=0).astype(np.float32)
        reduced_digest = np.full(ranks, _digest(step, 1), dtype=np.uint64)
        weights = np.full(ranks, _digest(step, 2), dtype=np.uint64)
        nonfinite = np.zeros(ranks, dtype=np.uint32)
        hit = fault is not None
        if hit and fault.kind == "nonfinite":
            nonfinite[fault.rank] = 3
        if hit and fault.kind == "allreduce":
            reduced[fault.rank, 0] += 50.0
            reduced_digest[fault.rank] ^= np.uint64(1)
        if hit and fault.kind == "allreduce-all":
            reduced[:, 0] += 50.0
        if hit and fault.kind == "weights":
            diverged[fault.rank] = True
        if hit and fault.kind == "outlier":
            norms[fault.rank] = 1e4
        weights[diverged] ^= np.uint64(0xF00)
        for r, writer in enumerate(writers):
            rec = writer.new(F.Kind.STEP, step)
            flags = F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_GRADS
            if step % weights_every == 0:
                flags |= F.Flag.HAS_WEIGHTS | F.Flag.WEIGHTS_CHECKED
            rec["flags"] = int(flags)
            rec["loss"] = 2.0 - 0.01 * step + 0.001 * r
            rec["input_digest"] = _digest(step, r, 3)
            rec["microbatch_first"] = (step * ranks + r) * 2
            rec["microbatch_count"] = 2
            rec["local_digest"] = _digest(step, r, 4)
            rec["reduced_digest"] = reduced_digest[r]
            rec["weights_digest"] = weights[r] if step % weights_every == 0 else 0
            rec["local_norm"] = norms[r]
            rec["reduced_norm"] = 0.5
            rec["nonfinite_local"] = nonfinite[r]
            rec["nonfinite_reduced"] = 3 if nonfinite.any() else 0
            rec["local_sketch"] = local[r]
            rec["reduced_sketch"] = reduced[r]
            writer.append(rec)
        if audit_every and step % audit_every == 0:
            _write_audit(writers, step, ranks, fault)
    for writer in writers:
        writer.close()
    return path


def _write_audit(writers, step: int, ranks: int, fault: Fault | None) -> None:
    subject = step % ranks
    auditor = (subject + 2) % ranks
    own = _digest(step, subject, 4)
    votes = [(auditor, own, False)]
    if fault is not None and fault.kind == "audit-subject" and fault.rank == subject:
        own ^= 0x1  # the subject's own result was wrong: both auditors disagree with it
        votes = [(auditor, _digest(step, subject, 4), False), ((subject + 3) % ranks, _digest(step, subject, 4), True)]
    if fault is not None and fault.kind == "audit-auditor":
        votes = [(auditor, own ^ 0x2, False), ((subject + 3) % ranks, own, True)]
    for who, value, tiebreak in votes:
        rec = writers[who].new(F.Kind.AUDIT, step)
        flags = (
            F.Flag.CONTIGUOUS_IDS
            | (F.Flag.AUDIT_TIEBREAK if tiebreak else 0)
            | (F.Flag.AUDIT_MISMATCH if value != own else 0)
        )
        rec["flags"] = int(flags)
        rec["aux_rank"] = subject
        rec["aux_digest"] = own
        rec["local_digest"] = value
        rec["input_digest"] = _digest(step, subject, 3) ^ (7 if fault is not None and fault.kind == "input" else 0)
        rec["microbatch_first"] = (step * ranks + subject) * 2
        rec["microbatch_count"] = 2
        writers[who].append(rec)


# ---------------------------------------------------------------------------------------------
# Checkpoint runs: the demo recipe in one process, every replica the same model (as under DDP)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """A hand-made run: trace directory, checkpoint directory, checkpoint paths by step."""

    trace_dir: Path
    checkpoints_dir: Path
    checkpoints: dict[int, Path]
    first_divergent_step: int | None


def _flip_first_weight(model) -> None:
    import torch

    with torch.no_grad():
        param = next(iter(model.parameters()))
        param.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 30)  # an exponent bit


def write_run(
    root: Path,
    *,
    ranks: int = 3,
    steps: int = 8,
    checkpoint_every: int = 2,
    diverge: tuple[int, int] | None = None,
    save_from: int = 0,
    blessed: bool | None = None,
) -> Run:
    """Train the demo recipe for ``steps`` steps and write trace, notes and checkpoints under ``root``.

    STEP records hold the real weights digest of every replica; with ``diverge=(step, rank)`` that
    replica holds the healthy weights with one exponent bit flipped from ``step``'s update on.
    A checkpoint is saved from replica ``save_from`` and noted every ``checkpoint_every`` steps, as
    the recorder does (``blessed`` overrides the note's blessing). No recipe in the manifest.
    """
    import torch

    from sdc_forensics.demo.recipe import DemoRecipe
    from sdc_forensics.statedict import state_digests, weights_digest

    recipe = DemoRecipe(hidden=32)
    trace_dir, ckpt_dir = root / "trace", root / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    seed = C.DEFAULT_SEED
    idents = tuple(RankIdentity(rank=r, host=f"node{r}") for r in range(ranks))
    trace_dir.mkdir(parents=True)
    write_manifest(
        trace_dir,
        Manifest(
            format_version=F.FORMAT_VERSION,
            world_size=ranks,
            fingerprint=FingerprintSettings(seed=seed, sketch_k=C.DEFAULT_SKETCH_K),
            checkpoint_every=checkpoint_every,
            attempts=(Attempt(attempt=0, start_step=0, ranks=idents),),
        ),
    )
    writers = [
        RankTraceWriter(trace_dir, rank=r, attempt=0, world_size=ranks, sketch_k=C.DEFAULT_SKETCH_K, seed=seed)
        for r in range(ranks)
    ]
    model, optimizer, _ = recipe.build()
    names = tuple(name for name, _ in model.named_parameters())
    checkpoints: dict[int, Path] = {}

    def replica_states():
        healthy = weights_digest(model.named_parameters(), seed)
        digests = [healthy] * ranks
        diverged_model = None
        if diverge is not None and n_done > diverge[0]:
            diverged_model = copy.deepcopy(model)
            _flip_first_weight(diverged_model)
            digests[diverge[1]] = weights_digest(diverged_model.named_parameters(), seed)
        return healthy, digests, diverged_model

    def save(step: int) -> None:
        healthy, digests, diverged_model = replica_states()
        diverged = tuple(r for r in range(ranks) if digests[r] != healthy)
        source = diverged_model if (save_from in diverged and diverged_model is not None) else model
        path = ckpt_dir / f"step-{step:08d}.pt"
        payload = {"model": source.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(payload, path)
        checkpoints[step] = path
        write_checkpoint_note(
            trace_dir,
            CheckpointNote(
                step=step,
                path=str(path),
                weights_digest=hex64(healthy),
                param_names=names,
                tensors=state_digests(payload, seed),
                saved_by_rank=save_from,
                agreeing_ranks=tuple(r for r in range(ranks) if r not in diverged),
                diverged_ranks=diverged,
                blessed=(save_from not in diverged) if blessed is None else blessed,
            ),
        )

    n_done = 0
    save(0)
    for step in range(steps):
        optimizer.zero_grad()
        for mb in recipe.microbatch_ids(step, 0, ranks):
            recipe.loss(model, recipe.fetch_microbatch(mb)).backward()
        optimizer.step()
        n_done = step + 1
        healthy, digests, _ = replica_states()
        for r, writer in enumerate(writers):
            rec = writer.new(F.Kind.STEP, step)
            flags = F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_WEIGHTS | F.Flag.WEIGHTS_CHECKED
            if digests[r] != healthy:
                flags |= F.Flag.WEIGHTS_DIVERGED
            rec["flags"] = int(flags)
            rec["weights_digest"] = digests[r]
            rec["microbatch_count"] = recipe.microbatches_per_step
            writer.append(rec)
        if n_done % checkpoint_every == 0:
            save(n_done)
    for writer in writers:
        writer.close()
    return Run(
        trace_dir=trace_dir,
        checkpoints_dir=ckpt_dir,
        checkpoints=checkpoints,
        first_divergent_step=diverge[0] if diverge else None,
    )


# ---------------------------------------------------------------------------------------------
# gloo's ring all-reduce, as a reference independent of the package


#: gloo's largest ring segment (``AllreduceOptionsImpl::kMaxSegmentSize``, 1 MiB).
GLOO_MAX_SEGMENT_BYTES = 1 << 20


def records_by_rank(trace_dir, world: int, volatile=("time_ns", "checksum")) -> dict[int, list[dict]]:
    """Every rank's records but END, each a dict of its fields but ``volatile`` (what a rerun may
    change: when the record was written, and the checksum that covers it): two runs' traces
    compared record for record."""
    from sdc_forensics.trace.reader import Trace

    trace = Trace.open(trace_dir)
    out = {}
    for rank in range(world):
        records = trace.records(rank=rank)
        kept = records[records["kind"] != int(F.Kind.END)]
        names = [n for n in kept.dtype.names if n not in volatile]
        out[rank] = [{n: np.asarray(r[n]).tolist() for n in names} for r in kept]
    return out


def gloo_ring_chunks(numel: int, world_size: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """``[lo, hi)`` element range of each rank's chunk in gloo's ring all-reduce (``gloo::allreduce``).

    gloo cuts the buffer into ``S`` segments of ``ceil(numel / S)`` elements, ``S`` the number
    of 1 MiB segments rounded up to a multiple of ``W`` and at least ``2 W`` (so two segments at
    least per rank, one in flight while the other is reduced); chunk ``c`` is segments
    ``c P .. (c + 1) P - 1``, ``P = S / W``; the last chunks may be short or empty.
    """
    total = numel * itemsize
    max_segment = itemsize * max(1, GLOO_MAX_SEGMENT_BYTES // itemsize)
    segments = max(-(-total // max_segment), 2 * world_size)
    segments = -(-segments // world_size) * world_size
    chunk = segments // world_size * -(-numel // segments)  # P segments of ceil(numel / S) elements
    return [(min(c * chunk, numel), min((c + 1) * chunk, numel)) for c in range(world_size)]


def gloo_ring_sum(buffers: Sequence[np.ndarray]) -> np.ndarray:
    """The float32 ``SUM`` all-reduce of ``buffers`` (one per rank) in gloo's ring order.

    An independent reference of what torch's gloo backend does (not of the package's
    ``replay.env.reduce_buckets``): chunk ``c`` (:func:`gloo_ring_chunks`) is reduce-scattered
    along the ring starting at rank ``c - 1`` and going backwards, each rank adding its own
    value to what it received, ``((x[c-1] + x[c-2]) + ...) + x[c]``, every addition rounded to
    float32; the all-gather then copies every chunk to every rank. ``tests/test_factories.py``
    checks it bit for bit against a real gloo ``all_reduce``.
    """
    parts = [np.asarray(b, dtype=np.float32).reshape(-1) for b in buffers]
    world_size, numel = len(parts), parts[0].size
    if any(p.size != numel for p in parts):
        raise ValueError("every rank's buffer must have the same number of elements")
    out = parts[0].copy()  # W = 1: gloo copies the input
    for c, (lo, hi) in enumerate(gloo_ring_chunks(numel, world_size) if world_size > 1 else []):
        if lo >= hi:
            continue
        acc = parts[(c - 1) % world_size][lo:hi].copy()
        for j in range(2, world_size + 1):
            acc = acc + parts[(c - j) % world_size][lo:hi]  # float32 + float32: one rounding
        out[lo:hi] = acc
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a multi-process test's ``init_process_group``."""
    from sdc_forensics.demo.ports import free_port as below_ephemeral

    return below_ephemeral()


def _gloo_job_worker(rank: int, fn, world: int, port: int, out: str, args: tuple) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result = fn(rank, *args)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def gloo_job(fn, world: int, out: Path, *args) -> list:
    """Runs ``fn(rank, *args)`` on ``world`` spawned processes joined in one gloo process group
    (a free port, 1 CPU thread each); returns what each returned (JSON), by rank. ``fn`` must be
    a module-level function of an importable module (the children import it)."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    forked.start(_gloo_job_worker, (fn, world, free_port(), str(out), args), world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def ddp_mean(buffers: Sequence[np.ndarray]) -> np.ndarray:
    """DDP's average of float32 gradient buckets: every rank's bucket times ``1/W`` (in float32),
    then :func:`gloo_ring_sum`."""
    scale = np.float32(1.0 / len(buffers))
    return gloo_ring_sum([np.asarray(b, dtype=np.float32).reshape(-1) * scale for b in buffers])


# ---------------------------------------------------------------------------------------------
# Simulated DDP runs: the single-process twin of a recorded demo run


RECIPE_REF = "sdc_forensics.demo.recipe:recipe"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimFault:
    """``where``: grad | allreduce | allreduce-all | weights | update | input. ``bit``: 31 sign, 30..23 exponent."""

    where: str
    step: int
    rank: int = 0
    bit: int = 31
    index: int = 5


def flip(tensor, index: int, bit: int) -> None:
    """Flip ``bit`` of element ``index`` of a float32 tensor, in place."""
    import torch

    flat = tensor.detach().view(-1)
    view = flat.view(torch.int32)
    view[index] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


def simulate(
    out_dir: Path,
    *,
    steps: int = 10,
    checkpoint_every: int = 4,
    world_size: int = 4,
    fault: SimFault | tuple[SimFault, ...] | None = None,
) -> Path:
    """Write ``out_dir/trace`` and ``out_dir/checkpoints`` of a simulated DDP run; returns ``out_dir``.

    One replica per rank: each rank's local gradient is computed on its microbatches, averaged
    with :func:`ddp_mean` (gloo's ring order, checked against real gloo), every replica's optimizer
    steps, and the trace the recorder would write is written (STEP records with fingerprints,
    bucket layout, checkpoint notes and ``torch.save`` checkpoints of theta_N), with one bit
    flipped at each ``fault`` (one or a tuple, at most one per step). The multi-process demo
    (``sdc_forensics.demo.run``, fixture ``demo_run``) is the real thing.
    """
    import torch

    from sdc_forensics.demo.recipe import DemoRecipe
    from sdc_forensics.fingerprint.core import combine, combine_digests, digest, fingerprint
    from sdc_forensics.statedict import flatten_state, weights_digest

    recipe = DemoRecipe()
    trace_dir, ckpt_dir = Path(out_dir) / "trace", Path(out_dir) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    k, seed = C.DEFAULT_SKETCH_K, C.DEFAULT_SEED
    idents = tuple(
        RankIdentity(rank=r, host=f"sim{r // 2}", node_rank=r // 2, gpu_uuid=f"GPU-sim-{r}") for r in range(world_size)
    )
    trace_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(
        trace_dir,
        Manifest(
            format_version=F.FORMAT_VERSION,
            world_size=world_size,
            fingerprint=FingerprintSettings(seed=seed, sketch_k=k),
            recipe=RECIPE_REF,
            checkpoint_every=checkpoint_every,
            node_of_rank=tuple(r // 2 for r in range(world_size)),
            attempts=(
                Attempt(attempt=0, start_step=0, ranks=idents, determinism={"num_threads": torch.get_num_threads()}),
            ),
        ),
    )
    model, optimizer, _ = recipe.build("cpu")
    replicas = [(copy.deepcopy(model), None) for _ in range(world_size)]
    replicas = [(m, torch.optim.AdamW(m.parameters(), lr=recipe.lr, weight_decay=0.01)) for m, _ in replicas]
    names = [n for n, _ in model.named_parameters()]
    layout = [list(reversed(range(len(names))))]
    (trace_dir / "buckets.attempt-000.json").write_text(json.dumps({"layouts": [{"from_step": 0, "buckets": layout}]}))
    faults = fault if isinstance(fault, tuple) else (fault,) if fault is not None else ()
    writers = [
        RankTraceWriter(trace_dir, rank=r, attempt=0, world_size=world_size, sketch_k=k, seed=seed)
        for r in range(world_size)
    ]
    for step in range(steps):
        fault = next((f for f in faults if f.step == step), None)  # at most one per step
        hit = fault is not None
        if step % checkpoint_every == 0:
            _sim_checkpoint(recipe, replicas, step, trace_dir, ckpt_dir, names, seed)
        if hit and fault.where == "weights":
            flip(next(replicas[fault.rank][0].parameters()), fault.index, fault.bit)
        local, local_fps, losses, inputs = [], [], [], []
        for r, (m, _) in enumerate(replicas):
            params = list(m.parameters())
            for p in params:
                p.grad = None
            digests, total = [], 0.0
            for mb_id in recipe.microbatch_ids(step, r, world_size):
                batch = recipe.fetch_microbatch(mb_id)
                if hit and fault.where == "input" and r == fault.rank:
                    flip(batch[0], fault.index, fault.bit)
                digests += [digest(t, seed) for t in flatten_state(batch).values()]
                loss = recipe.loss(m, batch)
                loss.backward()
                total += float(loss.detach())
            flat = torch.cat([params[i].grad.reshape(-1) for i in layout[0]])
            if hit and fault.where == "grad" and r == fault.rank:
                flip(flat, fault.index, fault.bit)
            local.append(flat.detach().numpy())
            local_fps.append(combine([fingerprint(flat, k=k, seed=seed)]))
            losses.append(total)
            inputs.append(combine_digests(digests))
        mean = torch.from_numpy(ddp_mean(local))
        reduced = [mean.clone() for _ in range(world_size)]
        if hit and fault.where == "allreduce":
            flip(reduced[fault.rank], fault.index, fault.bit)
        if hit and fault.where == "allreduce-all":
            for red in reduced:
                flip(red, fault.index, fault.bit)
        reduced_fps = [combine([fingerprint(red, k=k, seed=seed)]) for red in reduced]
        weights = []
        for r, (m, opt) in enumerate(replicas):
            params, offset = list(m.parameters()), 0
            for i in layout[0]:
                n = params[i].numel()
                params[i].grad = reduced[r][offset : offset + n].view_as(params[i]).clone()
                offset += n
            opt.step()
            if hit and fault.where == "update" and r == fault.rank:
                flip(params[0].data, fault.index, fault.bit)
            weights.append(weights_digest(m.named_parameters(), seed))
        for r, writer in enumerate(writers):
            rec = writer.new(F.Kind.STEP, step)
            rec["flags"] = int(F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_GRADS | F.Flag.HAS_WEIGHTS | F.Flag.WEIGHTS_CHECKED)
            rec["loss"] = losses[r]
            rec["input_digest"] = inputs[r]
            ids = recipe.microbatch_ids(step, r, world_size)
            rec["microbatch_first"], rec["microbatch_count"] = ids[0], len(ids)
            rec["microbatch_digest"] = combine_digests(ids)
            for prefix, fp in (("local", local_fps[r]), ("reduced", reduced_fps[r])):
                rec[f"{prefix}_digest"] = fp.digest
                rec[f"{prefix}_norm"] = fp.norm
                rec[f"{prefix}_max_abs"] = fp.max_abs
                rec[f"{prefix}_sketch"] = fp.sketch
            rec["nonfinite_local"], rec["nonfinite_reduced"] = local_fps[r].nonfinite, reduced_fps[r].nonfinite
            rec["weights_digest"] = weights[r]
            writer.append(rec)
    if steps % checkpoint_every == 0:
        _sim_checkpoint(recipe, replicas, steps, trace_dir, ckpt_dir, names, seed)
    for writer in writers:
        writer.close()
    return Path(out_dir)


def _sim_checkpoint(recipe, replicas, step, trace_dir, ckpt_dir, names, seed) -> None:
    from sdc_forensics.statedict import weights_digest

    digests = [weights_digest(m.named_parameters(), seed) for m, _ in replicas]
    values, counts = np.unique(np.array(digests, dtype=np.uint64), return_counts=True)
    majority = int(values[np.argmax(counts)])
    saver = digests.index(majority)
    path = ckpt_dir / f"step-{step:08d}.pt"
    model, opt = replicas[saver]
    recipe.save_checkpoint(path, model, opt, None, step)
    write_checkpoint_note(
        trace_dir,
        CheckpointNote(
            step=step,
            path=str(path),
            weights_digest=hex64(majority),
            param_names=tuple(names),
            saved_by_rank=saver,
            agreeing_ranks=tuple(r for r, d in enumerate(digests) if d == majority),
            diverged_ranks=tuple(r for r, d in enumerate(digests) if d != majority),
        ),
    )


# ---------------------------------------------------------------------------------------------
# Real demo runs (gloo DDP on CPU, ~10 s each on 2 cores)


def _frozen(value):
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


class DemoRuns:
    """``runs(injections=(), steps=6, checkpoint_every=3, *, result=False, **run_demo options)``.

    Runs ``sdc_forensics.demo.run.run_demo`` once per distinct arguments (a spec string counts as a
    one-spec tuple) into a fresh directory of ``tmp_path_factory``, and returns the output
    directory (``trace/``, ``checkpoints/``), or with ``result=True`` the run's ``DemoResult``
    (ground truth: fired faults, alarms, ``config``). Tests that change a run's files copy it first.
    """

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._cache: dict[tuple, object] = {}

    def __call__(
        self,
        injections: str | tuple = (),
        steps: int = 6,
        checkpoint_every: int = 3,
        *,
        result: bool = False,
        **options,
    ):
        from sdc_forensics.demo.run import run_demo

        injections = (injections,) if isinstance(injections, str) else tuple(injections)
        key = (injections, steps, checkpoint_every, _frozen(options))
        if key not in self._cache:
            out = self._tmp.mktemp("demo")
            self._cache[key] = run_demo(
                out, injections=injections, steps=steps, checkpoint_every=checkpoint_every, **options
            )
        done = self._cache[key]
        return done if result else done.config.out_dir


@contextlib.contextmanager
def num_threads(count: int):
    """torch's intra-op thread count set to ``count`` for the block, restored after it."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


#: Bounds on refusing one hostile input of the corpora (each is at most a few MB): the refusal
#: must come from checks on declared sizes, never from reading or allocating what they declare.
HOSTILE_TIME_S = 20.0  # generous for a loaded 2-core machine; unbounded cases took minutes
HOSTILE_PEAK_GROWTH = 256 << 20  # bytes by which the process's peak RSS may grow during one case


def assert_refused(args: list[str], path) -> str:
    """The CLI run with ``args`` on a hostile input under ``path``: exit 3, one ``error:`` line on
    stderr, no traceback, nothing on stdout, every file under ``path`` unchanged, within
    :data:`HOSTILE_TIME_S` and without raising the process's peak memory by more than
    :data:`HOSTILE_PEAK_GROWTH` (torch is imported first, so only the case's own cost counts).
    Returns the line."""
    import resource
    import time

    import torch  # noqa: F401  (imported before the peak is read: its import is not the case's cost)
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli

    before = tree_sha256(path)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.monotonic()
    result = CliRunner().invoke(cli, [str(a) for a in args])
    seconds = time.monotonic() - started
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert seconds < HOSTILE_TIME_S, f"refusing took {seconds:.1f} s"
    assert growth < HOSTILE_PEAK_GROWTH, f"peak memory grew by {growth / 2**20:.0f} MiB"
    assert result.exit_code == 3, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    assert tree_sha256(path) == before
    return lines[0]


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (registered in ``sys.modules`` under
    ``name``, which its dataclasses look up), for tests of its planning and scoring rules."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


def grid_mesh(kind: str, names: tuple[str, ...], shape: tuple[int, ...], **dims):
    """A ``ShardMesh`` whose ranks fill ``shape`` row-major (rank 0 at coordinate 0, ..., the last
    dimension fastest), as ``init_device_mesh`` lays them out; ``dims``: ``shard_dim``, ``tp_dim``, ..."""
    import itertools

    from sdc_forensics.trace.mesh import ShardMesh

    coords = tuple(itertools.product(*(range(n) for n in shape)))
    return ShardMesh(kind=kind, shape=shape, dim_names=names, coords=coords, **dims)
