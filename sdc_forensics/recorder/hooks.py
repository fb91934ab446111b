"""The DDP communication hook that fingerprints every bucket before and after the all-reduce.

DDP calls the hook once per gradient bucket, in bucket-index order (it launches bucket ``i``
only after buckets ``0..i-1``), on the last microbatch of an accumulation (``no_sync`` skips it).
With a comm hook registered, the bucket buffer holds the rank's local gradient summed over the
accumulated microbatches and not yet divided by ``W``: that is the ``local`` fingerprint. The
buffer the hook's future returns is the reduced gradient the optimizer will read: the
``reduced`` fingerprint. Bucket ``i`` is sketched with block offset = blocks of buckets
``0..i-1``, so :func:`~sdc_forensics.fingerprint.core.combine` gives the fingerprint of the
whole gradient.

Without a user hook the inner hook reproduces DDP's built-in path bit for bit: multiply by
``1/W`` (DDP does this while copying gradients into the bucket) and all-reduce with ``SUM``.

Host syncs: none inside the hook. Each bucket's two fingerprints are started with
:func:`~sdc_forensics.fingerprint.core.fingerprint_async` (the local one before the inner hook
launches the all-reduce, which then reduces the buffer in place: on CUDA the kernel is queued on
the current stream ahead of the collective, which waits for it; on CPU the call computes
eagerly), and :meth:`BucketTap.fingerprints` resolves all of them together at the step's end:
one device-to-host transfer per step for every bucket (none on CPU).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sdc_forensics.fingerprint import core as fp_core
from sdc_forensics.fingerprint.core import Fingerprint, PendingFingerprint, combine, num_sketch_blocks
from sdc_forensics.inject import Injector
from sdc_forensics.reduction import COMPRESSING_HOOKS


#: Hooks that reduce a lossy approximation of the gradient (low-rank, with error feedback): the
#: reduced gradient is not the mean of the local ones within any rounding tolerance.
LOSSY_HOOKS = ("powerSGD_hook", "batched_powerSGD_hook")


def hook_name(hook) -> str:
    """The function name of a comm hook (through ``functools.partial``)."""
    while hasattr(hook, "func") and not hasattr(hook, "__name__"):
        hook = hook.func
    return str(getattr(hook, "__name__", ""))


def compressed_dtype(hook) -> str | None:
    """The dtype a known compressing hook all-reduces in (None: not one torch ships)."""
    return COMPRESSING_HOOKS.get(hook_name(hook))


def mean_allreduce_hook(process_group, bucket):
    """DDP's built-in all-reduce as a comm hook: ``buffer * (1/W)``, then ``SUM`` (bitwise equal to no hook)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class BucketTap:
    """Collects per-bucket fingerprints of one step; the recorder's comm hook.

    Args:
        param_index: ``id(param) -> index`` in ``list(model.parameters())``.
        grad_numel: elements of the whole gradient (parameters that require grad).
        sketch_k, seed: fingerprint settings.
        injector: fault injection (``grad``, ``allreduce``, ``allreduce-all``).
        inner_hook, inner_state: the hook that really communicates (user's, or the built-in mean).
    """

    def __init__(
        self,
        *,
        param_index: dict[int, int],
        grad_numel: int,
        sketch_k: int,
        seed: int,
        injector: Injector,
        inner_hook: Callable | None,
        inner_state: Any,
    ) -> None:
        self._param_index = param_index
        self._grad_numel = grad_numel
        self._k = sketch_k
        self._seed = seed
        self._injector = injector
        self._inner_hook = inner_hook or mean_allreduce_hook
        self._inner_state = inner_state
        self._lock = threading.Lock()
        self.step: int | None = None
        self.grad_dtype: str | None = None
        self._reset()

    def _reset(self) -> None:
        self._local: dict[int, PendingFingerprint] = {}
        self._reduced: dict[int, PendingFingerprint] = {}
        self._layout: dict[int, list[int]] = {}
        self._next_block = 0
        self._next_element = 0
        self.error: BaseException | None = None

    def start(self, step: int | None) -> None:
        """Begin collecting for ``step`` (None: pass buckets through untouched)."""
        with self._lock:
            self.step = step
            self._reset()

    # unannotated: DDP rejects string annotations
    def hook(self, state, bucket):
        """The comm hook DDP calls per bucket: fingerprint, communicate, fingerprint the result."""
        step = self.step
        if step is None:
            return self._inner_hook(self._inner_state, bucket)
        index = bucket.index()
        buffer = bucket.buffer()
        # a new all-reduce round (a second backward in the same step restarts)
        if index == 0:
            self._reset()
        block_offset, element_offset = self._next_block, self._next_element
        self._next_block += num_sketch_blocks(buffer.numel())
        self._next_element += buffer.numel()
        self._layout[index] = [self._param_index[id(p)] for p in bucket.parameters()]
        if self.grad_dtype is None:
            self.grad_dtype = str(buffer.dtype).removeprefix("torch.")
        if self._injector:
            self._injector.corrupt_segment("grad", step, buffer.view(-1), element_offset, self._grad_numel)
        # read before the inner hook reduces the buffer in place (stream-ordered on CUDA)
        self._local[index] = fp_core.fingerprint_async(buffer, k=self._k, seed=self._seed, block_offset=block_offset)
        future = self._inner_hook(self._inner_state, bucket)

        def _after(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()
            reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
            try:
                if self._injector:
                    for location in ("allreduce", "allreduce-all"):
                        self._injector.corrupt_segment(
                            location, step, reduced.view(-1), element_offset, self._grad_numel
                        )
                fp = fp_core.fingerprint_async(reduced, k=self._k, seed=self._seed, block_offset=block_offset)
                with self._lock:
                    self._reduced[index] = fp
            except BaseException as exc:  # noqa: BLE001 - reported by the recorder, never inside DDP
                self.error = exc
            return reduced

        return future.then(_after)

    def layout(self) -> list[list[int]]:
        """This step's bucket layout: parameter indices per bucket, in bucket order."""
        return [self._layout[i] for i in sorted(self._layout)]

    def fingerprints(
        self, also: list[PendingFingerprint] = ()
    ) -> tuple[Fingerprint | None, Fingerprint | None, list[Fingerprint]]:
        """Combined ``(local, reduced)`` fingerprints of this step (None if no bucket was seen),
        and the fingerprints of ``also``.

        Every bucket's pending fingerprints, and ``also`` (the recorder's input digests), are
        resolved by one :func:`resolve <sdc_forensics.fingerprint.core.resolve>` call: the
        step's one host transfer for them on CUDA.
        """
        with self._lock:
            if self.error is not None:
                raise self.error
            local_keys, reduced_keys = sorted(self._local), sorted(self._reduced)
            pending = [self._local[i] for i in local_keys] + [self._reduced[i] for i in reduced_keys]
        also = list(also)
        if not pending and not also:
            return None, None, []
        done = fp_core.resolve(pending + also)
        n_local, n_buckets = len(local_keys), len(local_keys) + len(reduced_keys)
        local = combine(done[:n_local]) if local_keys else None
        reduced = combine(done[n_local:n_buckets]) if local_keys and reduced_keys else None
        return local, reduced, done[n_buckets:]
