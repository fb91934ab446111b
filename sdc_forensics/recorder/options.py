"""Options of the recorder, validated when built (the CLI and user code build them; the recorder never sees flags).

The closed sets among them (what an alarm does, how the gradient is reduced) are enums that are
also strings: callers pass ``policy="raise"`` as they always did, the option then holds
:attr:`Policy.RAISE`, which equals ``"raise"``, prints as ``raise`` and is written to JSON as
``"raise"``; the recorder compares members, never spelled strings.
"""

from __future__ import annotations

import dataclasses
import enum

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import constants as C


class Choice(str, enum.Enum):
    """A member of a closed set that is also its string: equal to it, hashed, formatted and
    serialised as it (``str`` and ``format`` give the value on every Python, not ``Class.NAME``)."""

    def __str__(self) -> str:
        return str(self.value)

    __format__ = str.__format__


class Policy(Choice):
    """What the recorder does when an online check fires (the trace is on disk first, either way)."""

    #: raise :class:`~sdc_forensics.errors.SdcAlarm` on every rank
    RAISE = "raise"
    #: record the ALARM and train on
    CONTINUE = "continue"


class Reduction(Choice):
    """How the gradient is reduced (``sdc_forensics/reduction.py`` holds the arithmetic)."""

    #: the collective library's own summation order
    NATIVE = "native"
    #: every element's ranks added left to right, so that any replay reproduces it bit for bit
    ORDERED = "ordered"


POLICIES = tuple(p.value for p in Policy)
REDUCTIONS = tuple(r.value for r in Reduction)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecorderOptions:
    """How the recorder fingerprints, checks and reacts.

    Attributes:
        policy: on alarm, ``raise`` an :class:`~sdc_forensics.errors.SdcAlarm` (default) or
            ``continue`` (record the alarm and train on).
        seed: fingerprint seed (recorded in the manifest).
        sketch_k: sketch projections per fingerprint.
        grad_dtype: dtype gradients travel in during the all-reduce (tolerance model); None =
            the dtype of the first bucket seen (the manifest records ``float32`` until then).
        audit_every: audit every N-th step (``step % N == 0``); 0 = no periodic audits.
        audit_steps: further steps to audit.
        weights_every: compare replica weight digests every N-th step (and always before a
            checkpoint); 0 = only before checkpoints.
        check_allreduce: run the all-reduce sketch check every step.
        checkpoint_every: the job's checkpoint interval, recorded in the manifest for bisect.
        node_of_rank: node index of every global rank; None = from host names. Tests on one host
            pass e.g. ``(0, 1, 2, 3)`` to pretend each rank is a node.
        start_step: the first step of this attempt (a run resumed from checkpoint N starts at N).
        fsync: ``fsync`` the trace after every record (survives a machine crash; costs a sync).
        reduction: ``native`` (the collective library's own summation order, which a replay
            reproduces only for gloo's ring on CPU) or ``ordered`` (every element's ranks added
            left to right, ``sdc_forensics/reduction.py``: any replay, on any device, reproduces
            the reduced gradient bit for bit, so a GPU job can be certified; docs/recorder.md
            gives its cost).
        deferred_checks: launch the recorder's own collectives (the failure exchange's words,
            the weights vote; a sharded job's reduce-scatter check table) in the background and
            resolve them when the next step begins, so that none blocks the step (DDP, FSDP2,
            HSDP, TP, PP; audited steps and checkpoints stay synchronous). The
            trace is the same, its STEP record written a step later; the policy acts a step
            late: under ``raise`` the alarm comes from the next ``begin_step`` (or from
            ``checkpoint``/``close``), after the flagged step's update. docs/recorder.md.
    """

    policy: Policy | str = Policy.RAISE
    seed: int = C.DEFAULT_SEED
    sketch_k: int = C.DEFAULT_SKETCH_K
    grad_dtype: str | None = None
    audit_every: int = 0
    audit_steps: tuple[int, ...] = ()
    weights_every: int = 1
    check_allreduce: bool = True
    checkpoint_every: int | None = None
    node_of_rank: tuple[int, ...] | None = None
    start_step: int = 0
    fsync: bool = False
    reduction: Reduction | str = Reduction.NATIVE
    deferred_checks: bool = False

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise UsageError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {self.reduction!r}")
        if self.policy not in POLICIES:
            raise UsageError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        # a string from the caller becomes its member (a member stays itself)
        object.__setattr__(self, "reduction", Reduction(self.reduction))
        object.__setattr__(self, "policy", Policy(self.policy))
        if not 1 <= self.sketch_k <= 64:
            raise UsageError(f"sketch_k must be in 1..64, got {self.sketch_k}")
        for name in ("audit_every", "weights_every", "start_step"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UsageError(f"checkpoint_every must be >= 1 (or None), got {self.checkpoint_every}")
        if self.node_of_rank is not None:
            object.__setattr__(self, "node_of_rank", tuple(int(n) for n in self.node_of_rank))
        object.__setattr__(self, "audit_steps", tuple(sorted(int(s) for s in self.audit_steps)))

    def audits(self, step: int) -> bool:
        """Whether ``step`` is audited."""
        return (self.audit_every > 0 and step % self.audit_every == 0) or step in self.audit_steps

    def compares_weights(self, step: int) -> bool:
        """Whether replica weights are compared after ``step``'s update."""
        return self.weights_every > 0 and step % self.weights_every == 0
