"""The replay's environment: deterministic settings, the device it runs on, bucket layouts, reductions.

* :func:`deterministic`: the settings imposed on a trace that recorded no numerics contract
  (``sdc_forensics.numerics.reproduce`` applies a recorded one).
* :func:`describe_device` names the replay device (with its GPU UUID on CUDA) and
  :func:`check_not_suspect` refuses a device that is the suspect's GPU.
* :func:`bucket_layouts` reads ``buckets.attempt-AAA.json`` (``trace/layouts.py``, docs/trace-format.md).
* :func:`reduce_buckets` averages the ranks' bucket buffers the way a collective does:
  ``gloo-ring`` reproduces gloo's ring all-reduce bit for bit (the buffer is cut into ``W``
  equal segments, rounded up to 16 bytes; segment ``i`` is summed along the ring starting at rank ``i - 1`` and going
  backwards, after each rank divided its buffer by ``W`` as DDP does), ``sequential`` adds the
  ranks in order. The replay picks the one whose digest equals the recorded reduced digest;
  ``ordered`` (the recorder's ordered reduction, ``sdc_forensics/reduction.py``) is used, alone,
  when the trace records it.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable

import torch

from sdc_forensics import numerics
from sdc_forensics.errors import TraceError, UsageError
from sdc_forensics.fingerprint import tolerance
from sdc_forensics.reduction import REPRODUCIBLE_COMPRESSION, ordered_mean, ordered_sum
from sdc_forensics.trace.layouts import BucketLayout, read_bucket_layouts

#: The summation orders the replay tries when the trace does not say which one the collective
#: used (``native``). ``ordered`` is the recorder's ordered reduction (``sdc_forensics/reduction.py``),
#: used whenever the trace records it and only then.
REDUCTION_ORDERS = ("gloo-ring", "sequential")
ORDERED = "ordered"
#: An order with this suffix divides each rank's buffer by ``W`` where the plain one multiplies
#: it by ``1/W``: DDP's own reducer multiplies, torch's ``allreduce_hook`` (and a hook written
#: like it, ``bucket.buffer().div_(W)``) divides, and for a ``W`` that is not a power of two the
#: bits differ. The replay tries both for a job with its own comm hook (:func:`orders_to_try`).
DIVIDED = "-divided"
#: An order with this suffix sums the ranks' buffers as they are and divides the sum by ``W``: a
#: hook that asks for ``SUM`` and divides the result in its future, ``fut.then(lambda f:
#: f.value()[0].div_(W))`` (a pattern of DDP comm hook tutorials). For a ``W`` that is not a power
#: of two its bits differ from both scalings before the sum.
DIVIDED_AFTER = "-summed-then-divided"
#: The same, the sum multiplied by ``1/W`` instead (``f.value()[0].mul_(1 / W)``).
SCALED_AFTER = "-summed-then-scaled"


def _variant(order: str) -> tuple[str, str]:
    """``(base order, scaling)``: scaling ``"scale"`` (each part times ``1/W``), ``"divide"`` (each
    part divided by ``W``), ``"after"`` (the plain sum divided by ``W``) or ``"after-scale"`` (the
    plain sum times ``1/W``)."""
    if order.endswith(DIVIDED_AFTER):
        return order.removesuffix(DIVIDED_AFTER), "after"
    if order.endswith(SCALED_AFTER):
        return order.removesuffix(SCALED_AFTER), "after-scale"
    if order.endswith(DIVIDED):
        return order.removesuffix(DIVIDED), "divide"
    return order, "scale"


#: The replay's own process group's all-reduce (``--collective``): not a model of the job's
#: collective but the collective itself, checked against the recorded digest at every step.
COLLECTIVE = "collective"


def bucket_layouts(trace_dir: str | os.PathLike, attempt: int) -> tuple[BucketLayout, ...]:
    """The bucket layouts the recorder saw in ``attempt`` (empty when the file is absent); read
    and checked as untrusted input by ``trace/layouts.py`` (``TraceError`` when malformed)."""
    return read_bucket_layouts(trace_dir, attempt)


def layout_at(layouts: tuple[BucketLayout, ...], step: int, num_params: int) -> tuple[tuple[int, ...], bool]:
    """The layout in force at ``step``; ``(layout, recorded)``.

    Without a recorded layout, DDP's default for a small model is assumed (one bucket, the
    parameters in reverse order); ``recorded`` is then False and fingerprints cannot match exactly.
    """
    chosen = None
    for layout in layouts:
        if layout.from_step <= step:
            chosen = layout
    if chosen is None and layouts:
        chosen = layouts[0]
    if chosen is None:
        return (tuple(reversed(range(num_params))),), False
    beyond = [i for bucket in chosen.buckets for i in bucket if i >= num_params]
    if beyond:
        raise TraceError(
            f"the recorded bucket layout from step {chosen.from_step} names parameter {beyond[0]}, but the recipe's model "
            f"has {num_params} parameters: the trace's buckets.attempt-*.json does not belong to this model; "
            "pass the recipe the run trained with, or restore the file from the run"
        )
    return chosen.buckets, True


def deterministic(device: torch.device, num_threads: int | None):
    """The settings replays imposed before the numerics contract (deterministic algorithms, the
    cuBLAS workspace, TF32 off, cuDNN deterministic): what a trace that recorded none gets."""
    return numerics.reproduce({}, device, num_threads)


def resolve_device(spec: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N``; raises :class:`UsageError` for a device this machine lacks."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: no CUDA device on this machine; use --device cpu")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise UsageError(f"--device {spec}: replay runs on cpu or cuda")
    return device


def gpu_uuid(device: torch.device) -> str:
    """``GPU-xxxxxxxx-...`` of a CUDA device, "" on CPU or when torch cannot tell."""
    if device.type != "cuda":
        return ""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return ""
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def describe_device(device: torch.device, threads_used: Iterable[int] = ()) -> str:
    """A human name of the replay device: ``cpu (x86_64, 2 threads)`` or ``cuda:0 (NAME, GPU-…)``.

    ``threads_used``: the CPU thread counts the replay's steps ran with (each step its recorded count);
    several are named as such (``1 and 2 threads, as the steps recorded``), none: the current count."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, {gpu_uuid(device) or 'uuid unknown'})"
    counts = sorted(set(threads_used)) or [torch.get_num_threads()]
    if len(counts) > 1:
        shown = ", ".join(map(str, counts[:-1])) + f" and {counts[-1]} threads, as the steps recorded"
        return f"cpu ({platform.machine() or 'unknown'}, {shown})"
    threads = counts[0]
    return f"cpu ({platform.machine() or 'unknown'}, {threads} thread{'' if threads == 1 else 's'})"


def check_not_suspect(device: torch.device, suspect_gpus: dict[str, int], force: bool) -> None:
    """Refuse to replay on a suspect's GPU (``{uuid: rank}``) unless ``force``."""
    uuid = gpu_uuid(device)
    if uuid and uuid in suspect_gpus and not force:
        raise UsageError(
            f"replay device {device} is {uuid}, the GPU of suspect rank {suspect_gpus[uuid]}: its results cannot "
            "be trusted to judge itself; pass another --device, or --force-device to replay there anyway"
        )


#: gloo's ring all-reduce pipelines segments of at most this many bytes
_GLOO_SEGMENT_BYTES = 1 << 20


def _gloo_chunk_elements(numel: int, itemsize: int, world_size: int) -> int:
    """Elements in each rank's chunk of gloo's ring all-reduce (the last chunks may be short).

    gloo cuts the buffer into ``S`` segments of ``ceil(numel / S)`` elements: as many 1 MiB
    segments as it takes, at least two per rank (one in flight while the other is reduced), rounded
    up to a multiple of ``W``; rank chunk ``i`` is ``S / W`` consecutive segments. Checked bit for
    bit against a real gloo all_reduce (``tests/test_factories.py``, ``tests/forensics/test_replay.py``).
    """
    per_segment = max(1, _GLOO_SEGMENT_BYTES // itemsize)
    segments = max(-(-numel // per_segment), 2 * world_size)
    segments = -(-segments // world_size) * world_size
    return segments // world_size * -(-numel // segments)


#: Elements per slice of the CPU reduction: small enough that a slice of every rank's buffer stays
#: in cache between the scaling and the sum (256 KB of float32).
_CPU_SLICE_ELEMENTS = 1 << 16


def _summation_plan(numel: int, itemsize: int, world_size: int, order: str) -> list[tuple[int, int, list[int]]]:
    """``(lo, hi, ranks)`` per segment: elements ``lo..hi-1`` are ``ranks[0] + ranks[1] + ...``, left to right."""
    if order == "sequential" or world_size == 1:
        return [(0, numel, list(range(world_size)))]
    if order != "gloo-ring":
        raise ValueError(f"unknown reduction order {order!r}; one of {REDUCTION_ORDERS}")
    span = _gloo_chunk_elements(numel, itemsize, world_size)
    plan = []
    for i in range(world_size):
        lo, hi = min(i * span, numel), min((i + 1) * span, numel)
        if lo < hi:
            # chunk i is reduce-scattered from rank i-1 backwards
            start = (i - 1) % world_size
            plan.append((lo, hi, [(start - j) % world_size for j in range(world_size)]))
    return plan


#: a sharded job's own reduce-scatter on gloo: its ring all-reduce of each whole input buffer
#: (FSDP2's padded chunks of one parameter group), sliced, then divided (``AVG``)
SHARDED_GLOO = "sharded-gloo-ring"


def ring_sum(src: list[torch.Tensor]) -> torch.Tensor:
    """The sum of equal-shaped flat buffers in gloo's ring order for ``len(src)`` ranks (no
    scaling: gloo's ``AVG`` divides the sum afterwards). Checked bit for bit against gloo's
    ``reduce_scatter_tensor`` (``tests/replay/test_sharded_gloo.py``)."""
    first = src[0]
    acc = torch.empty_like(first)
    for lo, hi, ranks in _summation_plan(first.numel(), first.element_size(), len(src), "gloo-ring"):
        part = acc[lo:hi]
        part.copy_(src[ranks[0]][lo:hi])
        for r in ranks[1:]:
            part += src[r][lo:hi]
    return acc


def is_ordered(order: str | None) -> bool:
    """Whether ``order`` is the ordered reduction (scaled by ``1/W`` or divided by ``W``)."""
    return _variant(order or "")[0] == ORDERED


def orders_to_try(determinism: dict) -> tuple[str, ...]:
    """The reductions that may have made an attempt's reduced gradient, in the order the replay
    tries them: the recorded ordered reduction, or gloo's ring and the sequential sum; each also
    divided (:data:`DIVIDED`) and summed then divided (:data:`DIVIDED_AFTER`) when the job reduced
    through its own comm hook, which may divide where DDP multiplies, before its sum or after it (a
    compressing hook torch ships is reproduced as it is: it divides first)."""
    base = (ORDERED,) if str(determinism.get("reduction") or "") == ORDERED else REDUCTION_ORDERS
    if not determinism.get("comm_hook") or compression_of(determinism) is not None:
        return base
    return base + tuple(order + suffix for suffix in (DIVIDED, DIVIDED_AFTER, SCALED_AFTER) for order in base)


def compression_of(determinism: dict) -> torch.dtype | None:
    """The dtype a recorded comm hook compressed the all-reduce to, when the replay can reproduce
    it (torch's ``fp16_compress_hook``/``bf16_compress_hook``); None otherwise."""
    hook = str(determinism.get("comm_hook") or "")
    return REPRODUCIBLE_COMPRESSION.get(hook.rsplit(".", 1)[-1]) if hook else None


def reduce_buckets(
    per_rank: list[list[torch.Tensor]],
    order: str,
    out: list[torch.Tensor] | None = None,
    compress: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Average bucket buffers over ranks. ``per_rank[r][b]``: rank ``r``'s flat bucket ``b``.

    Each rank's buffer is multiplied by ``1 / W`` (as DDP does before its SUM; divided by ``W``
    for an order ending in :data:`DIVIDED`, as torch's ``allreduce_hook`` does), then the parts
    are added in ``order``. Elementwise, so it is computed slice by slice on CPU (each slice of
    the W buffers read once, while in cache, no scaled copies of whole buffers) with the same
    roundings as whole-buffer operations. ``out``: buffers to write into (same shapes), reused
    across steps; None allocates them. ``compress``: the job's hook compressed to this dtype
    (``compression_of``): each rank's buffer is cast and divided by ``W`` in it, the parts are
    summed in it in ``order`` (segments cut by its element size), and the sum is cast back, as
    ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks._compress_hook`` does.
    """
    world_size = len(per_rank)
    order, scaling = _variant(order)
    divide, after = scaling == "divide", scaling.startswith("after")
    if compress is not None:
        return [
            _compressed_bucket(
                [per_rank[r][b] for r in range(world_size)], order, compress, out[b] if out is not None else None
            )
            for b in range(len(per_rank[0]))
        ]
    if order == ORDERED:
        return [
            _ordered_bucket([per_rank[r][b] for r in range(world_size)], scaling, out[b] if out is not None else None)
            for b in range(len(per_rank[0]))
        ]
    result = []
    for bucket in range(len(per_rank[0])):
        src = [per_rank[r][bucket] for r in range(world_size)]
        first = src[0]
        numel = first.numel()
        acc = out[bucket] if out is not None else torch.empty_like(first)
        plan = _summation_plan(numel, first.element_size(), world_size, order)
        step = _CPU_SLICE_ELEMENTS if first.device.type == "cpu" else max(numel, 1)
        scratch = torch.empty(min(step, numel), dtype=first.dtype, device=first.device)
        for lo, hi, ranks in plan:
            for a in range(lo, hi, step):
                b = min(a + step, hi)
                piece = acc[a:b]
                _scaled(src[ranks[0]][a:b], world_size, divide, piece, after)
                part = scratch[: b - a]
                for r in ranks[1:]:
                    _scaled(src[r][a:b], world_size, divide, part, after)
                    piece += part
                if scaling == "after":
                    piece.div_(world_size)
                elif scaling == "after-scale":
                    piece.mul_(1.0 / world_size)
        result.append(acc)
    return result


def _scaled(src: torch.Tensor, world_size: int, divide: bool, out: torch.Tensor, after: bool = False) -> None:
    """``src / W`` (a hook's ``div_``), ``src * (1/W)`` (DDP's reducer) or, ``after`` (the sum is
    divided instead), ``src`` as it is, into ``out``."""
    if after:
        out.copy_(src)
    elif divide:
        torch.div(src, world_size, out=out)
    else:
        torch.mul(src, 1.0 / world_size, out=out)


def _ordered_bucket(src: list[torch.Tensor], scaling: str, out: torch.Tensor | None) -> torch.Tensor:
    """The ordered reduction of one bucket: ``ordered_mean`` (the recorder's own hook, or a job's
    hook that multiplies by ``1/W``), the ``ordered_sum`` of the parts a hook divided by ``W``, or
    the ``ordered_sum`` of the parts divided by ``W`` once summed (the ordered reduction stands in
    for the ``SUM`` such a hook asks for)."""
    if scaling == "scale":
        return ordered_mean(src, out=out)
    if scaling == "divide":
        return ordered_sum([t / len(src) for t in src], out=out)
    summed = ordered_sum(src)
    summed = summed.div_(len(src)) if scaling == "after" else summed.mul_(1.0 / len(src))
    return summed if out is None else out.copy_(summed)


def _compressed_bucket(
    src: list[torch.Tensor], order: str, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """The hook casts each rank's buffer to ``dtype`` and divides it by ``W`` there, the
    collective sums the parts (in ``order``; the ordered reduction in float32, rounded back to
    ``dtype`` once), and the hook casts the sum back."""
    world_size = len(src)
    low = [t.to(dtype).div_(world_size) for t in src]
    if order == ORDERED:
        acc = ordered_sum(low)
    else:
        acc = torch.empty_like(low[0])
        for lo, hi, ranks in _summation_plan(acc.numel(), acc.element_size(), world_size, order):
            piece = acc[lo:hi]
            piece.copy_(low[ranks[0]][lo:hi])
            for r in ranks[1:]:
                piece += low[r][lo:hi]
    target = out if out is not None else torch.empty_like(src[0])
    return target.copy_(acc)


def attempt_determinism(trace, attempt: int) -> dict:
    """The numerics contract ``attempt`` recorded ({} when it recorded none)."""
    return next((dict(a.determinism) for a in trace.manifest.attempts if a.attempt == attempt), {})


def recompute_dtype(trace, grad_dtype: str, device: torch.device, model) -> str:
    """The roundoff a recomputation of ``trace``'s gradients on ``device`` is compared with: the
    coarsest precision the job computed them in.

    * A job that computed in a lower precision than its gradients are kept in: ``torch.autocast``
      (the attempt's ``autocast_dtype``, seen in its first forward) or FSDP2's
      ``MixedPrecisionPolicy(param_dtype=...)`` (the layout's ``param_dtype``). A recomputation
      at another thread count rounds its bfloat16 matmul outputs at other places: the local
      gradients differ by 70-450 float32 tolerances (a bfloat16 GPT replayed at 2 threads,
      stop 55), every rank, every step; compared in float32 terms every window stopped at its
      first step as a weak common-mode mismatch and never reached a fault later in it.
    * A GPU job computes its float32 convolutions in TF32 when cuDNN allows it (PyTorch's default)
      and its matmuls when ``allow_tf32``/``float32_matmul_precision`` say so: 10 mantissa bits,
      not 23. A replay on the same GPU model runs the same kernels, but on a CPU or another GPU
      model the recomputed gradients differ from the recorded ones by TF32's roundoff, thousands
      of float32 tolerances (the first H200 trace replayed on a CPU: 54 of them at step 0, every
      rank).

    Used only where the comparison is within tolerance: an exact replay compares digests.
    """
    candidates = [grad_dtype]
    mesh = getattr(trace.manifest, "parallel", None)
    if getattr(mesh, "param_dtype", ""):
        candidates.append(mesh.param_dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    for attempt in trace.manifest.attempts:
        det = attempt.determinism
        if det.get("autocast_dtype") in tolerance.UNIT_ROUNDOFF:
            candidates.append(det["autocast_dtype"])
        if grad_dtype != "float32" or det.get("device_type") != "cuda":
            continue
        if device.type == "cuda" and det.get("device_name") == name:
            continue
        matmul_tf32 = bool(det.get("cuda_matmul_allow_tf32")) or det.get("float32_matmul_precision") in (
            "high",
            "medium",
        )
        if matmul_tf32 or (has_conv and det.get("cudnn_allow_tf32", True)):
            candidates.append("tfloat32")
    return max(candidates, key=lambda d: tolerance.UNIT_ROUNDOFF.get(d, 0.0))


def collective_suspect(trace, attempt: int) -> str:
    """The recorded setting most likely to make the replay's own collective add in another order
    than the job's did (for the note of a step it does not reproduce)."""
    recorded = attempt_determinism(trace, attempt)
    hook = str(recorded.get("comm_hook") or "")
    if hook:
        return f'the job\'s own comm hook {hook}, which reduces in its own order (record with RecorderOptions(reduction="ordered"))'
    backend = str(recorded.get("backend") or "")
    import torch.distributed as dist

    replay_backend = dist.get_backend() if dist.is_initialized() else ""
    if backend and replay_backend and backend != replay_backend:
        return f"the backend: the job all-reduced with {backend}, this replay with {replay_backend}"
    nccl = recorded.get("nccl_env") or {}
    differ = [
        f"{k}={v!r} (here {os.environ.get(k)!r})"
        for k, v in sorted(nccl.items())
        if isinstance(v, str) and os.environ.get(k) != v
    ]
    if differ:
        return "the NCCL settings: " + ", ".join(differ)
    return (
        "the collective's algorithm choice, which no recorded setting pins (bucket sizes, process placement, "
        "NCCL_ALGO/NCCL_PROTO left to NCCL)"
    )
