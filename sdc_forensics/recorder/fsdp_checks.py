"""Online checks for FSDP2 and HSDP jobs: the replicas of each shard, and the gathered parameters.

FSDP2 (``fully_shard``) keeps one shard of each parameter per rank, so the DDP recorder's
replica vote (every rank holds the same weights) has nothing to compare. Two checks do, from
inside any ``fully_shard`` training loop, two lines after ``optimizer.step()``::

    from sdc_forensics.recorder.fsdp_checks import check_shards
    result = check_shards(model)            # every rank calls it (it gathers)
    if result.suspects: ...                 # or check_shards(model, policy="raise")

* **HSDP** (a 2-D mesh ``(replicate, shard)``): the ranks of one shard coordinate hold the same
  shard, whatever the placement. Every rank digests its local shard of every parameter; the
  digests are gathered, and per parameter, within that parameter's own mesh's replica groups (a
  model may mix meshes), a strict majority across the replicas names the rank whose weights differ. With 2 replicas a difference is detected but not attributed (no majority),
  and the result says so; with 3 or more the odd one is named.
* **FSDP** (no replicas of a shard): :func:`check_gathered` all-gathers each parameter (every
  rank then holds the same full tensor), digests it on every rank and votes across all ranks. A
  rank whose gathered parameter differs from the majority received or holds it wrong (its
  receive path or its memory). A shard that was already wrong on its owner is gathered wrong by
  every rank alike: that is the replay's and the audits' case, not this vote's.

Cost: one pass of the digest over this rank's shards (``check_shards``) or over every full
parameter (``check_gathered``, plus the all-gather of the model, one parameter at a time, so
the memory peak is one full parameter), and one ``all_gather_object`` of ``P`` 64-bit digests per
rank. Both are collective: every rank must call them at the same point.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import SdcAlarm, UsageError
from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core, shards
from sdc_forensics.recorder import checks

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """Ranks that hold one parameter's shard (or gathered parameter) differently.

    Attributes:
        param: canonical parameter name.
        group: the ranks that should agree (one shard coordinate's replicas, or every rank).
        suspects: ranks outside the strict majority (empty when there is no majority).
        attributed: a strict majority existed, so ``suspects`` are named by a vote; False with
            2 replicas (or a tie): a difference is detected and nobody is blamed.
    """

    param: str
    group: tuple[int, ...]
    suspects: tuple[int, ...]
    attributed: bool
    # per suspect: host, device and mesh coordinates (:func:`rank_place`)
    where: tuple[str, ...] = ()

    def line(self) -> str:
        if self.attributed:
            places = self.where or ("",) * len(self.suspects)
            who = ", ".join(f"rank {r}" + (f" ({w})" if w else "") for r, w in zip(self.suspects, places))
            return f"{self.param}: {who} differ from the majority of ranks {list(self.group)}"
        return (
            f"{self.param}: ranks {list(self.group)} disagree and no strict majority exists "
            f"({len(self.group)} copies: detected, not attributed)"
        )


@dataclasses.dataclass(frozen=True)
class ShardCheck:
    """What :func:`check_shards` or :func:`check_gathered` found.

    Attributes:
        kind: ``"replicas"`` (HSDP shards across the replicate dimension) or ``"gathered"``.
        groups: the rank groups compared.
        disagreements: one per parameter and group that does not agree.
        note: a line when the check could compare nothing (one replica), else ``""``.
    """

    kind: str
    groups: tuple[tuple[int, ...], ...]
    disagreements: tuple[Disagreement, ...]
    note: str = ""

    @property
    def suspects(self) -> tuple[int, ...]:
        """Ranks named by a vote, over every parameter."""
        return tuple(sorted({r for d in self.disagreements if d.attributed for r in d.suspects}))

    @property
    def clean(self) -> bool:
        return not self.disagreements

    def lines(self) -> list[str]:
        return [d.line() for d in self.disagreements] or [self.note or f"{self.kind}: every group agrees"]


def rank_place(model: torch.nn.Module | None = None) -> str:
    """Where this rank runs, for a finding's line: ``host H, DEVICE[, mesh dim=coordinate ...]``."""
    import socket

    device, mesh = "cpu", None
    for param in model.parameters() if model is not None else ():
        device = str(param.device)
        mesh = getattr(param, "device_mesh", None)
        break
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    text = f"host {socket.gethostname()}, {device}"
    if mesh is not None and mesh.get_coordinate() is not None:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        text += ", mesh " + " ".join(f"{n}={c}" for n, c in zip(names, mesh.get_coordinate()))
    return text


def _dtensor_params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = list(model.named_parameters())
    plain = [name for name, p in named if not hasattr(p, "device_mesh")]
    if plain:
        raise UsageError(
            f"{len(plain)} parameter(s) are not sharded by fully_shard (first: {plain[0]}); "
            "call fully_shard on the model (and its blocks) before the checks"
        )
    return named


def _replicate_dim(param: torch.Tensor) -> int | None:
    """The mesh dimension a parameter is replicated over (HSDP), or None (FSDP: sharded only)."""
    for dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            return dim
    return None


def _gather_table(row: list[int], place: str) -> tuple[np.ndarray, list[str]]:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [place, row])
    # (W, P), (W,)
    return np.asarray([r for _, r in gathered], dtype=np.uint64), [p for p, _ in gathered]


def _vote_groups(
    table: np.ndarray, names: list[str], groups: list[tuple[int, ...]], places: list[str]
) -> list[Disagreement]:
    """Each parameter's column voted within each group (``checks.vote_within``, the recorder's
    one vote within groups): a group outside agreement gives one :class:`Disagreement`."""
    votes = [checks.vote_within(table[:, j], groups) for j in range(len(names))]
    found = []
    for g in range(len(groups)):
        for j, name in enumerate(names):
            group, majority = votes[j][g]
            if len(group) < 2 or not majority.diverged:
                continue
            if majority.value is None:
                found.append(Disagreement(name, group, (), False))
            else:
                found.append(
                    Disagreement(name, group, majority.diverged, True, tuple(places[r] for r in majority.diverged))
                )
    return found


def _finish(result: ShardCheck, policy: str, step: int) -> ShardCheck:
    _check_policy(policy)
    if policy == "raise" and not result.clean:
        where = f"step {step}: " if step >= 0 else ""
        rank = result.suspects[0] if len(result.suspects) == 1 else -1
        raise SdcAlarm(where + "; ".join(result.lines()), step=step, rank=rank, check=result.kind)
    return result


def check_shards(
    model: torch.nn.Module,
    *,
    policy: str = "return",
    step: int = -1,
    seed: int = C.DEFAULT_SEED,
    corrupt: Callable[[str, torch.Tensor], None] | None = None,
) -> ShardCheck:
    """Compares every shard with its replicas (HSDP); every rank calls it at the same point.

    Args:
        model: the ``fully_shard``-ed model (its parameters DTensors on a mesh with a replicate
            dimension for a vote; a 1-D FSDP mesh has no replicas and gives a note).
        policy: ``"return"`` the result, or ``"raise"`` :class:`~sdc_forensics.errors.SdcAlarm`
            on every rank when any group disagrees (its rank: the one suspect, else -1).
        step: the optimizer step, for the alarm's message (-1: not said).
        seed: the fingerprint seed.
        corrupt: fault drills only: called with ``(name, local shard)`` before digesting.

    Returns:
        A :class:`ShardCheck` whose groups are the replicas of each shard coordinate.
    """
    _check_policy(policy)
    named = _dtensor_params(model)
    mine = []
    for name, param in named:
        local = param.to_local()
        if corrupt is not None:
            corrupt(name, local)
        # replicas of a shard hold the same local tensor, whatever the placement: its plain digest compares them
        dim = _replicate_dim(param)
        group = tuple(int(r) for r in _mesh_group(param.device_mesh, dim)) if dim is not None else ()
        mine.append((shards.canonical_name(name), core.digest(local, seed), group))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [rank_place(model), mine])
    places = [place for place, _ in gathered]
    gathered = [rows for _, rows in gathered]
    names = [name for name, _, _ in mine]
    # (W, P)
    table = np.asarray([[d for _, d, _ in rank] for rank in gathered], dtype=np.uint64)
    per_param = [sorted({rank[j][2] for rank in gathered if rank[j][2]}) for j in range(len(names))]
    all_groups = tuple(sorted({g for groups in per_param for g in groups}))
    if not all_groups:
        return ShardCheck(
            "replicas",
            (),
            (),
            note="no replicate dimension (FSDP, not HSDP): no replica of a shard to compare; use check_gathered",
        )
    found = []
    # each parameter is voted within its own mesh's replica groups
    for j, groups in enumerate(per_param):
        found += _vote_groups(table[:, [j]], [names[j]], groups, places)
    return _finish(ShardCheck("replicas", all_groups, tuple(found)), policy, step)


def _check_policy(policy: str) -> None:
    if policy not in ("return", "raise"):
        raise UsageError(f"policy must be 'return' or 'raise', not {policy!r}")


def _mesh_group(mesh, dim: int) -> list[int]:
    """Global ranks of this rank's group along mesh dimension ``dim``."""
    coordinate = mesh.get_coordinate()
    index = [slice(None) if d == dim else coordinate[d] for d in range(mesh.ndim)]
    return mesh.mesh[tuple(index)].reshape(-1).tolist()


def check_gathered(
    model: torch.nn.Module,
    *,
    policy: str = "return",
    step: int = -1,
    seed: int = C.DEFAULT_SEED,
    corrupt: Callable[[str, torch.Tensor], None] | None = None,
) -> ShardCheck:
    """All-gathers each parameter, digests it on every rank and votes across all ranks.

    Args:
        model, policy, step, seed: as :func:`check_shards`.
        corrupt: fault drills only: called with ``(name, gathered full parameter)`` before digesting.

    Returns:
        A :class:`ShardCheck` with one group, every rank.
    """
    _check_policy(policy)
    named = _dtensor_params(model)
    names, row = [], []
    for name, param in named:
        with torch.no_grad():
            # every rank gathers the same full parameter
            full = param.full_tensor()
        if corrupt is not None:
            corrupt(name, full)
        names.append(shards.canonical_name(name))
        row.append(core.digest(full, seed))
        del full
    table, places = _gather_table(row, rank_place(model))
    group = tuple(range(dist.get_world_size()))
    return _finish(ShardCheck("gathered", (group,), tuple(_vote_groups(table, names, [group], places))), policy, step)


def sharded_state_digests(
    state,
    *,
    seed: int = C.DEFAULT_SEED,
    trusted: tuple[int, ...] | None = None,
    piece=None,
    disagreements: list | None = None,
) -> dict[str, str]:
    """``{key: hex digest}`` of every tensor of a sharded state, as if each were whole; no all-gather.

    Every rank calls it with its part of the same state (``{"model": model.state_dict(),
    "optim": ...}`` of a ``fully_shard`` job, before ``torch.distributed.checkpoint.save``). A
    DTensor's digest is combined from every rank's piece (``fingerprint/shards.py``: the pieces'
    terms, not their data, are gathered), so it equals ``core.digest`` of the full tensor: what
    ``verify-checkpoint`` measures on the DCP directory, and on any re-save of it with another
    sharding. HSDP replicas give the same piece once; replicas that differ raise
    :class:`~sdc_forensics.errors.SdcAlarm` naming the tensor. A plain tensor (every rank holds it
    whole, like a step counter) is digested where it is.

    ``trusted``: the ranks whose copies count (the recorder's weights vote: a replica that
    diverged is outvoted, not an error); where they hold a range, another rank's different copy
    is ignored, and the digest is theirs.

    ``piece``: ``piece(tensor) -> (index of its first element, numel, Piece)`` of a DTensor whose
    part is not one ``Shard(0)`` run (tensor parallelism: ``recorder/tp_checkpoint.py``).

    ``disagreements``: where given, two counted copies that differ do not raise: ``(key, first rank,
    other rank, first element, numel)`` is appended to it and the first rank's copy counts (a TP
    job's saver: ranks of different TP coordinates hold a replicated parameter alike, and a fault
    in one TP coordinate's reduction makes them differ, which the weights vote does not cover).

    Returns:
        The same mapping on every rank, keys as :func:`sdc_forensics.statedict.flatten_state` joins them.
    """
    from sdc_forensics.statedict import flatten_state
    from sdc_forensics.trace.checkpoints import hex64

    flat = flatten_state(state)
    mine: dict[str, list] = {}
    for key, tensor in flat.items():
        if hasattr(tensor, "device_mesh") and piece is not None:
            offset, numel, part = piece(tensor)
            mine[key] = ["piece", offset, numel, part.to_json()]
        elif hasattr(tensor, "device_mesh"):
            local, offset = shards.local_piece(tensor)
            mine[key] = [
                "piece",
                offset,
                local.numel(),
                shards.fingerprint_piece(local, offset=offset, seed=seed).to_json(),
            ]
        else:
            mine[key] = ["whole", hex64(core.digest(tensor, seed))]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out, differ = {}, []
    # every key some rank holds, in rank order (a pipeline job's stages hold different tensors)
    keys = list(dict.fromkeys(key for theirs in gathered for key in theirs))
    for key in keys:
        holders = [theirs for theirs in gathered if key in theirs]
        # every rank that holds it holds it whole: they must agree for a digest to stand
        if holders[0][key][0] == "whole":
            values = {theirs[key][1] for theirs in holders}
            if len(values) == 1:
                out[key] = values.pop()
            else:
                differ.append(key)
            continue
        pieces: dict[tuple[int, int], tuple[int, dict]] = {}
        order = list(range(len(gathered)))
        if trusted is not None:
            order = [r for r in order if r in trusted] + [r for r in order if r not in trusted]
        for rank in order:
            if key not in gathered[rank]:
                continue
            _, offset, numel, piece = gathered[rank][key]
            if not numel:
                continue
            held = pieces.setdefault((offset, numel), (rank, piece))
            if trusted is not None and held[0] in trusted and rank not in trusted:
                # an outvoted replica's copy
                continue
            # the digest's terms, not floats (NaN != NaN)
            if _exact(held[1]) != _exact(piece) and disagreements is not None:
                disagreements.append((key, held[0], rank, offset, numel))
            elif _exact(held[1]) != _exact(piece):
                raise SdcAlarm(
                    f"{key}: ranks {held[0]} and {rank} hold elements {offset}..{offset + numel - 1} differently "
                    "(replicas of one shard must be equal)",
                    step=-1,
                    rank=-1,
                    check="replicas",
                )
        parts = [shards.Piece.from_json(piece) for _, piece in pieces.values()]
        out[key] = hex64(shards.combine_pieces(parts).digest if parts else core.digest(torch.empty(0), seed))
    if differ:
        log.warning(
            "not digested: %d plain tensor(s) differ across ranks (each rank saves its own; DCP keeps one): %s",
            len(differ),
            ", ".join(differ[:5]) + (" ..." if len(differ) > 5 else ""),
        )
    return out


def _exact(piece: dict) -> tuple:
    return (
        tuple(piece["lanes"]),
        tuple(sorted((k, tuple(v)) for k, v in piece["edges"].items())),
        piece["num_bytes"],
        piece["numel"],
    )


def sharded_weights_digest(model: torch.nn.Module, *, seed: int = C.DEFAULT_SEED) -> int:
    """The DDP recorder's weights digest (``statedict.weights_digest``: the parameters' digests
    combined in model order) of a ``fully_shard`` model, from its shards; every rank calls it.

    Equal to what a DDP job of the same model records at the same weights, so an FSDP2 job's
    weights compare with a DDP trace's (and with a replay's on any number of devices).
    """
    named = list(model.named_parameters())
    digests = sharded_state_digests({shards.canonical_name(n): p for n, p in named}, seed=seed)
    return core.combine_digests(int(digests[shards.canonical_name(n)], 16) for n, _ in named)
