"""DDP's buffer broadcast, as the replay reproduces it: every rank starts a step from rank 0's buffers.

``DistributedDataParallel(broadcast_buffers=True)`` (its default) copies the module's buffers
(BatchNorm's ``running_mean``, ``running_var``, ``num_batches_tracked``) from rank 0 to every rank
before a forward that follows a synchronised backward (``require_forward_param_sync``): with
gradient accumulation as the recipe protocol assumes it (``no_sync`` on all but the last
microbatch), once per step, before the step's first microbatch. Each rank then updates its own
copy through its own microbatches; only rank 0's copy survives into the next step, and into a
checkpoint saved from rank 0.

The replay runs every rank's microbatches on one model, so it models that explicitly:

* :meth:`BufferBroadcast.begin_step`: the buffers entering the step (what rank 0 broadcasts);
* :meth:`BufferBroadcast.before_rank`: a rank's recomputation starts from them (also the
  second, tie-breaking recomputation);
* :meth:`BufferBroadcast.after_rank`: rank 0's buffers after its microbatches are kept;
* :meth:`BufferBroadcast.end_step`: they become the model's (under ``torchrun`` fan-out, sent
  by the process that computed rank 0, ``distributed.share_from_rank``).

Without it the replay's buffers took every rank's microbatches in turn (``W`` times too many
updates). Training-mode BatchNorm normalises with the batch's own statistics, so gradients and
weights were exact either way; the buffers, the part of a checkpoint no weights digest covers,
were not. :meth:`BufferBroadcast.check` compares the replayed buffers with a checkpoint's note
(the digest of every tensor saved) and says whether they are the saved ones, bit for bit.

A job with ``broadcast_buffers=False`` keeps a different copy on every rank, and a checkpoint
holds one of them: its buffers cannot be replayed from a checkpoint (``check`` says they differ).
"""

from __future__ import annotations

import dataclasses

import torch

from sdc_forensics.evidence import Evidence, EvidenceKind, Location, Strength
from sdc_forensics.replay import distributed
from sdc_forensics.trace.checkpoints import CheckpointNote

#: The rank whose buffers DDP broadcasts (``_sync_buffers``: rank 0 without a join context).
AUTHORITATIVE_RANK = 0


class BufferBroadcast:
    """The module buffers of a replayed model, kept as DDP's broadcast leaves them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._named = [(name, buf) for name, buf in model.named_buffers() if buf is not None]
        # the buffers entering the step
        self._start: list[torch.Tensor] = []
        # rank 0's buffers after its microbatches
        self._source: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        """False for a model without buffers: every method is then a no-op."""
        return bool(self._named)

    def begin_step(self) -> None:
        """Note the buffers entering the step: what rank 0 broadcasts before the first forward."""
        self._start = [buf.detach().clone() for _, buf in self._named]
        self._source = []

    def before_rank(self) -> None:
        """Give the model the buffers every rank starts the step from (after the broadcast)."""
        with torch.no_grad():
            for (_, buf), start in zip(self._named, self._start):
                buf.copy_(start)

    def after_rank(self, original_rank: int) -> None:
        """After ``original_rank``'s microbatches: keep rank 0's buffers, the ones that go on."""
        if original_rank == AUTHORITATIVE_RANK and self._named:
            self._source = [buf.detach().clone() for _, buf in self._named]

    def end_step(self) -> None:
        """Leave rank 0's buffers in the model, on every replay process alike."""
        if not self._named:
            return
        # this process did not compute rank 0: the buffers come from the one that did
        if not self._source:
            self._source = [buf.detach().clone() for _, buf in self._named]
        distributed.share_from_rank(self._source, AUTHORITATIVE_RANK)
        with torch.no_grad():
            for (_, buf), value in zip(self._named, self._source):
                buf.copy_(value)

    def compare(self, note: CheckpointNote, seed: int) -> tuple[int, list[str]]:
        """``(buffers found in the note, names of those whose saved digest differs from the replayed one)``.

        Buffers are found in the note's tensors by a unique key ending in their name (``model.1.running_mean``).
        """
        from sdc_forensics.statedict import state_digests

        if not self._named or not note.tensors:
            return 0, []
        replayed = state_digests({name: buf for name, buf in self._named}, seed)
        differ, found = [], 0
        for name, digest in replayed.items():
            keys = [k for k in note.tensors if k == name or k.endswith("." + name)]
            if len(keys) != 1:
                continue
            found += 1
            if note.tensors[keys[0]] != digest:
                differ.append(name)
        return found, differ

    def check(self, note: CheckpointNote, seed: int) -> str:
        """A sentence for the report: do the replayed buffers equal the ones checkpoint ``note`` saved?

        "" when the model has none or the note names none of them (nothing to say).
        """
        found, differ = self.compare(note, seed)
        if not found:
            return ""
        if not differ:
            return (
                f"checkpoint {note.step}: the replayed module buffers (e.g. BatchNorm running statistics) {EQUAL} "
                f"({found} tensors)"
            )
        shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        return (
            f"checkpoint {note.step}: the replayed module buffers differ from the saved ones ({shown}; saved by rank "
            f"{note.saved_by_rank}): the job may not broadcast its buffers (DDP broadcast_buffers=False) or they "
            "changed outside the steps; they are not confirmed by this replay"
        )


#: The start of a changed-buffers evidence's detail (:func:`changed_buffers`, :func:`unconfirmed`).
CHANGED = "buffers changed"
#: What a replay note says of a checkpoint whose buffers it reproduced (:meth:`BufferBroadcast.check`).
EQUAL = "equal the saved ones bit for bit"


def unconfirmed(evidence: list[Evidence], notes) -> list[Evidence]:
    """Changed-buffers evidence made weak where no replay of the analysis reproduced any checkpoint's
    buffers bit for bit (``notes``): a one-time change shows at the first checkpoint after it, and
    the others, replayed from it, match; every checkpoint differing is as likely a recipe that does
    not update the buffers as the job did (a counter the loop bumps, an EMA), which must not be
    called corruption. Weak: nothing after it is certified, and the answer is inconclusive."""
    if any(EQUAL in n for n in notes):
        return evidence
    return [
        dataclasses.replace(
            e,
            strength=Strength.WEAK,
            detail=f"{e.detail}; no checkpoint's buffers were reproduced bit for bit in this analysis, so a recipe that "
            "does not update them as the job did (docs/recipes.md) is as likely",
        )
        if e.source == "replay" and e.detail.startswith(CHANGED)
        else e
        for e in evidence
    ]


def changed_buffers(note: CheckpointNote, differ: list[str], window_start: int) -> Evidence:
    """Evidence that the buffers checkpoint ``note`` saved are not the ones an exact replay of a job that
    broadcasts them (DDP ``broadcast_buffers=True``, recorded) computed, while its weights and every
    gradient reproduced: rank 0's buffers, the ones every rank starts a step from and the checkpoint
    saved, changed at one of steps ``window_start .. note.step - 1`` (in memory, or a wrong running
    statistics update). Buffers are digested only at checkpoints, so the step is bounded, not known."""
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    return Evidence(
        kind=EvidenceKind.REPLAY_MISMATCH,
        step=note.step - 1,
        earliest_step=window_start,
        ranks=(note.saved_by_rank,),
        source="replay",
        location=Location.STATE_AT_REST,
        expected=f"module buffers {shown} as replayed exactly",
        found=f"other values saved in checkpoint {note.step}",
        detail=f"{CHANGED}: the module buffers (BatchNorm running statistics) checkpoint {note.step} saved differ from the exact "
        f"replay's ({shown}) while every gradient and weight reproduced: rank {note.saved_by_rank}'s buffers, which DDP "
        f"broadcasts to every rank, changed in memory or in their update at one of steps {window_start}..{note.step - 1} "
        "(buffers are digested only at checkpoints)",
    )
