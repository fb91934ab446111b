"""A tensor-parallel job's checkpoint digests: each rank's box of every DTensor in the state.

``TpSaver`` is FSDP's ``checkpointing.ShardedSaver`` (DCP, every rank its part, the note rank 0
writes) with each DTensor's part placed as TP then FSDP placed it: :func:`box_of` reads the box
from the tensor's placements (``Shard(d)`` in mesh order, then FSDP2's ``_StridedShard``, which cuts
TP's slice), and its runs are digested at their global indices (``fingerprint/shards.box_runs``),
so the digest of each tensor is ``core.digest`` of the whole: what ``verify-checkpoint`` measures
on the DCP directory (a pipeline job's stages each hold their own tensors: ``pp_layout.py``). The parameters' boxes agree with ``ShardMesh.rank_box`` (tested), which the
recorder and the replay use.
"""

from __future__ import annotations

import torch

from sdc_forensics.fingerprint import shards
from sdc_forensics.recorder.checkpointing import ShardedSaver
from sdc_forensics.trace.mesh import shard_rows


def box_of(tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, offsets)`` of this rank's part of a DTensor sharded on one or more mesh
    dimensions; ValueError when its local tensor is not that box."""
    shape = tuple(tensor.shape)
    local, offsets = list(shape), [0] * len(shape)
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    coord = mesh.get_coordinate()
    # FSDP2's _StridedShard cuts what the other shardings left: applied last
    order = [i for i, p in enumerate(placements) if hasattr(p, "dim") and not hasattr(p, "split_factor")]
    order += [i for i, p in enumerate(placements) if hasattr(p, "dim") and hasattr(p, "split_factor")]
    for i in order:
        dim = placements[i].dim
        first, stop = shard_rows(local[dim], coord[i], mesh.size(i))
        offsets[dim] += first
        local[dim] = stop - first
    held = tuple(tensor.to_local().shape)
    if held != tuple(local):
        raise ValueError(f"a DTensor placed as {placements} holds {held} elements here, not the box {tuple(local)}")
    return tuple(local), tuple(offsets)


def box_piece(tensor, seed: int) -> tuple[int, int, shards.Piece]:
    """``(index of its first element, numel, Piece)`` of this rank's box of a DTensor."""
    box, at = box_of(tensor)
    runs = shards.box_runs(tuple(tensor.shape), box, at)
    values = tensor.to_local().detach()
    with torch.no_grad():
        piece = shards.merge_pieces(shards.box_pieces(values, runs, seed=seed))
    return (runs[0][2] if runs else 0), values.numel(), piece


class TpSaver(ShardedSaver):
    """``ShardedSaver`` with each DTensor digested by its box (see the module); ranks of different TP
    coordinates that hold a replicated parameter differently are reported, not raised."""

    reports_differences = True

    def save(self, site, step, path, state, save, vote):
        self.piece = lambda tensor: box_piece(tensor, site.seed)
        return super().save(site, step, path, state, save, vote)
