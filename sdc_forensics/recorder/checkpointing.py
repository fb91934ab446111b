"""Checkpoints through the recorder: one protocol (vote, save, note, record) and the two savers.

The order matters: the replicas' weight digests are compared *before* anything is written (the
comparison the step that wrote ``θ_N`` just made is reused, not repeated), the state is saved
from ranks of the strict majority, and the note holds the digests of the exact payload that was
handed to ``save`` (so later storage corruption of the file is visible to ``verify-checkpoint``).
Without a strict majority there is nothing trustworthy to save: policy ``raise`` saves nothing
(the CHECKPOINT record says it was refused, then the alarm is raised), ``continue`` saves it
unblessed.

:func:`save_checkpoint` is that protocol, written once for every layout. What differs is how a
layout writes its state, a :class:`Saver`:

* :class:`WholeFileSaver` (DDP: every rank holds the whole state): one rank of the majority
  writes one file (``torch.save`` by default) and notes the digests of what it wrote.
* :class:`ShardedSaver` (FSDP2/HSDP: each rank holds its shards): every rank writes its part with
  ``torch.distributed.checkpoint``; the state's tensors are digested as if whole
  (``fsdp_checks.sharded_state_digests``: the pieces' terms are gathered, not the data).

The recorder hands the protocol what it needs as one :class:`CheckpointSite` (its identity in
the group, its trace writer, the last weights vote, and functions: the rank's weights digest,
the weights vote, react to findings); this module never imports the recorder.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcError, UsageError
from sdc_forensics.fingerprint.core import combine_digests
from sdc_forensics.inject import Injector
from sdc_forensics.recorder import checks
from sdc_forensics.recorder.options import Policy
from sdc_forensics.statedict import flatten_state, state_digests
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import (
    CheckpointNote,
    climbs_then_descends,
    hex64,
    read_checkpoint_notes,
    unreplayable_steps,
    unreplayable_text,
    write_checkpoint_note,
)
from sdc_forensics.trace.writer import RankTraceWriter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Saved:
    """What a :class:`Saver` did, on every rank.

    Attributes:
        note: the checkpoint's note (None where this rank does not know it, or nothing was saved).
        saved_by: the rank whose state the note describes (the CHECKPOINT record's ``aux_rank``).
        digest: the CHECKPOINT record's ``aux_digest``: the majority's weights digest (a whole
            state) or the whole model's, combined from the shards (a sharded one).
        failure: one line when the save failed on some rank (every rank then raises it), else "".
        differ: one line when ranks that hold the same elements of a tensor (a TP job's replicated
            parameter across TP coordinates) held them differently: saved unblessed, and reported
            as a weights finding under the job's policy (the same on every rank), else "".
    """

    note: CheckpointNote | None = None
    saved_by: int = 0
    digest: int = 0
    failure: str = ""
    differ: str = ""


#: nothing saved: refused (no strict majority, policy ``raise``)
REFUSED = Saved()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSite:
    """What saving a checkpoint needs from the recorder (``Recorder.checkpoint`` builds it).

    Attributes:
        module: the model (``ddp_model.module``, or the ``fully_shard`` model): its parameters are
            found in the state.
        seed: the fingerprint seed.
        policy: the recorder's policy (``raise`` refuses a checkpoint without a strict majority).
        rank, world_size, group: this process in the data-parallel group.
        attempt: the attempt number noted with the checkpoint.
        trace_dir: the trace directory (the note is written under it).
        writer: this rank's trace writer: the CHECKPOINT record.
        injector: the fault injector (a test may corrupt the written file).
        last_weights_vote: ``(step, my_digest, vote)`` of the last weights comparison, or None.
        weights_digest: this rank's weights digest now (the layout's: whole, or its shard).
        vote: ``vote(step, my_digest)`` -> ``(findings, vote)``: the weights vote within the
            layout's replica groups (a collective).
        settled: told the rank's weights digest as the checkpoint saves it (a sharded layout
            checks the shard at rest against it when the next step begins).
        react: record findings as alarms (and raise under policy ``raise``).
        saver: how the layout writes its state.
    """

    module: torch.nn.Module
    seed: int
    policy: Policy
    rank: int
    world_size: int
    group: Any
    attempt: int
    trace_dir: Path
    writer: RankTraceWriter
    injector: Injector
    last_weights_vote: tuple[int, int, checks.Majority] | None
    weights_digest: Callable[[], int]
    vote: Callable[[int, int], tuple[list[checks.Finding], checks.Majority]]
    settled: Callable[[int], None]
    react: Callable[[list[checks.Finding]], None]
    saver: "Saver"


class Saver(abc.ABC):
    """How a layout writes its state and notes it (a collective: every rank calls :meth:`save`)."""

    @abc.abstractmethod
    def save(
        self,
        site: CheckpointSite,
        step: int,
        path: Path,
        state: Any,
        save: Callable[[Any, Path], None] | None,
        vote: checks.Majority,
    ) -> Saved:
        """Write ``state`` to ``path`` (with ``save(state, path)`` when given), note its digests
        under the trace directory and say what was done; ``vote`` is the weights vote (its value
        None: no strict majority, the checkpoint is saved unblessed). Never raises for a failed
        save: every rank must learn it, so it comes back in :attr:`Saved.failure`."""


def save_checkpoint(
    site: CheckpointSite, step: int, path: Path, state: Any, save: Callable[[Any, Path], None] | None
) -> CheckpointNote | None:
    """Compare the replicas' weights, save ``state`` through ``site.saver``, note it and record
    it (a collective; see ``Recorder.checkpoint``)."""
    last = site.last_weights_vote
    # theta_step was just compared (and any alarm raised): the vote is reused
    if last is not None and last[0] == step - 1:
        _, my_digest, vote = last
        findings: list[checks.Finding] = []
    else:
        my_digest = site.weights_digest()
        # theta_step was written by step - 1
        findings, vote = site.vote(max(step - 1, 0), my_digest)
    site.settled(my_digest)
    blessed = vote.value is not None
    refuse = not blessed and site.policy == Policy.RAISE
    saved = REFUSED if refuse else site.saver.save(site, step, path, state, save, vote)
    record = site.writer.new(F.Kind.CHECKPOINT, step)
    record["weights_digest"] = my_digest % (1 << 64)
    record["aux_digest"] = saved.digest % (1 << 64)
    record["aux_rank"] = saved.saved_by
    record["flags"] = int(F.Flag.WEIGHTS_CHECKED) | (
        0 if blessed else int(F.Flag.CHECKPOINT_REFUSED | F.Flag.NO_MAJORITY)
    )
    if site.rank in vote.diverged and blessed:
        record["flags"] |= int(F.Flag.WEIGHTS_DIVERGED)
    site.writer.append(record)
    if saved.failure:
        raise SdcError(saved.failure)
    if saved.differ:
        # theta_step, which the differing copies hold, was written by step - 1
        finding = checks.Finding(check=checks.Check.WEIGHTS, step=max(step - 1, 0), rank=-1, detail=saved.differ)
        findings = [*findings, finding]
    if findings:
        site.react(findings)
    return saved.note


def warn_unreplayable(trace_dir: Path, first: int, step: int) -> None:
    """Say, at the attempt's first checkpoint (``step``; the attempt began at ``first``), when the
    steps before it can never be replayed: checkpoint ``N`` holds the state after ``N`` steps, so
    without a checkpoint of the attempt's first step nothing before ``N`` can be re-executed and no
    checkpoint of the run can be certified clean. (The recorder does not save the initial state
    itself: it knows neither where nor how the job saves, and a note without its file certifies
    nothing.)"""
    if step <= first:
        return
    # a resumed attempt's start, saved earlier
    try:
        noted = {note.step for note in read_checkpoint_notes(trace_dir)}
    except SdcError:
        noted = set()
    gap = unreplayable_steps(first, noted | {step})
    if gap is not None:
        log.warning("sdc-forensics: %s", unreplayable_text(gap))


def param_keys(named_params: list[tuple[str, torch.Tensor]], state: Any) -> tuple[str, ...]:
    """The key of every parameter inside the flattened payload, in ``named_parameters`` order.

    A parameter is found by storage (``model.state_dict()`` shares it; a sharded parameter has
    no storage of its own to compare), else by the one key ending in its name (a payload of
    copies: ``model.0.weight`` for ``0.weight``); where several end in it (``norm.weight`` also ends
    ``model.attn.norm.weight``), the one under a top-level key.
    """
    flat = flatten_state(state)
    by_storage = {
        (t.data_ptr(), tuple(t.shape), t.dtype): key for key, t in flat.items() if t.numel() and not _sharded(t)
    }
    keys = []
    for name, param in named_params:
        key = (
            by_storage.get((param.data_ptr(), tuple(param.shape), param.dtype))
            if param.numel() and not _sharded(param)
            else None
        )
        if key is None:
            matches = [k for k in flat if k == name or k.endswith("." + name)]
            if len(matches) > 1:
                matches = [k for k in matches if k == name or "." not in k[: -len(name) - 1]]
            if len(matches) != 1:
                raise UsageError(
                    f"the checkpoint state does not hold parameter {name!r} (or holds it ambiguously); "
                    "pass a state built from model.state_dict() so the recorder can note the weights digest"
                )
            key = matches[0]
        keys.append(key)
    return tuple(keys)


def _sharded(tensor: torch.Tensor) -> bool:
    """A DTensor (its data pointer is not its own: compared by name only)."""
    return hasattr(tensor, "device_mesh")


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


class WholeFileSaver(Saver):
    """Every rank holds the whole state (DDP): one rank of the majority (rank 0 when it is in it)
    writes one file and notes the digests of the payload it wrote; the others learn the outcome."""

    def save(self, site, step, path, state, save, vote) -> Saved:
        blessed = vote.value is not None
        saver = 0 if (not blessed or 0 in vote.agreeing) else vote.agreeing[0]
        outcome: list = [None]
        if site.rank == saver:
            try:
                outcome = [_save_and_note(site, step, path, state, save, vote, saver)]
            except Exception as exc:  # noqa: BLE001 - every rank must learn that the save failed
                outcome = [f"{type(exc).__name__}: {exc}"]
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(site.group, saver), group=site.group)
        if isinstance(outcome[0], str):
            return Saved(
                saved_by=saver,
                digest=vote.value or 0,
                failure=f"checkpoint {step} could not be saved to {path} by rank {saver}: {outcome[0]}",
            )
        return Saved(note=outcome[0], saved_by=saver, digest=vote.value or 0)


def _save_and_note(
    site: CheckpointSite, step: int, path: Path, state: Any, save, vote: checks.Majority, saver: int
) -> CheckpointNote:
    """The saving rank's part of :class:`WholeFileSaver`: digest the payload, write it, note it."""
    blessed = vote.value is not None
    keys = param_keys(list(site.module.named_parameters()), state)
    # of the payload, before it is written
    tensors = state_digests(state, site.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the recorder writes the file itself: never over one (an earlier attempt's evidence, its note)
    if save is None:
        free = unused_path(path)
        if free != path:
            log.warning(
                "sdc-forensics: %s exists (an earlier attempt's checkpoint); checkpoint %d is saved as %s",
                path,
                step,
                free.name,
            )
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


class ShardedSaver(Saver):
    """Each rank holds its shards (FSDP2/HSDP): every rank writes its part with
    ``torch.distributed.checkpoint`` (or ``save(state, path)``); the state is digested as if whole,
    counting the copies of the majority's replicas (``replica_groups``: the lowest rank of each
    group when there is no majority); rank 0 writes the note, which every rank returns."""

    #: ``fsdp_checks.sharded_state_digests``'s ``piece`` (None: FSDP2's one ``Shard(0)`` run per rank)
    piece = None
    #: copies that differ outside the weights vote are reported (``Saved.differ``), not raised (TP)
    reports_differences = False

    def __init__(
        self, replica_groups: list[tuple[int, ...]], stage_parts: tuple[tuple[int, int, int], ...] = ()
    ) -> None:
        self.replica_groups = replica_groups
        # a pipeline job: per stage, in stage order, a rank holding it and the span of its parameters among
        # that rank's (a rank holds its stages' parameters only; several stages under an interleaved schedule)
        self.stage_parts = stage_parts

    def save(self, site, step, path, state, save, vote) -> Saved:
        from sdc_forensics.recorder.fsdp_checks import sharded_state_digests

        blessed = vote.value is not None
        # a collective, before the files exist; an outvoted replica's copies do not count, and
        # without a majority the lowest rank's count (the checkpoint is then not blessed)
        trusted = vote.agreeing if blessed else tuple(g[0] for g in self.replica_groups)
        differ: list | None = [] if self.reports_differences else None
        tensors = sharded_state_digests(state, seed=site.seed, trusted=trusted, piece=self.piece, disagreements=differ)
        if differ:
            # the same on every rank (computed from the gathered pieces): not a checkpoint to resume from
            blessed = False
            key, first, other, at, numel = differ[0]
            differ_line = (
                f"checkpoint {step}: {key}: ranks {first} and {other} hold elements {at}..{at + numel - 1} "
                f"differently ({len(differ)} such tensor part(s)); saved, not blessed"
            )
        else:
            differ_line = ""
        keys = param_keys(list(site.module.named_parameters()), state)
        if self.stage_parts:
            # the whole model's parameters: every stage's, in stage order
            every: list = [None] * site.world_size
            dist.all_gather_object(every, keys, group=site.group)
            keys = tuple(key for rank, start, stop in self.stage_parts for key in every[rank][start:stop])
        whole = combine_digests(int(tensors[key], 16) for key in keys)
        failure = ""
        try:
            if save is not None:
                save(state, path)
            else:
                import torch.distributed.checkpoint as dcp

                dcp.save(state, checkpoint_id=str(path))
        except Exception as exc:  # noqa: BLE001 - every rank must learn that the save failed
            failure = f"rank {site.rank}: {type(exc).__name__}: {exc}"
        failures: list = [None] * site.world_size
        dist.all_gather_object(failures, failure, group=site.group)
        failed = next((f for f in failures if f), "")
        if site.rank == 0 and not failed:
            # a framework's own file beside the DCP shards (Lightning's meta.pt): noted as written
            try:
                tensors = {**_beside(path, tensors, site.seed), **tensors}
            except Exception as exc:  # noqa: BLE001 - the note is still right for the state; verify then lists the file
                log.warning(
                    "sdc-forensics: checkpoint %s: the files beside its DCP shards were not read back: %s", path, exc
                )
        note = CheckpointNote(
            step=step,
            path=str(path),
            attempt=site.attempt,
            weights_digest=hex64(whole),
            param_names=keys,
            tensors=tensors,
            saved_by_rank=0,
            agreeing_ranks=vote.agreeing,
            diverged_ranks=vote.diverged,
            blessed=blessed,
            saved_ns=time.time_ns(),
            path_from_trace=path_from_trace(site.trace_dir, path),
        )
        if site.rank == 0 and not failed:
            write_checkpoint_note(site.trace_dir, note)
        if failed:
            return Saved(saved_by=0, digest=whole, failure=f"checkpoint {step} could not be saved to {path}: {failed}")
        return Saved(note=note, saved_by=0, digest=whole, differ=differ_line)


def _beside(path: Path, tensors: dict[str, str], seed: int) -> dict[str, str]:
    """``{key: hex}`` of the tensors ``verify-checkpoint`` reads in the saved directory that the
    state did not hold: a file a framework writes beside the shards (Lightning's ``meta.pt``, with
    its loops' and callbacks' state), read back by rank 0 right after the save."""
    from sdc_forensics.checkpoint.formats import open_checkpoint

    if not path.is_dir():
        return {}
    reader = open_checkpoint(path)
    try:
        extra = {key: tensor for key, tensor in reader.tensors() if key not in tensors}
        return state_digests(extra, seed) if extra else {}
    finally:
        reader.close()


def site_of(rec, vote: Callable, react: Callable) -> CheckpointSite:
    """What :func:`save_checkpoint` needs of the recorder ``rec`` (``Recorder.checkpoint``), with its
    replica vote and its reaction to findings."""
    return CheckpointSite(
        module=rec.module,
        seed=rec.options.seed,
        policy=rec.options.policy,
        rank=rec.rank,
        world_size=rec.world_size,
        group=rec.group,
        attempt=rec.attempt,
        trace_dir=rec.trace_dir,
        writer=rec.writer,
        injector=rec.injector,
        last_weights_vote=rec.last_weights_vote,
        weights_digest=lambda: rec.layout.weights()[0],
        vote=vote,
        settled=rec.layout.settled,
        react=react,
        saver=rec.layout.saver(),
    )
