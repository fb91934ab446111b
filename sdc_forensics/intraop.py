"""torch's intra-op CPU thread count, set for a block and restored.

On CPU, matmul, convolution and normalisation kernels split their reductions by this count, so a
result is bitwise reproducible only at the count that produced it (``recorder/threads.py``).
Used where work must run at another count than the caller's: checkpoint verification (one thread
per worker) and an audit recomputing another rank's gradient at the count that rank ran with.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_lock = threading.Lock()


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(count)`` (nothing changes for a count < 1 or the
    current one) and restore the previous count after it."""
    with _lock:
        previous = torch.get_num_threads()
        if count >= 1 and count != previous:
            torch.set_num_threads(count)
    try:
        yield
    finally:
        with _lock:
            if torch.get_num_threads() != previous:
                torch.set_num_threads(previous)
