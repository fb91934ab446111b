"""The intra-op CPU thread count each step ran with, a warning when it changes, and the autocast
dtype the forward computed in.

On CPU, matmul, convolution and normalisation kernels split their reductions by the intra-op
thread count, so a rank's local gradient is bitwise reproducible only at the count its step
ran with. Training scripts set it late (after the recorder was built), per rank, or change it
mid-run, so one count per attempt in the manifest is not enough: every STEP record carries its
own in ``aux_value`` (``docs/trace-format.md``), and replay follows it step by step.

The count is read with ``torch.get_num_threads()`` on the training thread when the optimizer
step begins (forward and backward are done; the count that computed the local gradient), or
at ``end_step`` for a step without an optimizer step.

Autocast is a context around the loop's forward, invisible from the optimizer's hooks: a
forward pre-hook reads it during the first forward of the attempt and removes itself. Its dtype
(``bfloat16``, ``float16``) goes into the manifest with the first step's thread count: a replay
that cannot be exact (another thread count or device) compares the recomputed gradients within
that dtype's roundoff, not float32's (``replay/env.py``, ``recompute_dtype``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sdc_forensics import numerics
from sdc_forensics.errors import SdcError
from sdc_forensics.recorder import records

#: The recorder package's logger (the demo and users tune ``sdc_forensics.recorder`` as a whole).
log = logging.getLogger("sdc_forensics.recorder")


class ThreadWatch:
    """Remembers the intra-op thread count of this rank's last recorded step; warns on a change.

    Args:
        rank: this process's global rank (named in the warning).
        module: the model the loop calls, watched for autocast in its first forward
            (:class:`AutocastWatch`; its dtype goes into the manifest with the first count).
    """

    def __init__(self, rank: int, module: torch.nn.Module | None = None) -> None:
        self.rank = rank
        self.autocast = AutocastWatch(module) if module is not None else None
        # the count of the first recorded step of this attempt
        self.first: int | None = None
        self.last: int | None = None
        self.last_step: int | None = None

    @staticmethod
    def current() -> int:
        """``torch.get_num_threads()`` of the calling thread."""
        return int(torch.get_num_threads())

    def observe(self, step: int, num_threads: int) -> bool:
        """Note the count step ``step`` ran with; log one warning if it differs from the previous step's.

        Returns:
            True when the count changed (a warning was logged).
        """
        changed = self.last is not None and num_threads != self.last
        if changed:
            log.warning(
                "sdc-forensics: rank %d changed its intra-op CPU threads from %d (step %s) to %d at step %d; "
                "the trace records the count of every step and replay follows it, but a replay that "
                "ignores per-step counts will not be bitwise exact",
                self.rank,
                self.last,
                self.last_step,
                num_threads,
                step,
            )
        if self.first is None:
            self.first = num_threads
        self.last, self.last_step = num_threads, step
        return changed

    def note(self, step: int, num_threads: int, trace_dir: Path, attempt: int) -> int:
        """:meth:`observe`, and rank 0 puts the attempt's first count (and the autocast dtype) into
        the manifest; returns the count."""
        first = self.first is None
        self.observe(step, num_threads)
        if first and self.rank == 0:
            autocast = self.autocast.settings() if self.autocast is not None else {}
            try:
                records.update_attempt_determinism(trace_dir, attempt, {"num_threads": int(num_threads), **autocast})
            # a nicety: the STEP records hold the counts anyway
            except (OSError, SdcError) as exc:
                log.warning("sdc-forensics: could not update num_threads in the manifest: %s", exc)
        return num_threads


class AutocastWatch:
    """The dtype autocast computed in during the first forward of ``module`` (``dtype``: None before
    that forward, ``""`` when autocast was off); the hook removes itself after that forward.

    Args:
        module: the model the loop calls (its forward pre-hook); autocast is read for the device
            its first parameter is on.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.dtype: str | None = None
        self.handle = module.register_forward_pre_hook(self._see)
        self.module = module

    def _see(self, *_: object) -> None:
        param = next(self.module.parameters(), None)
        self.dtype = numerics.autocast_dtype(param.device.type if param is not None else "cpu")
        self.handle.remove()

    def settings(self) -> dict:
        """``{"autocast_dtype": ...}`` once a forward ran under autocast, else ``{}``."""
        return {"autocast_dtype": self.dtype} if self.dtype else {}
