"""The replay's environment: deterministic settings, the device it runs on, bucket layouts, reductions.

* :func:`deterministic` applies (and afterwards restores) deterministic algorithms, the cuBLAS
  workspace, TF32 off, cuDNN determinism and the thread count the manifest recorded, and returns
  what it applied so the report can say so.
* :func:`describe_device` names the replay device (with its GPU UUID on CUDA) and
  :func:`check_not_suspect` refuses a device that is the suspect's GPU.
* :func:`bucket_layouts` reads ``buckets.attempt-AAA.json`` (``trace/layouts.py``, docs/trace-format.md).
* :func:`reduce_buckets` averages the ranks' bucket buffers the way a collective does:
  ``gloo-ring`` reproduces gloo's ring all-reduce bit for bit (the buffer is cut into ``W``
  equal segments, rounded up to 16 bytes; segment ``i`` is summed along the ring starting at rank ``i - 1`` and going
  backwards, after each rank divided its buffer by ``W`` as DDP does), ``sequential`` adds the
  ranks in order. The replay picks the one whose digest equals the recorded reduced digest.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from typing import Any

import torch

from sdc_forensics.errors import TraceError, UsageError
from sdc_forensics.trace.layouts import BucketLayout, read_bucket_layouts

REDUCTION_ORDERS = ("gloo-ring", "sequential")


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
        raise TraceError(f"the recorded bucket layout from step {chosen.from_step} names parameter {beyond[0]}, but the recipe's model "
                         f"has {num_params} parameters: the trace's buckets.attempt-*.json does not belong to this model; "
                         "pass the recipe the run trained with, or restore the file from the run")
    return chosen.buckets, True


@contextlib.contextmanager
def deterministic(device: torch.device, num_threads: int | None) -> Iterator[dict[str, Any]]:
    """Apply deterministic settings for the duration of a replay; yields what was applied."""
    saved = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "threads": torch.get_num_threads(),
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_det": torch.backends.cudnn.deterministic,
        "cudnn_bench": torch.backends.cudnn.benchmark,
    }
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if num_threads:
        torch.set_num_threads(int(num_threads))
    applied = {
        "deterministic_algorithms": True,
        "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "tf32": False,
        "cudnn_deterministic": True,
        "num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "device_type": device.type,
    }
    try:
        yield applied
    finally:
        torch.use_deterministic_algorithms(saved["deterministic"])
        torch.set_num_threads(saved["threads"])
        if saved["cublas"] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved["cublas"]
        torch.backends.cuda.matmul.allow_tf32 = saved["tf32_matmul"]
        torch.backends.cudnn.allow_tf32 = saved["tf32_cudnn"]
        torch.backends.cudnn.deterministic = saved["cudnn_det"]
        torch.backends.cudnn.benchmark = saved["cudnn_bench"]


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


def describe_device(device: torch.device) -> str:
    """A human name of the replay device: ``cpu (x86_64, 2 threads)`` or ``cuda:0 (NAME, GPU-…)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)}, {gpu_uuid(device) or 'uuid unknown'})"
    return f"cpu ({platform.machine() or 'unknown'}, {torch.get_num_threads()} threads)"


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
            start = (i - 1) % world_size  # chunk i is reduce-scattered from rank i-1 backwards
            plan.append((lo, hi, [(start - j) % world_size for j in range(world_size)]))
    return plan


def reduce_buckets(per_rank: list[list[torch.Tensor]], order: str, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Average bucket buffers over ranks. ``per_rank[r][b]``: rank ``r``'s flat bucket ``b``.

    Each rank's buffer is multiplied by ``1 / W`` (as DDP does before its SUM), then the parts
    are added in ``order``. Elementwise, so it is computed slice by slice on CPU (each slice of
    the W buffers read once, while in cache, no scaled copies of whole buffers) with the same
    roundings as whole-buffer operations. ``out``: buffers to write into (same shapes), reused
    across steps; None allocates them.
    """
    world_size = len(per_rank)
    scale = 1.0 / world_size
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
                torch.mul(src[ranks[0]][a:b], scale, out=piece)
                part = scratch[: b - a]
                for r in ranks[1:]:
                    torch.mul(src[r][a:b], scale, out=part)
                    piece += part
        result.append(acc)
    return result
