"""Checkpoints through the recorder: replica consensus first, then digest, save and note.

The order matters: the replicas' weight digests are compared *before* anything is written (the
comparison the step that wrote ``θ_N`` just made is reused, not repeated), the
state is saved from a rank of the strict majority, and the note holds the digests of the exact
payload that was handed to ``save`` (so later storage corruption of the file is visible to
``verify-checkpoint``). Without a strict majority there is nothing trustworthy to save.

The recorder hands :func:`save_checkpoint` what it needs as one :class:`CheckpointSite` (its
identity in the group, its trace writer, the last weights vote, and two functions: gather a word
from every rank, react to a finding); this module never imports the recorder.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcError, UsageError
from sdc_forensics.inject import Injector
from sdc_forensics.recorder import checks
from sdc_forensics.statedict import flatten_state, state_digests, weights_digest
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, climbs_then_descends, hex64, write_checkpoint_note
from sdc_forensics.trace.writer import RankTraceWriter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSite:
    """What saving a checkpoint needs from the recorder (``Recorder.checkpoint`` builds it).

    Attributes:
        module: the model (``ddp_model.module``): its parameters are digested and found in the state.
        seed: the fingerprint seed.
        policy: the recorder's policy (``raise`` refuses a checkpoint without a strict majority).
        rank, world_size, group: this process in the data-parallel group.
        attempt: the attempt number noted with the checkpoint.
        trace_dir: the trace directory (the note is written under it).
        writer: this rank's trace writer: the CHECKPOINT record.
        injector: the fault injector (a test may corrupt the written file).
        last_weights_vote: ``(step, my_digest, vote)`` of the last weights comparison, or None.
        all_gather_words: ``(n,)`` int64 words of this rank -> ``(W, n)`` table of every rank's.
        react: record findings as alarms (and raise under policy ``raise``).
    """

    module: torch.nn.Module
    seed: int
    policy: str
    rank: int
    world_size: int
    group: Any
    attempt: int
    trace_dir: Path
    writer: RankTraceWriter
    injector: Injector
    last_weights_vote: tuple[int, int, checks.Majority] | None
    all_gather_words: Callable[[np.ndarray], np.ndarray]
    react: Callable[[list[checks.Finding]], None]


def param_keys(named_params: list[tuple[str, torch.Tensor]], state: Any) -> tuple[str, ...]:
    """The key of every parameter inside the flattened payload, in ``named_parameters`` order.

    A parameter is found by storage (``model.state_dict()`` shares it), else by a unique key
    ending in its name (a payload of copies).
    """
    flat = flatten_state(state)
    by_storage = {(t.data_ptr(), tuple(t.shape), t.dtype): key for key, t in flat.items() if t.numel()}
    keys = []
    for name, param in named_params:
        key = by_storage.get((param.data_ptr(), tuple(param.shape), param.dtype)) if param.numel() else None
        if key is None:
            matches = [k for k in flat if k == name or k.endswith("." + name)]
            if len(matches) != 1:
                raise UsageError(
                    f"the checkpoint state does not hold parameter {name!r} (or holds it ambiguously); "
                    "pass a state built from model.state_dict() so the recorder can note the weights digest"
                )
            key = matches[0]
        keys.append(key)
    return tuple(keys)


def taken(path: str | os.PathLike) -> bool:
    """Whether writing a checkpoint at ``path`` would write over something: a file (or link), or
    a folder that holds anything (an empty folder made beforehand is free)."""
    path = Path(path)
    if path.is_dir():
        return any(path.iterdir())
    return os.path.lexists(path)


def unused_path(path: str | os.PathLike) -> Path:
    """``path``, or the first of ``stem-v1.suffix``, ``stem-v2.suffix``, ... that is not :func:`taken`
    (Lightning's version counter's names): where a checkpoint goes when an earlier one holds its name."""
    path = candidate = Path(path)
    version = 0
    while taken(candidate):
        version += 1
        candidate = path.with_name(f"{path.stem}-v{version}{path.suffix}")
    return candidate


def path_from_trace(trace_dir: Path, path: Path) -> str:
    """``path`` relative to the trace directory (``../checkpoints/x.pt``), "" when there is none
    (another drive) or it would not climb-then-descend (a symbolic link in between)."""
    try:
        relative = os.path.relpath(os.path.abspath(path), os.path.abspath(trace_dir))
    except ValueError:
        return ""
    relative = Path(relative).as_posix()
    return relative if climbs_then_descends(relative) else ""


def save_checkpoint(site: CheckpointSite, step: int, path: Path, state: Any, save: Callable[[Any, Path], None] | None) -> CheckpointNote:
    """Compare the replicas' weights, save ``state`` from a rank of the majority, note it and
    record it (a collective; see ``Recorder.checkpoint``)."""
    last = site.last_weights_vote
    if last is not None and last[0] == step - 1:  # theta_step was just compared (and any alarm raised)
        _, my_digest, vote = last
        finding = None
    else:
        my_digest = weights_digest(site.module.named_parameters(), site.seed)
        table = site.all_gather_words(np.array([my_digest], dtype=np.uint64).view(np.int64))[:, 0].view(np.uint64)
        finding, vote = checks.check_weights(max(step - 1, 0), table)  # theta_step was written by step - 1
    blessed = vote.value is not None
    saver = 0 if (not blessed or 0 in vote.agreeing) else vote.agreeing[0]
    refuse = not blessed and site.policy == "raise"
    outcome: list = [None]
    if site.rank == saver and not refuse:
        try:
            outcome = [_save_and_note(site, step, path, state, save, vote, blessed, saver)]
        except Exception as exc:  # noqa: BLE001 - every rank must learn that the save failed
            outcome = [f"{type(exc).__name__}: {exc}"]
    if not refuse:
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(site.group, saver), group=site.group)
    record = site.writer.new(F.Kind.CHECKPOINT, step)
    record["weights_digest"] = my_digest % (1 << 64)
    record["aux_digest"] = (vote.value or 0) % (1 << 64)
    record["aux_rank"] = saver
    record["flags"] = int(F.Flag.WEIGHTS_CHECKED) | (0 if blessed else int(F.Flag.CHECKPOINT_REFUSED | F.Flag.NO_MAJORITY))
    if site.rank in vote.diverged and blessed:
        record["flags"] |= int(F.Flag.WEIGHTS_DIVERGED)
    site.writer.append(record)
    if isinstance(outcome[0], str):
        raise SdcError(f"checkpoint {step} could not be saved to {path} by rank {saver}: {outcome[0]}")
    if finding is not None:
        site.react([finding])
    return outcome[0]


def _save_and_note(site: CheckpointSite, step: int, path: Path, state: Any, save, vote, blessed: bool, saver: int) -> CheckpointNote:
    seed = site.seed
    keys = param_keys(list(site.module.named_parameters()), state)
    tensors = state_digests(state, seed)  # of the payload, before it is written
    path.parent.mkdir(parents=True, exist_ok=True)
    if save is None:  # the recorder writes the file itself: never over one (an earlier attempt's evidence, its note)
        free = unused_path(path)
        if free != path:
            log.warning("sdc-forensics: %s exists (an earlier attempt's checkpoint); checkpoint %d is saved as %s", path, step, free.name)
        path = free
    (save or torch.save)(state, path)
    note = CheckpointNote(
        step=step,
        path=str(path),
        attempt=site.attempt,
        weights_digest=hex64(vote.value) if vote.value is not None else "",
        param_names=keys,
        tensors=tensors,
        saved_by_rank=saver,
        agreeing_ranks=vote.agreeing,
        diverged_ranks=vote.diverged if blessed else tuple(range(site.world_size)),
        blessed=blessed and saver in vote.agreeing,
        saved_ns=time.time_ns(),
        path_from_trace=path_from_trace(site.trace_dir, path),
    )
    write_checkpoint_note(site.trace_dir, note)
    if site.injector:
        site.injector.corrupt_checkpoint_file(step, path)
    return note

