"""One step as the recorder sees it: what it knows of the step (:class:`StepState`) and the
handle the training loop reports through (:class:`StepRecording`).

The recorder (``recorder.py``) creates both when a step begins; its layout (``layout.py``) fills
the gradients and the weights of the state; the STEP record is written from it when the step
ends. The inputs are digested here as the loop hands them over: on CPU at once, on a device
started now and pulled to the host with the gradients' fingerprints (no sync inside the step).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterable
from typing import Any

import torch

from sdc_forensics.fingerprint import core as fp_core
from sdc_forensics.fingerprint.core import Fingerprint, PendingFingerprint, digests
from sdc_forensics.inject import Injector
from sdc_forensics.recorder.audit import AuditOutcome
from sdc_forensics.statedict import flatten_state


class UnrecordedUpdates:
    """An ``optimizer.step()`` outside any recorded step (a loop that steps after the ``with``
    block) changes the weights unseen, and nothing after it can be certified: said once per
    recorder, on the rank's stderr (the ``sdc_forensics.recorder`` logger), not learnt later
    from an inconclusive bisect."""

    def __init__(self, rank: int) -> None:
        self.rank, self.said = rank, False

    def __call__(self) -> None:
        if self.said or _creating_optimizer_state():
            return
        self.said = True
        logging.getLogger("sdc_forensics.recorder").warning(
            "sdc-forensics: rank %d: optimizer.step() ran outside `with recorder.step(...)`: this update is not "
            "recorded, and no checkpoint after it can be certified; call optimizer.step() inside the step's block "
            "(docs/recorder.md)",
            self.rank,
        )


def _creating_optimizer_state() -> bool:
    """Whether torch's ``get_state_dict``/``set_state_dict`` of an optimizer that has no state yet is
    what steps it: ``torch.distributed.checkpoint.state_dict._init_optim_state`` creates the state
    with one ``optimizer.step()`` on zero gradients at learning rate 0, which moves no weight and is
    no update of the job's (a new user's FSDP2 job saving checkpoint 0 that way was told that no
    checkpoint could be certified, and every one was). Called only for a step outside a recorded one."""
    frame = sys._getframe(2)
    for _ in range(16):  # the optimizer's hooks and wrappers sit between it and the caller
        if frame is None:
            return False
        if frame.f_code.co_name == "_init_optim_state" and str(frame.f_globals.get("__name__", "")).startswith(
            "torch.distributed.checkpoint"
        ):
            return True
        frame = frame.f_back
    return False


@dataclasses.dataclass(kw_only=True)
class StepState:
    """What the recorder knows of the step in progress; a layout fills the fields it measures."""

    step: int
    ids: tuple[int, ...] | None
    losses: list = dataclasses.field(default_factory=list)
    input_digests: list[int] = dataclasses.field(default_factory=list)
    # off-CPU inputs, resolved with the gradients' fingerprints (one host transfer)
    input_pending: list[PendingFingerprint] = dataclasses.field(default_factory=list)
    input_elements: int = 0
    flags: int = 0
    local: Fingerprint | None = None
    reduced: Fingerprint | None = None
    # digest, norm, nonfinite count
    weights: tuple[int, float, int] | None = None
    # a sharded job: the rank's weight shard digest when the step began (aux_digest)
    rest_weights: int | None = None
    # a sharded job: digests of the parameters FSDP gathered
    gathered: list[int] = dataclasses.field(default_factory=list)
    audit: AuditOutcome | None = None
    # intra-op CPU threads the step ran with (0: not read yet)
    num_threads: int = 0
    # the summed loss, read from the device once, and how many losses it sums
    loss_value: float | None = None
    loss_value_count: int = 0
    written: bool = False
    # deferred checks: the step's exchanges in flight (``exchange.Pending``), resolved when the next step begins
    pending: Any = None
    # a pipeline stage: digests of the outputs it sent on and of the gradients handed back for them,
    # per microbatch in order (``PendingFingerprint``s: read with the stream, resolved when written)
    handoffs: dict[str, list] | None = None

    def add_handoff(self, which: str, tensor: torch.Tensor, seed: int, keep: int) -> None:
        """Digest a tensor a pipeline stage sent on (``"out"``) or was handed back (``"back"``); only
        the last ``keep`` of each are the step's (a schedule's first step runs one more forward and
        backward first, to infer the stages' shapes)."""
        if self.handoffs is None:
            self.handoffs = {"out": [], "back": []}
        found = self.handoffs[which]
        found.append(fp_core.fingerprint_async(tensor.detach(), k=1, seed=seed))
        del found[:-keep]

    def handoff_digests(self) -> tuple[int, int, int] | None:
        """``(sent on, handed back, how many sent)``: each list's digests combined in order (0: none)."""
        if self.handoffs is None:
            return None
        out, back = (fp_core.resolve(self.handoffs[k]) for k in ("out", "back"))
        combined = [fp_core.combine_digests([f.digest for f in fps]) % (1 << 64) if fps else 0 for fps in (out, back)]
        return combined[0], combined[1], len(out)

    def resolve_inputs(self, resolved: list[Fingerprint] | None = None) -> None:
        """Move pending input digests into ``input_digests`` (``resolved``: already pulled to the
        host, with the gradients'; else pulled now)."""
        if not self.input_pending:
            return
        done = resolved if resolved is not None else fp_core.resolve(self.input_pending)
        self.input_digests.extend(fp.digest for fp in done)
        self.input_pending = []

    def add_input(self, microbatch: Any, injector: Injector, seed: int) -> Any:
        """Digest a microbatch the rank is about to consume (a drill may flip it first); returns it."""
        tensors = list(flatten_state(microbatch).values())
        if injector:
            self.input_elements += injector.corrupt_input(self.step, tensors, self.input_elements)
        # no device: the cheapest pass
        if all(t.device.type == "cpu" for t in tensors):
            self.input_digests.extend(digests(tensors, seed))
        # read now (stream-ordered), pulled to the host with the gradients' fingerprints: no sync here
        else:
            # keep the order of earlier CPU inputs
            self.resolve_inputs()
            self.input_pending.extend(fp_core.fingerprint_async(t, k=1, seed=seed) for t in tensors)
        return microbatch

    def summed_loss(self) -> float:
        """The step's summed loss (float64 sum of the microbatch losses in order): one transfer, kept."""
        if self.loss_value is None or self.loss_value_count != len(self.losses):
            values = (
                torch.stack([loss.reshape(()).to(torch.float64) for loss in self.losses]).tolist()
                if self.losses
                else []
            )
            self.loss_value, self.loss_value_count = float(sum(values)), len(self.losses)
        return self.loss_value


class StepRecording:
    """Handle of one step inside ``with rec.step(...)``: report inputs and losses through it."""

    def __init__(self, state: StepState, injector: Injector, seed: int) -> None:
        self._state = state
        self._injector = injector
        self._seed = seed

    @property
    def step(self) -> int:
        return self._state.step

    def input(self, microbatch: Any) -> Any:
        """Digest a microbatch the rank is about to consume (tensors in any nesting); returns it."""
        return self._state.add_input(microbatch, self._injector, self._seed)

    def loss(self, loss: torch.Tensor) -> None:
        """Report a microbatch's loss as ``backward()`` saw it (summed over the step in the trace).

        A DTensor loss (torch's ``loss_parallel`` cross entropy is replicated over ``tp``) is kept as
        its value: the local tensor where every placement is ``Replicate``, else the whole value
        (a collective every rank of its mesh runs, as every rank reports its loss)."""
        if hasattr(loss, "device_mesh") and hasattr(loss, "placements"):
            replicated = all(p.is_replicate() for p in loss.placements)
            loss = loss.to_local() if replicated else loss.full_tensor()
        self._state.losses.append(loss.detach())

    def add_microbatch_ids(self, ids: Iterable[int]) -> None:
        """Append microbatch IDs learned during the step (a framework's dataloader hands the
        sample indices over with each batch, after the step began); recorded after those given
        to ``rec.step(microbatch_ids=...)``."""
        self._state.ids = (self._state.ids or ()) + tuple(int(i) for i in ids)
