"""Fingerprints that add across shards: a tensor fingerprinted piece by piece gives the whole.

An FSDP2 rank holds a shard of each parameter (``Shard(0)``: a run of rows, uneven where
``torch.chunk`` is, the padding not part of it), a DDP bucket holds views of whole parameters at
offsets of its own, a DCP checkpoint holds chunks, and a replay on fewer devices shards again.
For their fingerprints to be compared, every element's terms must depend on *which element of
which parameter* it is, never on where the element sits in some flat buffer. Here they do:

* **The layout** (:class:`ParamLayout`) places the model's parameters, in the model's order, each
  padded to whole blocks, in one virtual vector. Parameter ``p`` starts at digest block
  ``D_p`` (4096 bytes) and sketch block ``S_p`` (1024 elements). Element ``g`` of the flattened
  full parameter then has the terms of element ``g`` of a tensor fingerprinted with
  ``digest_block_offset = D_p`` and ``block_offset = S_p`` (``docs/fingerprints.md``). The layout
  is keyed by the parameter's name with wrapper prefixes removed (``module.``,
  ``_fsdp_wrapped_module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``), so DDP, FSDP2
  and an unwrapped replay of one model share it.
* **A piece** (:func:`fingerprint_piece`): the elements ``[offset, offset + n)`` of one parameter.
  The piece's whole aligned chunks (``A`` elements: 1024, or one digest block where that is more,
  so both block kinds align) go through :func:`core.fingerprint_async` with the two block offsets,
  in one read: the same compiled kernels, no copy. Its cut ends (at most one chunk each, the
  part before its first and after its last chunk boundary) are fingerprinted on their own, zero
  padded in place, and their digest block sums ``s_j, t_j`` (mod 2**32) are kept per block:
  the lane totals multiply ``s_j`` by ``c_j`` only after a block's pieces are added, since
  ``c_j (s + s') != c_j s + c_j s'`` once ``s + s'`` wraps.
* **Combining** (:func:`combine_pieces`): lane totals add (mod 2**64), cut blocks add their sums
  (mod 2**32) and then enter the lanes, lengths add, and the digest is finished once:
  ``D = fmix64(low + 2**32 high + c_len * N)``. Sketches and squared norms add, max |x| and
  NaN/Inf counts combine as in :func:`core.combine`.

So, exactly (tested): the pieces of one parameter, however cut, combine to
``core.fingerprint(parameter)``'s digest (its layout offsets 0); the pieces of a whole model
combine to the same digest whatever the sharding, bucketing, padding or world size; and the
sketch is the same linear function, equal up to the float32 rounding of its block sums
(``8 * 2**-24 * sqrt(1024) * ||x||`` per coordinate, the bound ``tests/fingerprint`` uses).

Over 400 lines on purpose: the layout, a piece's body and cut ends (numpy on CPU, tensor ops on a
device) and their combination are one arithmetic; split, the block-sum rule that makes the digest
exact would be spread over modules that each look correct alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np
import torch

from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint import core, cpu_kernel
from sdc_forensics.fingerprint.core import Fingerprint

_BLOCK_BYTES = 4 * C.BLOCK_WORDS
_MASK32 = 0xFFFF_FFFF
_MASK64 = (1 << 64) - 1
#: wrapper prefixes that DDP, FSDP1, torch.compile and activation checkpointing put in names
_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"})


def canonical_name(name: str) -> str:
    """A parameter's name with the wrappers' path components removed (``module.0.weight`` -> ``0.weight``)."""
    parts = name.split(".")
    # DDP (and DataParallel) put the model under "module"
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _WRAPPER_COMPONENTS)


def align_elems(itemsize: int) -> int:
    """Elements per chunk at which both sketch blocks (1024 elements) and digest blocks (4096 bytes) align."""
    return max(C.BLOCK_ELEMS, _BLOCK_BYTES // itemsize)


def digest_blocks(numel: int, itemsize: int) -> int:
    """Digest blocks a parameter occupies in the layout (at least one)."""
    return max(1, -(-numel * itemsize // _BLOCK_BYTES))


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """The model's parameters in order, each at whole-block offsets of one virtual vector.

    Attributes:
        names: canonical names (:func:`canonical_name`), in the model's order.
        numels: elements of each full (unsharded) parameter.
        itemsizes: bytes per element of each.
    """

    names: tuple[str, ...]
    numels: tuple[int, ...]
    itemsizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.numels) == len(self.itemsizes)):
            raise ValueError("a layout needs one numel and one itemsize per name")
        if len(set(self.names)) != len(self.names):
            raise ValueError("a layout's parameter names must be unique")
        digest, sketch, bases = 0, 0, {}
        for name, numel, itemsize in zip(self.names, self.numels, self.itemsizes):
            bases[name] = (digest, sketch)
            digest += digest_blocks(numel, itemsize)
            sketch += core.num_sketch_blocks(numel)
        object.__setattr__(self, "_bases", bases)

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]], numels: dict[str, int] | None = None) -> ParamLayout:
        """The layout of ``model.named_parameters()`` (full sizes from ``numels`` or the tensors;
        a DTensor's full size is its global one)."""
        names, sizes, items = [], [], []
        for name, tensor in named:
            key = canonical_name(name)
            names.append(key)
            sizes.append(int(numels[key]) if numels and key in numels else int(tensor.numel()))
            items.append(int(tensor.element_size()))
        return cls(tuple(names), tuple(sizes), tuple(items))

    def bases(self, name: str) -> tuple[int, int]:
        """``(digest block, sketch block)`` where parameter ``name`` starts."""
        try:
            return self._bases[canonical_name(name)]  # type: ignore[attr-defined]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in the layout") from None

    def to_json(self) -> dict:
        return {"names": list(self.names), "numels": list(self.numels), "itemsizes": list(self.itemsizes)}

    @classmethod
    def from_json(cls, doc: dict) -> ParamLayout:
        return cls(
            tuple(str(n) for n in doc["names"]),
            tuple(int(n) for n in doc["numels"]),
            tuple(int(n) for n in doc["itemsizes"]),
        )


@dataclasses.dataclass(frozen=True)
class Piece:
    """The fingerprint terms of one piece of a tensor, to be added with its other pieces.

    Attributes:
        lanes: lane totals over the digest blocks the piece holds whole (mod 2**64).
        edges: ``global digest block -> (s_j, t_j)`` (mod 2**32) for blocks its ends cut.
        num_bytes, numel: of the piece.
        sketch: ``(k,)`` the piece's terms of the sketch (zeros for a non-float tensor).
        sumsq, max_abs, nonfinite: stats of the piece's elements.
        seed: the fingerprint seed.
    """

    lanes: tuple[int, int]
    edges: dict[int, tuple[int, int]]
    num_bytes: int
    numel: int
    sketch: np.ndarray
    sumsq: float
    max_abs: float
    nonfinite: int
    seed: int

    def to_json(self) -> dict:
        return {
            "lanes": [f"{self.lanes[0]:016x}", f"{self.lanes[1]:016x}"],
            "edges": {str(j): [s, t] for j, (s, t) in sorted(self.edges.items())},
            "num_bytes": self.num_bytes,
            "numel": self.numel,
            "sketch": [float(v) for v in self.sketch],
            "sumsq": self.sumsq,
            "max_abs": self.max_abs,
            "nonfinite": self.nonfinite,
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, doc: dict) -> Piece:
        return cls(
            lanes=(int(doc["lanes"][0], 16), int(doc["lanes"][1], 16)),
            edges={int(j): (int(s) & _MASK32, int(t) & _MASK32) for j, (s, t) in doc["edges"].items()},
            num_bytes=int(doc["num_bytes"]),
            numel=int(doc["numel"]),
            sketch=np.asarray(doc["sketch"], dtype=np.float64),
            sumsq=float(doc["sumsq"]),
            max_abs=float(doc["max_abs"]),
            nonfinite=int(doc["nonfinite"]),
            seed=int(doc["seed"]),
        )


def _empty(k: int, seed: int) -> Piece:
    return Piece(
        lanes=(0, 0), edges={}, num_bytes=0, numel=0, sketch=np.zeros(k), sumsq=0.0, max_abs=0.0, nonfinite=0, seed=seed
    )


def _merge(parts: list[Piece]) -> Piece:
    """The terms of several pieces together, lanes and cut blocks kept apart (see :func:`combine_pieces`)."""
    if len(parts) == 1:
        return parts[0]
    low = sum(p.lanes[0] for p in parts) & _MASK64
    high = sum(p.lanes[1] for p in parts) & _MASK64
    edges: dict[int, tuple[int, int]] = {}
    for part in parts:
        for j, (s, t) in part.edges.items():
            s0, t0 = edges.get(j, (0, 0))
            edges[j] = ((s0 + s) & _MASK32, (t0 + t) & _MASK32)
    maxes = [p.max_abs for p in parts if p.numel]
    # NaN wins (as np.max)
    max_abs = (math.nan if any(math.isnan(m) for m in maxes) else float(max(maxes))) if maxes else 0.0
    # row after row, as np.sum(..., axis=0) adds them: the same bits, without stacking
    sketch = np.array(parts[0].sketch, dtype=np.float64)
    for part in parts[1:]:
        sketch += part.sketch
    return Piece(
        lanes=(low, high),
        edges=edges,
        num_bytes=sum(p.num_bytes for p in parts),
        numel=sum(p.numel for p in parts),
        sketch=sketch,
        sumsq=float(sum(p.sumsq for p in parts)),
        max_abs=max_abs,
        nonfinite=sum(p.nonfinite for p in parts),
        seed=parts[0].seed,
    )


def _words_and_floats(values: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """A CPU tensor's raw bytes and, for a float tensor, its values in float64 (numpy, no copy of the bytes)."""
    raw = core._raw_bytes(values).numpy()
    floats = values.detach().reshape(-1).to(torch.float64).numpy() if values.is_floating_point() else None
    return raw, floats


def _end_numbers_numpy(
    values: torch.Tensor, pos: int, align: int, first_elem: int, sketch_base: int, k: int, seed: int
):
    """:func:`_end_numbers_torch` in numpy for a CPU tensor: microseconds, where torch's ops cost tens each."""
    raw, floats = _words_and_floats(values)
    itemsize = values.element_size()
    chunk = np.zeros(align * itemsize, dtype=np.uint8)
    chunk[pos * itemsize : pos * itemsize + raw.size] = raw
    signed = chunk.view("<i4").reshape(-1, C.BLOCK_WORDS)
    a = C.digest_word_weights(seed).view(np.uint32)
    b = C.digest_high_weights(seed).view(np.uint32)
    with np.errstate(over="ignore"):
        # wraps mod 2**32
        low = (signed.view("<u4") * a).sum(axis=1, dtype=np.uint32)
        high = ((signed >> 16).astype(np.uint32) * b).sum(axis=1, dtype=np.uint32)
    numbers = [low.astype(np.float64), high.astype(np.float64)]
    if floats is not None:
        x = np.zeros(align)
        x[pos : pos + floats.size] = floats
        x = x.reshape(-1, C.BLOCK_ELEMS)
        first_sketch = sketch_base + first_elem // C.BLOCK_ELEMS
        # the kernel's cached tables (the same numbers as C.sketch_block_signs_at and
        # C.sketch_in_block_signs): a step cuts hundreds of ends, each drew its rows anew
        beta = cpu_kernel._beta(first_sketch + x.shape[0], k, seed, np.float32)[first_sketch:]
        sketch = ((x @ cpu_kernel._alpha(k, seed)) * beta).sum(axis=0)
        with np.errstate(over="ignore", invalid="ignore"):
            stats = [np.dot(floats, floats), np.max(np.abs(floats)), np.count_nonzero(~np.isfinite(floats))]
        numbers += [sketch, np.asarray(stats, dtype=np.float64)]
    return np.concatenate(numbers), signed.shape[0]


def _end_numbers_torch(
    values: torch.Tensor, pos: int, align: int, first_elem: int, sketch_base: int, k: int, seed: int
):
    """``[s_j.., t_j.., sketch(k), sumsq, max_abs, nonfinite]`` of a cut end on its device, one transfer."""
    device = values.device
    chunk = torch.zeros(align, dtype=values.dtype, device=device)
    chunk[pos : pos + values.numel()] = values
    # (digest blocks, 1024)
    words = core._raw_bytes(chunk).view(torch.int32).view(-1, C.BLOCK_WORDS)
    a = core._cached(("a", device, seed), lambda: torch.from_numpy(C.digest_word_weights(seed)).to(device))
    b = core._cached(("b", device, seed), lambda: torch.from_numpy(C.digest_high_weights(seed)).to(device))
    # wraps mod 2**32, as core._Digester
    low = (words * a).sum(dim=1, dtype=torch.int32)
    high = (torch.bitwise_right_shift(words, 16) * b).sum(dim=1, dtype=torch.int32)
    # int32 values are exact in float64
    numbers = [low.to(torch.float64), high.to(torch.float64)]
    if values.is_floating_point():
        # (sketch blocks, 1024)
        x = chunk.to(torch.float64).view(-1, C.BLOCK_ELEMS)
        first_sketch = sketch_base + first_elem // C.BLOCK_ELEMS
        # (1024, k)
        alpha = core._alpha(device, k, seed, torch.float64)
        beta = torch.from_numpy(C.sketch_block_signs_at(np.arange(first_sketch, first_sketch + x.shape[0]), k, seed))
        sketch = ((x @ alpha) * beta.to(device=device, dtype=torch.float64)).sum(dim=0)
        v = values.reshape(-1).to(torch.float64)
        numbers += [
            sketch,
            (v * v).sum().reshape(1),
            v.abs().max().reshape(1),
            (~torch.isfinite(v)).sum().to(torch.float64).reshape(1),
        ]
    return torch.cat(numbers).cpu().numpy(), words.shape[0]


def _padded_piece(
    values: torch.Tensor, pos: int, align: int, first_elem: int, digest_base: int, sketch_base: int, k: int, seed: int
) -> Piece:
    """A cut end: ``values`` placed at ``pos`` of a zeroed chunk of ``align`` elements whose first
    element is element ``first_elem`` of the parameter; its digest blocks kept as sums.

    Under one chunk (at most 4096 elements): numpy on CPU, a few tensor ops and one transfer of
    ``2 * blocks + k + 3`` numbers elsewhere; cheaper than the kernels' set-up for so little.
    """
    device, itemsize = values.device, values.element_size()
    # the numbers fingerprint_pieces gives the same end (one compiled path for both)
    if device.type == "cpu" and cpu_kernel.available()[0]:
        return _batched_ends([(values.reshape(-1), pos, first_elem, digest_base, sketch_base)], align, k, seed)[0]
    if device.type == "cpu":
        host, blocks = _end_numbers_numpy(values, pos, align, first_elem, sketch_base, k, seed)
    else:
        host, blocks = _end_numbers_torch(values, pos, align, first_elem, sketch_base, k, seed)
    first_block = digest_base + first_elem * itemsize // _BLOCK_BYTES
    edges = {first_block + i: (int(host[i]) & _MASK32, int(host[blocks + i]) & _MASK32) for i in range(blocks)}
    if values.is_floating_point():
        tail = host[2 * blocks :]
        sketch, sumsq, max_abs, nonfinite = tail[:k].copy(), float(tail[k]), float(tail[k + 1]), int(tail[k + 2])
    else:
        sketch, sumsq, max_abs, nonfinite = np.zeros(k), 0.0, 0.0, 0
    return Piece(
        lanes=(0, 0),
        edges=edges,
        num_bytes=values.numel() * itemsize,
        numel=values.numel(),
        sketch=sketch,
        sumsq=sumsq,
        max_abs=max_abs,
        nonfinite=nonfinite,
        seed=seed,
    )


def fingerprint_piece(
    values: torch.Tensor,
    *,
    offset: int = 0,
    digest_base: int = 0,
    sketch_base: int = 0,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
) -> Piece:
    """The terms of elements ``[offset, offset + numel)`` of a flattened parameter.

    Args:
        values: the piece (any shape; flattened in row-major order), on any device.
        offset: index of its first element in the flattened full parameter.
        digest_base, sketch_base: where the parameter starts in the layout (:meth:`ParamLayout.bases`).
        k, seed: the fingerprint settings.

    Returns:
        A :class:`Piece`; :func:`combine_pieces` of all pieces of a parameter (or a model) is
        its fingerprint.
    """
    offset, digest_base, sketch_base = int(offset), int(digest_base), int(sketch_base)
    if offset < 0 or digest_base < 0 or sketch_base < 0:
        raise ValueError(
            f"offsets must be >= 0 (got offset={offset}, digest_base={digest_base}, sketch_base={sketch_base})"
        )
    flat = values.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return _empty(k, seed)
    align = align_elems(flat.element_size())
    head = min(n, (-offset) % align)
    body = (n - head) // align * align
    parts = []
    if head:
        parts.append(
            _padded_piece(
                flat[:head], offset % align, align, offset - offset % align, digest_base, sketch_base, k, seed
            )
        )
    if body:
        # a chunk boundary: both block kinds align
        start = offset + head
        middle = flat[head : head + body]
        itemsize = flat.element_size()
        if middle.is_floating_point():
            fp = core.fingerprint(
                middle,
                k=k,
                seed=seed,
                block_offset=sketch_base + start // C.BLOCK_ELEMS,
                digest_block_offset=digest_base + start * itemsize // _BLOCK_BYTES,
            )
            sketch, sumsq, max_abs, nonfinite = fp.sketch, fp.norm**2, fp.max_abs, fp.nonfinite
            lanes = fp.lanes
        else:
            raw = core._raw_bytes(middle)
            digester = core._Digester(raw.numel(), raw.device, seed, max(1, raw.numel() // _BLOCK_BYTES))
            digester.add(0, raw)
            low, high = digester.lane_totals(digest_base + start * itemsize // _BLOCK_BYTES).tolist()
            lanes = (low & _MASK64, high & _MASK64)
            sketch, sumsq, max_abs, nonfinite = np.zeros(k), 0.0, 0.0, 0
        parts.append(
            Piece(
                lanes=lanes,
                edges={},
                num_bytes=body * itemsize,
                numel=body,
                sketch=sketch,
                sumsq=float(sumsq),
                max_abs=float(max_abs),
                nonfinite=int(nonfinite),
                seed=seed,
            )
        )
    tail = n - head - body
    if tail:
        first = offset + head + body
        parts.append(_padded_piece(flat[head + body :], 0, align, first, digest_base, sketch_base, k, seed))
    return _merge(parts)


def combine_pieces(parts: Iterable[Piece]) -> Fingerprint:
    """The fingerprint of everything the pieces hold: one parameter's shards, or a whole model's.

    The digest is finished once over all of them; a piece must not be given twice (two ranks'
    copies of one replicated shard are compared, not combined).
    """
    parts = list(parts)
    if not parts:
        raise ValueError("combine_pieces() needs at least one piece")
    if len({p.seed for p in parts}) > 1:
        raise ValueError("pieces fingerprinted with different seeds do not combine")
    merged = _merge(parts)
    seed = merged.seed
    low, high = merged.lanes
    if merged.edges:
        blocks = np.fromiter(merged.edges, dtype=np.uint64, count=len(merged.edges))
        c = C.digest_block_weights_at(blocks, seed)
        c_high = C.digest_block_weights_at(blocks, seed, high=True)
        for (s, t), cj, chj in zip(merged.edges.values(), c.tolist(), c_high.tolist()):
            low = (low + cj * s) & _MASK64
            high = (high + chj * t) & _MASK64
    digest = core._finish_digest(low, high, merged.num_bytes, seed)
    return Fingerprint(
        digest=digest,
        sketch=merged.sketch,
        norm=float(np.sqrt(merged.sumsq)),  # NaN stays NaN, Inf Inf, as core
        max_abs=merged.max_abs,
        nonfinite=merged.nonfinite,
        numel=merged.numel,
        lanes=(low, high),
    )


def one_bucket(pieces: list[Piece]) -> Fingerprint | None:
    """The pieces' whole as a DDP trace's gradient of one bucket (``combine_digests`` of its one
    digest): what a sharded recorder writes as a rank's ``local_*`` (None: no pieces)."""
    if not pieces:
        return None
    whole = combine_pieces(pieces)
    return Fingerprint(
        digest=core.combine_digests([whole.digest]),
        sketch=whole.sketch,
        norm=whole.norm,
        max_abs=whole.max_abs,
        nonfinite=whole.nonfinite,
        numel=whole.numel,
    )


def local_piece(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(this rank's elements, index of the first in the flattened full tensor)`` of a parameter.

    A plain tensor is whole (offset 0). A DTensor gives its local shard and that shard's global
    offset: FSDP2's ``Shard(0)`` (uneven ``torch.chunk`` splits included, its padding not part of
    the local tensor), and HSDP's ``(Replicate(), Shard(0))``, whose replicas each give the same
    piece (combine the pieces of one replica, compare the replicas). Any other placement (a shard
    of dimension 1 or later is not one run of the flattened tensor) raises ValueError.
    """
    to_local = getattr(tensor, "to_local", None)
    placements = getattr(tensor, "placements", None)
    if to_local is None or placements is None:
        return tensor.detach(), 0
    local = to_local().detach()
    sharded = [p for p in placements if hasattr(p, "dim")]
    if not sharded:
        return local, 0
    if any(p.dim != 0 for p in sharded) or len(sharded) > 1:
        raise ValueError(
            f"a parameter placed as {tuple(placements)} is not one run of its flattened elements: "
            "only Shard(0) (FSDP2's default) and Replicate are supported"
        )
    # private in torch 2.x; the feature, not the version, decides
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - older torch
        compute_local_shape_and_global_offset = None
    if compute_local_shape_and_global_offset is not None:
        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
        row = int(offsets[0]) if len(offsets) else 0
    else:  # pragma: no cover - torch.chunk's split, as Shard(0) uses
        mesh_dim = next(i for i, p in enumerate(placements) if hasattr(p, "dim"))
        size = tensor.device_mesh.size(mesh_dim)
        coord = tensor.device_mesh.get_coordinate()[mesh_dim]
        row = min(coord * -(-tensor.shape[0] // size), tensor.shape[0])
    per_row = math.prod(tensor.shape[1:]) if tensor.dim() else 1
    return local, row * per_row


def model_pieces(
    named: Iterable[tuple[str, torch.Tensor]],
    layout: ParamLayout,
    *,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
) -> dict[str, Piece]:
    """This rank's piece of every tensor in ``named`` (parameters, or their ``.grad``), by canonical name."""
    out = {}
    for name, tensor in named:
        values, offset = local_piece(tensor)
        digest_base, sketch_base = layout.bases(name)
        out[canonical_name(name)] = fingerprint_piece(
            values, offset=offset, digest_base=digest_base, sketch_base=sketch_base, k=k, seed=seed
        )
    return out


def fingerprint_runs(
    runs: Iterable[tuple[torch.Tensor, int]], *, k: int = C.DEFAULT_SKETCH_K, seed: int = C.DEFAULT_SEED
) -> Fingerprint:
    """The fingerprint of the elements a rank holds of one flat vector: ``runs`` are ``(values,
    index of the first in the vector)``, disjoint.

    A sharded job's per-rank gradient and weights fingerprints (``recorder/fsdp_layout.py``)
    and the replay's recomputation of them (``replay/compare.py``) are this one function of the
    same elements at the same places, so they are equal bit for bit when the elements are; the
    runs of all ranks of a replica together give ``core.fingerprint`` of the whole vector's
    digest and sketch (:func:`combine_pieces`).
    """
    runs = list(runs)
    whole = _compiled_runs(runs, k, seed)
    if whole is not None:
        return whole
    # the same pieces as fingerprint_piece of each run, in a few calls for all of them
    parts = fingerprint_pieces(((values, offset, 0, 0) for values, offset in runs), k=k, seed=seed)
    return combine_pieces(parts or [_empty(k, seed)])


def _runs_arrays(runs: list[tuple[torch.Tensor, int]]):
    """``(addresses, sizes, offsets, dtype name, align)`` of runs the compiled loop takes (one dtype,
    float32 or bfloat16, contiguous plain CPU tensors, offsets >= 0), kept alive by the caller; else None."""
    if not runs or not cpu_kernel.available()[0]:
        return None
    flats = [values.detach().reshape(-1) for values, _ in runs]
    dtype = flats[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    for flat in flats:
        if (
            flat.dtype != dtype
            or flat.device.type != "cpu"
            or not flat.is_contiguous()
            or type(flat) is not torch.Tensor
        ):
            return None
    if dtype == torch.float32 and any(flat.data_ptr() % 4 for flat in flats if flat.numel()):
        return None
    offsets = np.fromiter((int(offset) for _, offset in runs), dtype=np.int64, count=len(runs))
    if (offsets < 0).any():
        return None
    sizes = np.fromiter((flat.numel() for flat in flats), dtype=np.int64, count=len(flats))
    addresses = np.fromiter((flat.data_ptr() for flat in flats), dtype=np.int64, count=len(flats))
    return addresses, sizes, offsets, str(dtype).removeprefix("torch."), align_elems(flats[0].element_size())


class RunsFingerprint:
    """:func:`fingerprint_runs` of runs that arrive over several calls (a rank's whole local
    gradient, one reduce-scatter at a time), as pieces to combine: runs the compiled loop takes
    are added into one running total (``cpu_kernel.RunsTotal``: the same numbers as their pieces
    merged in order), the others (a NaN/Inf, another dtype, a view) become pieces as before."""

    def __init__(self, k: int = C.DEFAULT_SKETCH_K, seed: int = C.DEFAULT_SEED) -> None:
        self.k, self.seed = k, seed
        self._total: cpu_kernel.RunsTotal | None = None
        self._pieces: list[Piece] = []

    def add(self, runs: Iterable[tuple[torch.Tensor, int]]) -> None:
        runs = list(runs)
        arrays = _runs_arrays(runs)
        if arrays is not None:
            total = self._total or cpu_kernel.RunsTotal(self.k, self.seed)
            addresses, sizes, offsets, name, align = arrays
            try:
                added = total.add(addresses, sizes, offsets, name, align=align)
            except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
                core._compiled_failed(exc)
                added = False
            if added:
                self._total = total
                return
        self._pieces += fingerprint_pieces(
            ((values, offset, 0, 0) for values, offset in runs), k=self.k, seed=self.seed
        )

    def pieces(self) -> list[Piece]:
        """Everything added, as pieces (the compiled total first, as one piece)."""
        return ([_total_piece(self._total)] if self._total is not None else []) + self._pieces


def _total_piece(total: cpu_kernel.RunsTotal) -> Piece:
    edges: dict[int, tuple[int, int]] = {}
    for blocks, s_sums, t_sums in total.ends:
        for j, s, t in zip(blocks.tolist(), s_sums.tolist(), t_sums.tolist()):
            s0, t0 = edges.get(j, (0, 0))
            edges[j] = ((s0 + s) & _MASK32, (t0 + t) & _MASK32)
    return Piece(
        lanes=(total.low, total.high),
        edges=edges,
        num_bytes=total.num_bytes,
        numel=total.numel,
        sketch=total.sketch.copy(),
        sumsq=float(total.sums[0]),
        max_abs=float(total.sums[1]) if total.numel else 0.0,
        nonfinite=0,
        seed=total.seed,
    )


def _compiled_runs(runs: list[tuple[torch.Tensor, int]], k: int, seed: int) -> Fingerprint | None:
    """:func:`fingerprint_runs` in one call of the compiled loop (``cpu_kernel.RunsTotal``), or None
    where it does not take the runs (:func:`_runs_arrays`) or met a NaN/Inf (the pieces' path
    counts them). The digest is the pieces' (integer sums, exact in any order); the sketch and
    sums of squares add the same parts in the same order, the ends' summed in order over their
    elements (as ``_compiled_ends``): the same bits (tested)."""
    arrays = _runs_arrays(runs)
    if arrays is None:
        return None
    addresses, sizes, offsets, name, align = arrays
    total = cpu_kernel.RunsTotal(k, seed)
    try:
        if not total.add(addresses, sizes, offsets, name, align=align):
            return None
        low, high = total.lanes()
    except Exception as exc:  # noqa: BLE001 - a broken compiled path must not lose the answer
        core._compiled_failed(exc)
        return None
    return Fingerprint(
        digest=core._finish_digest(low, high, total.num_bytes, seed),
        sketch=total.sketch.copy(),
        norm=float(np.sqrt(total.sums[0])),
        max_abs=float(total.sums[1]) if total.numel else 0.0,
        nonfinite=0,
        numel=total.numel,
        lanes=(low, high),
    )


def shard_runs(tensors: Iterable[torch.Tensor], shard: int, num_shards: int) -> list[tuple[torch.Tensor, int]]:
    """The runs a rank holding shard ``shard`` of ``num_shards`` holds of ``tensors`` (whole, in
    order, one flat vector; FSDP2's ``Shard(0)`` cut, ``trace/mesh.shard_rows``): the replay's
    recomputation of a sharded job's per-rank fingerprints (:func:`fingerprint_runs`)."""
    from sdc_forensics.trace.mesh import shard_rows

    runs, offset = [], 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        rows = tensor.shape[0] if tensor.dim() else 1
        per_row = flat.numel() // rows if rows else 0
        first, stop = shard_rows(rows, shard, num_shards)
        runs.append((flat[first * per_row : stop * per_row], offset + first * per_row))
        offset += flat.numel()
    return runs


def box_runs(
    global_shape: tuple[int, ...], local_shape: tuple[int, ...], offsets: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """A box of a tensor as runs of its flattened elements: ``(index in the flattened box, length,
    index in the flattened whole tensor)``, in row-major order.

    A rank of a tensor-parallel job holds such a box of each parameter (``ShardMesh.rank_box``):
    ``Shard(0)`` rows are one run, a row-parallel ``Shard(1)`` block is one run per row. The
    box's innermost dimensions that are whole (offset 0, full size) merge into each run.
    """
    if len(global_shape) != len(local_shape) or len(global_shape) != len(offsets):
        raise ValueError("a box needs a size and an offset per dimension of the tensor")
    if not global_shape:
        return [(0, 1, 0)]
    if any(n == 0 for n in local_shape):
        return []
    # the innermost dims the box holds whole join each run; the next one in sets its length
    inner = len(global_shape) - 1
    run = 1
    while inner > 0 and local_shape[inner] == global_shape[inner] and offsets[inner] == 0:
        run *= global_shape[inner]
        inner -= 1
    run *= local_shape[inner]
    # (dims,) row-major strides of the whole tensor
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    first = sum(o * s for o, s in zip(offsets, strides))
    outer = local_shape[:inner]
    starts = np.zeros(1, dtype=np.int64)
    for d, size in enumerate(outer):
        starts = (starts[:, None] + np.arange(size, dtype=np.int64)[None, :] * strides[d]).reshape(-1)
    return [(i * run, run, first + int(s)) for i, s in enumerate(starts.tolist())]


def box_pieces(
    values: torch.Tensor,
    runs: list[tuple[int, int, int]],
    *,
    offset: int = 0,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
) -> list[Piece]:
    """The pieces of a box's ``values`` (:func:`box_runs`) placed at ``offset`` + their index in
    the whole tensor (a flat vector of several tensors: ``offset`` is where this one starts)."""
    flat = values.detach().reshape(-1)
    return [
        fingerprint_piece(flat[start : start + length], offset=offset + place, k=k, seed=seed)
        for start, length, place in runs
    ]


def merge_pieces(parts: list[Piece]) -> Piece:
    """Several pieces of one tensor as one (a rank's box runs: :func:`box_pieces`), to be combined
    with other ranks' later (:func:`combine_pieces`)."""
    return _merge(parts) if parts else _empty(C.DEFAULT_SKETCH_K, C.DEFAULT_SEED)


def _batched_ok(flat: torch.Tensor) -> bool:
    """A piece :func:`fingerprint_pieces` takes in its batch: a CPU float tensor of 2 or 4 bytes."""
    return flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _batched_ends(ends: list[tuple[torch.Tensor, int, int, int, int]], align: int, k: int, seed: int) -> list[Piece]:
    """:func:`_padded_piece` of cut ends of one dtype, ``(values, pos, first_elem, digest_base,
    sketch_base)`` each: the same numbers, the ends placed in one zeroed ``(ends, align)`` buffer.

    The digest's block sums wrap mod 2**32 (exact in any order), so all ends take one numpy
    pass; each end's sketch and stats are the same numpy calls on the same shapes as
    :func:`_end_numbers_numpy` (a one-row matrix product per end), so their rounding is its own.
    """
    itemsize = ends[0][0].element_size()
    buffer = torch.zeros(len(ends), align, dtype=ends[0][0].dtype)
    for row, (values, pos, _, _, _) in zip(buffer, ends):
        row[pos : pos + values.numel()] = values
    blocks = align * itemsize // _BLOCK_BYTES
    if cpu_kernel.available()[0]:
        return _compiled_ends(ends, buffer, blocks, k, seed)
    # (ends * blocks, 1024) int32: each end's digest blocks
    signed = buffer.view(torch.int32).numpy().reshape(-1, C.BLOCK_WORDS)
    a = C.digest_word_weights(seed).view(np.uint32)
    b = C.digest_high_weights(seed).view(np.uint32)
    with np.errstate(over="ignore"):
        # wraps mod 2**32
        low = (signed.view("<u4") * a).sum(axis=1, dtype=np.uint32).reshape(len(ends), blocks).tolist()
        high = ((signed >> 16).astype(np.uint32) * b).sum(axis=1, dtype=np.uint32).reshape(len(ends), blocks).tolist()
    # (ends, align) float64, zero padded as _end_numbers_numpy's chunk
    x_all = buffer.to(torch.float64).numpy()
    alpha = _alpha_cached(k, seed)
    out = []
    for e, (values, pos, first_elem, digest_base, sketch_base) in enumerate(ends):
        n = values.numel()
        x = x_all[e].reshape(-1, C.BLOCK_ELEMS)
        first_sketch = sketch_base + first_elem // C.BLOCK_ELEMS
        beta = cpu_kernel._beta(first_sketch + x.shape[0], k, seed, np.float32)[first_sketch:]
        sketch = ((x @ alpha) * beta).sum(axis=0)
        floats = x_all[e, pos : pos + n]
        with np.errstate(over="ignore", invalid="ignore"):
            sumsq, max_abs = float(np.dot(floats, floats)), float(np.max(np.abs(floats)))
            nonfinite = int(np.count_nonzero(~np.isfinite(floats)))
        first_block = digest_base + first_elem * itemsize // _BLOCK_BYTES
        out.append(
            Piece(
                lanes=(0, 0),
                edges={first_block + i: (low[e][i], high[e][i]) for i in range(blocks)},
                num_bytes=n * itemsize,
                numel=n,
                sketch=sketch,
                sumsq=sumsq,
                max_abs=max_abs,
                nonfinite=nonfinite,
                seed=seed,
            )
        )
    return out


def _compiled_ends(ends: list, buffer: torch.Tensor, blocks: int, k: int, seed: int) -> list[Piece]:
    """:func:`_batched_ends` in one call of the compiled loop (``cpu_kernel.end_numbers``): the
    digest's block sums are the same numbers (wrapping sums), the sketch and stats each end's
    own elements summed in order (numpy's, above, sum in BLAS's order: the two agree within the
    float64 rounding of at most ``align`` terms, like the torch path's)."""
    itemsize = buffer.element_size()
    floating = buffer.is_floating_point()
    floats = buffer.to(torch.float64).numpy() if floating else np.zeros((len(ends), 0))
    positions = np.array([pos for _, pos, _, _, _ in ends], dtype=np.int64)
    lengths = np.array([values.numel() for values, _, _, _, _ in ends], dtype=np.int64)
    first_rows = np.array(
        [sketch_base + first // C.BLOCK_ELEMS for _, _, first, _, sketch_base in ends], dtype=np.int64
    )
    s, t, sketch, sumsq, max_abs, nonfinite = cpu_kernel.end_numbers(
        buffer.view(torch.int32).numpy(), floats, positions, lengths, first_rows, k=k, seed=seed
    )
    s, t, sumsq, max_abs, nonfinite = s.tolist(), t.tolist(), sumsq.tolist(), max_abs.tolist(), nonfinite.tolist()
    out = []
    for e, (values, _, first_elem, digest_base, _) in enumerate(ends):
        n = lengths[e]
        first_block = digest_base + first_elem * itemsize // _BLOCK_BYTES
        out.append(
            Piece(
                lanes=(0, 0),
                edges={first_block + i: (s[e][i], t[e][i]) for i in range(blocks)},
                num_bytes=int(n) * itemsize,
                numel=int(n),
                sketch=sketch[e] if floating else np.zeros(k),
                sumsq=sumsq[e] if floating else 0.0,
                max_abs=max_abs[e] if floating else 0.0,
                nonfinite=nonfinite[e] if floating else 0,
                seed=seed,
            )
        )
    return out


_ALPHAS: dict[tuple[int, int], np.ndarray] = {}


def _alpha_cached(k: int, seed: int) -> np.ndarray:
    # (1024, k) float64, read-only: the same numbers as cpu_kernel._alpha, made once
    key = (k, seed)
    if key not in _ALPHAS:
        alpha = cpu_kernel._alpha(k, seed)
        alpha.flags.writeable = False
        _ALPHAS[key] = alpha
    return _ALPHAS[key]


def fingerprint_pieces(
    items: Iterable[tuple[torch.Tensor, int, int, int]],
    *,
    k: int = C.DEFAULT_SKETCH_K,
    seed: int = C.DEFAULT_SEED,
) -> list[Piece]:
    """:func:`fingerprint_piece` of each ``(values, offset, digest_base, sketch_base)``, the same
    pieces bit for bit, at the cost of a few calls for all of them rather than a few per piece.

    A sharded recorder fingerprints every parameter of a rank's shard as one piece, each with
    up to two cut ends and a body: here the bodies go through :func:`core.fingerprints_async`
    (one compiled call), the ends of each dtype through one buffer (:func:`_batched_ends`),
    and only the pieces' merging stays per piece. Tensors off the CPU, or of other dtypes, go
    through :func:`fingerprint_piece`.
    """
    # per item: ("whole", piece) or ("cut", [end index | None, body index | None, end index | None])
    plans: list = []
    ends: dict[torch.dtype, list] = {}
    end_slots: list[tuple[torch.dtype, int]] = []
    bodies: list[torch.Tensor] = []
    body_offsets: list[tuple[int, int]] = []
    for values, offset, digest_base, sketch_base in items:
        offset, digest_base, sketch_base = int(offset), int(digest_base), int(sketch_base)
        flat = values.detach().reshape(-1)
        n = flat.numel()
        if n == 0 or offset < 0 or digest_base < 0 or sketch_base < 0 or not _batched_ok(flat):
            piece = fingerprint_piece(
                values, offset=offset, digest_base=digest_base, sketch_base=sketch_base, k=k, seed=seed
            )
            plans.append(("whole", piece))
            continue
        align = align_elems(flat.element_size())
        head = min(n, (-offset) % align)
        body = (n - head) // align * align
        tail = n - head - body
        slots: list[int | None] = [None, None, None]
        if head:
            slots[0] = len(end_slots)
            group = ends.setdefault(flat.dtype, [])
            end_slots.append((flat.dtype, len(group)))
            group.append((flat[:head], offset % align, offset - offset % align, digest_base, sketch_base))
        if body:
            start = offset + head
            slots[1] = len(bodies)
            bodies.append(flat[head : head + body])
            body_offsets.append(
                (
                    sketch_base + start // C.BLOCK_ELEMS,
                    digest_base + start * flat.element_size() // _BLOCK_BYTES,
                )
            )
        if tail:
            slots[2] = len(end_slots)
            group = ends.setdefault(flat.dtype, [])
            end_slots.append((flat.dtype, len(group)))
            group.append((flat[head + body :], 0, offset + head + body, digest_base, sketch_base))
        plans.append(("cut", slots))
    end_pieces = {
        dtype: _batched_ends(group, align_elems(group[0][0].element_size()), k, seed) for dtype, group in ends.items()
    }
    fps = core.resolve(
        core.fingerprints_async(
            bodies,
            k=k,
            seed=seed,
            block_offsets=[o for o, _ in body_offsets],
            digest_block_offsets=[d for _, d in body_offsets],
        )
    )
    out = []
    for kind, plan in plans:
        if kind == "whole":
            out.append(plan)
            continue
        head_slot, body_slot, tail_slot = plan
        parts = []
        if head_slot is not None:
            dtype, at = end_slots[head_slot]
            parts.append(end_pieces[dtype][at])
        if body_slot is not None:
            fp, middle = fps[body_slot], bodies[body_slot]
            parts.append(
                Piece(
                    lanes=fp.lanes,
                    edges={},
                    num_bytes=middle.numel() * middle.element_size(),
                    numel=middle.numel(),
                    sketch=fp.sketch,
                    sumsq=float(fp.norm**2),
                    max_abs=float(fp.max_abs),
                    nonfinite=int(fp.nonfinite),
                    seed=seed,
                )
            )
        if tail_slot is not None:
            dtype, at = end_slots[tail_slot]
            parts.append(end_pieces[dtype][at])
        out.append(_merge(parts))
    return out
