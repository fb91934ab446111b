"""The layout contract: what the recorder asks of the way a model is spread over the ranks.

``Recorder`` (``recorder.py``) holds the step protocol once: begin and end a step, digest the
inputs, the failure exchange before the optimizer step, the audits, alarms and policy, the weights
vote, the STEP record, checkpoints, close. Whatever depends on how the model is spread over the
ranks it asks a :class:`Layout` for, through the methods below and nothing else (the style of
torchtitan's components and of nvidia-resiliency-ext's composed strategies):

* ``ddp_layout.py``: ``DistributedDataParallel`` (every rank a whole replica; the comm hook reads
  each bucket before and after its all-reduce);
* ``fsdp_layout.py``: FSDP2's ``fully_shard`` on a 1-D mesh, and HSDP (replicate x shard).

A further layout (tensor or pipeline parallelism, alone or with FSDP) is one more file
implementing :class:`Layout`, and one more line in ``recorder.make_layout``: the recorder is not
subclassed, and no layout imports it (the stack is recorder -> layouts -> this contract ->
the checks and records beneath).

The recorder calls a layout in this order:

1. its constructor, with the model: refusals that need no collective (raise ``UsageError``);
   then :attr:`module`, :attr:`group` and :attr:`locations` are read;
2. :meth:`validate`: what this rank cannot record, in one line; gathered with every rank's
   identity, so that all ranks refuse together before anything is written;
3. :meth:`declared_grad_dtype`, then :meth:`install` (hooks on the model; it may refuse, every
   rank alike); then :attr:`mesh` and :attr:`comm_hook_name` go into the manifest;
4. per step: :meth:`begin_step` (after a ``weights`` drill flipped the weights);
   :meth:`read_gradients`, :meth:`buckets`, :meth:`words` and, once every rank's words are
   gathered, :meth:`check` (in the optimizer's pre-hook, before the audit); :meth:`weights`,
   :meth:`settled`, and the vote within :meth:`replica_groups`, phrased by
   :meth:`weights_findings` (in its post-hook); :meth:`end_step`;
5. at an audited step :meth:`audit_module`; at a checkpoint :meth:`saver` and :meth:`settled`
   (and :meth:`weights` and the vote, where the last step's vote cannot be reused);
6. :meth:`uninstall` when the recorder closes.

A layout's hooks that run outside the recorder's calls (in autograd, in FSDP2's collectives) ask
``job.current()`` for the step in progress.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sdc_forensics.inject import LOCATIONS, Injector
from sdc_forensics.recorder.checkpointing import Saver
from sdc_forensics.recorder.checks import Finding, GroupVote

# gathered problems raised on every rank alike: written below this module, with the identities
from sdc_forensics.recorder.identity import refuse_together as refuse_together
from sdc_forensics.recorder.options import RecorderOptions
from sdc_forensics.recorder.step import StepState


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """What the recorder tells its layout about the job (its checks done, before anything is written).

    Attributes:
        options: the recorder's options (``grad_dtype`` already the layout's declared one, if any).
        rank, world_size, group: this process in the data-parallel group.
        params: ``list(module.parameters())``, in model order (the trace's parameter indices).
        device: where the parameters live.
        injector: the fault drills (``inject``), this rank's.
        current: the step in progress (None between steps).
    """

    options: RecorderOptions
    rank: int
    world_size: int
    group: Any
    params: list[torch.nn.Parameter]
    device: torch.device
    injector: Injector
    current: Callable[[], StepState | None]


class Layout(abc.ABC):
    """One way of spreading a model over the ranks, as the recorder needs to know it.

    Subclasses implement every abstract method; the others have the defaults a layout without
    that feature needs.
    """

    #: the fault locations a drill may name (``sdc_forensics.inject``)
    locations: tuple[str, ...] = LOCATIONS

    # ---------------------------------------------------------------- attaching
    @property
    @abc.abstractmethod
    def module(self) -> torch.nn.Module:
        """The model itself (a DDP wrapper's ``.module``): its parameters are recorded, in order."""

    @property
    @abc.abstractmethod
    def group(self) -> Any:
        """The process group whose ranks the recorder gathers over (its ranks vote)."""

    @abc.abstractmethod
    def validate(self, job: Job) -> str | None:
        """What this rank cannot record, in one line (None: nothing). No collective, nothing
        installed: the recorder gathers every rank's answer and all refuse together."""

    def declared_grad_dtype(self) -> str | None:
        """The dtype the gradient is reduced in, when the layout knows it before any step (a
        compressing comm hook, FSDP2's ``reduce_dtype``); it becomes ``options.grad_dtype``
        unless the caller set one."""
        return None

    @abc.abstractmethod
    def install(self, job: Job) -> None:
        """Put the layout's hooks on the model (after every rank's :meth:`validate` passed). May
        raise ``UsageError``, on every rank alike (gathered where only some rank would)."""

    @abc.abstractmethod
    def uninstall(self) -> None:
        """Take the hooks off (or make them pass-throughs): the model is the job's own again. Idempotent."""

    @property
    def mesh(self) -> Any:
        """The manifest's ``parallel`` note (``trace/mesh.py``), None for whole replicas."""
        return None

    @property
    def comm_hook_name(self) -> str:
        """The collective the job's gradients really go through, as the manifest names it ("" for the library's own)."""
        return ""

    @property
    def numerics(self) -> dict:
        """Settings of the wrapper that decide what a replay must reproduce, for the attempt's
        ``determinism`` (``{}``: none)."""
        return {}

    # ---------------------------------------------------------------- per step
    @abc.abstractmethod
    def begin_step(self, state: StepState) -> None:
        """Step ``state.step`` begins (its ``weights`` drill, if any, has flipped the weights)."""

    @abc.abstractmethod
    def end_step(self) -> None:
        """The step ended (or was abandoned): measure nothing until the next begins."""

    @abc.abstractmethod
    def read_gradients(self, state: StepState) -> None:
        """Before the update: fill ``state.local`` (this rank's local gradient) and
        ``state.reduced`` (what the reduction gave it), and resolve ``state.input_pending``
        (:meth:`StepState.resolve_inputs`, in the same host transfer where it can). Raises on a
        problem: the recorder tells every rank (the failure exchange)."""

    @abc.abstractmethod
    def buckets(self) -> list[list[int]]:
        """The gradient's buckets as parameter indices (the trace's layouts file); ``[]``: none seen yet."""

    @abc.abstractmethod
    def seen_grad_dtype(self) -> str | None:
        """The dtype the gradient was reduced in, as the first step saw it (None: unknown)."""

    @abc.abstractmethod
    def words(self, state: StepState) -> np.ndarray:
        """This rank's ``(n,)`` int64 words for the exchange before the update (every rank the
        same ``n``); the recorder adds whether the rank read its gradients, and its failure.
        Never raises (it is called after a failed :meth:`read_gradients` too: the other ranks
        wait for the words)."""

    @abc.abstractmethod
    def check(self, state: StepState, table: np.ndarray, has_grads: np.ndarray) -> list[Finding] | None:
        """The gradient checks, from every rank's :meth:`words` (``table``: ``(W, n)``;
        ``has_grads``: ``(W,)``, which ranks read both gradients). Sets ``state.flags``. Returns
        the findings (the audit's follow them), or None: nothing to compare at this step, and no
        audit either. May run collectives, the same on every rank."""

    @abc.abstractmethod
    def weights(self) -> tuple[int, float, int]:
        """``(digest, L2 norm, NaN/Inf count)`` of the weights this rank holds (whole, or its shard)."""

    def settled(self, digest: int) -> None:
        """``digest`` (:meth:`weights`) is what the next step starts from: after an update, or as
        a checkpoint saved it. A sharded layout checks the shard at rest against it."""
        # whole replicas have nothing to check it against
        return None

    @abc.abstractmethod
    def replica_groups(self) -> list[tuple[int, ...]]:
        """The groups of ranks whose :meth:`weights` digests must be equal (they vote)."""

    @abc.abstractmethod
    def weights_findings(self, step: int, votes: list[GroupVote]) -> list[Finding]:
        """What the weights vote after ``step`` found, in words (``votes``: each group's vote)."""

    # ---------------------------------------------------------------- audits and checkpoints
    @abc.abstractmethod
    def audit_module(self, recipe: Any) -> contextlib.AbstractContextManager[tuple[torch.nn.Module, list[list[int]]]]:
        """``with layout.audit_module(recipe) as (module, buckets)``: a whole model at theta_s to
        recompute another rank's microbatches on, and the buckets its gradient is fingerprinted in."""

    @abc.abstractmethod
    def saver(self) -> Saver:
        """How this layout writes a checkpoint (``checkpointing.py``)."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (a plain tensor as it is)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and hasattr(tensor, "device_mesh") else tensor
