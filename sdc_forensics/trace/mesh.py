"""The device mesh of a sharded job (FSDP2 ``fully_shard``, HSDP, FSDP2 x tensor parallel), as a trace records it.

The manifest's optional ``"parallel"`` key holds it (``docs/trace-format.md``); a DDP trace has
none. Every rank holds one shard of every parameter: the ranks that share a *shard coordinate*
hold the same elements (HSDP's replicas of one shard: their weights are voted), the ranks that
share a *replica coordinate* hold the whole model between them (one replica).

A parameter of ``d0`` rows is cut as FSDP2's ``Shard(0)`` cuts it (``torch.chunk``): shard
``c`` of ``S`` holds rows ``[c * ceil(d0 / S), min((c + 1) * ceil(d0 / S), d0))``, possibly none.
A tensor-parallel job (kind ``"tp"``: ``parallelize_module`` on the mesh's ``tp`` dimension,
then ``fully_shard`` over its data-parallel one, as torchtitan composes them) notes the ``tp``
dimension (``tp_dim``) and, per parameter, the dimension TP cuts it on (``tp_shards``: ``0`` for
``ColwiseParallel``'s ``Shard(0)``, ``1`` for ``RowwiseParallel``'s ``Shard(1)``, ``-1`` for a
replicated one); a rank then holds a box of each parameter (:meth:`ShardMesh.rank_box`): TP's
slice first, FSDP's rows of that slice next. A pipeline-parallel job (kind ``"pp"``: each rank
one ``PipelineStage`` of the model, ``fully_shard`` over the data-parallel dimension, as
torchtitan composes them) notes the ``pp`` dimension (``pp_dim``), the stage that holds each
parameter of the whole model (``stages``, in the whole model's order: stage 0's parameters, then
stage 1's) and what the schedule divides the reduced gradient by (``grad_divisor``: its
microbatch count when it scales gradients, else 1); a rank holds nothing of another stage's
parameters. These keys are optional: older traces read as before.
Numpy-free and torch-free: triage reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: ``"tp"``: FSDP2 (data parallel) x tensor parallel on a 2-D mesh; ``"pp"``: pipeline stages x FSDP2
KINDS = ("fsdp", "hsdp", "tp", "pp")
#: the dtypes a sharded job's reduction may be recorded in besides the parameters' own ("")
REDUCE_DTYPES = ("", "bfloat16", "float32", "float16")
#: the dtypes a sharded job may compute in (``MixedPrecisionPolicy(param_dtype=...)``; "": the parameters')
PARAM_DTYPES = ("", "bfloat16", "float16")
#: the dtypes FSDP2 may cast a module's forward inputs or outputs to
CAST_DTYPES = ("", "bfloat16", "float16", "float32")
_MAX_CASTS = 100_000
_MAX_FQN = 1024
_MAX_DIMS = 4
_MAX_NAME = 64


@dataclasses.dataclass(frozen=True)
class ShardMesh:
    """The mesh of a sharded job.

    Attributes:
        kind: ``"fsdp"`` (one mesh dimension, every rank one shard) or ``"hsdp"`` (replicate x shard).
        shape: mesh sizes, e.g. ``(4,)`` or ``(2, 2)``.
        dim_names: the mesh's dimension names (``("dp_replicate", "dp_shard")``; "" where unnamed).
        shard_dim: the dimension that shards the parameters (the last, as FSDP2 uses it).
        coords: every global rank's coordinates, rank order.
        reduce_dtype: the dtype FSDP2 reduced gradients in when it is not the parameters'
            (``MixedPrecisionPolicy(reduce_dtype=...)``): the local gradient is recorded in it, and
            the replay casts to it before reducing; "" when the parameters' own. Always written
            when ``param_dtype`` is (the gradient is then computed in another dtype than reduced).
        param_dtype: the dtype FSDP2 all-gathered the parameters in for the forward and backward
            (``MixedPrecisionPolicy(param_dtype=...)``); "" when the parameters' own.
        casts: ``(module, inputs, outputs)`` per ``fully_shard`` module (its name in the model,
            "" for the root) whose policy casts its floating-point forward inputs to ``inputs``
            (``cast_forward_inputs``) or its outputs to ``outputs`` (``output_dtype``), "" where it
            does not: the replay applies the same casts to the recipe's model.
        groups: the indices (in the flat gradient's order: the model's parameters that train)
            of each FSDP2 parameter group's parameters, each group reduce-scattered as one buffer
            of padded chunks: a replay that models the job's own reduce-scatter (gloo's ring)
            needs that buffer's layout. Empty: not recorded.
        tp_dim: the mesh dimension tensor parallelism shards on (kind ``"tp"``); -1: none.
        tp_shards: per parameter of the model, in order, the tensor dimension TP cuts it on (-1:
            replicated over ``tp``); empty without TP.
        pp_dim: the mesh dimension the pipeline's stages lie on (kind ``"pp"``); -1: none.
        stages: per parameter of the whole model, in stage order, the pipeline coordinate (on
            ``pp_dim``) that holds it: its stage's index with one stage per rank, ``s % pp`` for
            stage ``s`` of an interleaved schedule; empty without PP.
        grad_divisor: what the pipeline schedule divides each reduced gradient by after the
            data-parallel reduction (``PipelineStage.scale_grads``: the microbatch count, or 1).
    """

    kind: str
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    shard_dim: int
    coords: tuple[tuple[int, ...], ...]
    reduce_dtype: str = ""
    param_dtype: str = ""
    casts: tuple[tuple[str, str, str], ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()
    tp_dim: int = -1
    tp_shards: tuple[int, ...] = ()
    pp_dim: int = -1
    stages: tuple[int, ...] = ()
    grad_divisor: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if not 1 <= len(self.shape) <= _MAX_DIMS or any(s < 1 for s in self.shape):
            raise ValueError(f"a mesh shape of 1 to {_MAX_DIMS} positive sizes, not {self.shape}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {REDUCE_DTYPES}, not {self.reduce_dtype!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, not {self.param_dtype!r}")
        if self.param_dtype and not self.reduce_dtype:
            raise ValueError("a param_dtype needs the reduce_dtype it was reduced in")
        if len(self.casts) > _MAX_CASTS or not all(
            isinstance(c, tuple)
            and len(c) == 3
            and isinstance(c[0], str)
            and len(c[0]) <= _MAX_FQN
            and c[1] in CAST_DTYPES
            and c[2] in CAST_DTYPES
            for c in self.casts
        ):
            raise ValueError(
                f"casts must be at most {_MAX_CASTS} (module, inputs, outputs) triples of a module name and "
                f"dtypes among {', '.join(repr(d) for d in CAST_DTYPES)}"
            )
        indices = [i for g in self.groups for i in g] if all(isinstance(g, tuple) for g in self.groups) else None
        if (
            indices is None
            or len(indices) > _MAX_CASTS
            or not all(_small_int(i, 0) for i in indices)
            or len(set(indices)) != len(indices)
        ):
            raise ValueError(f"groups must be lists of distinct parameter indices (at most {_MAX_CASTS} in all)")
        if len(self.dim_names) != len(self.shape) or not 0 <= self.shard_dim < len(self.shape):
            raise ValueError("one name per mesh dimension, and a shard dimension among them")
        if (self.kind == "tp" and self.tp_dim < 0) or not -1 <= self.tp_dim < len(self.shape):
            raise ValueError('a "tp" mesh names its tensor-parallel dimension (tp_dim)')
        if self.tp_dim >= 0 and self.kind not in ("tp", "pp"):
            raise ValueError('only a "tp" or "pp" mesh has a tensor-parallel dimension')
        if self.tp_dim == self.shard_dim or len(self.tp_shards) > _MAX_CASTS:
            raise ValueError("the tensor-parallel dimension is not the one FSDP shards on")
        if not all(isinstance(d, int) and -1 <= d < _MAX_DIMS for d in self.tp_shards):
            raise ValueError(f"tp_shards must be tensor dimensions (-1 to {_MAX_DIMS - 1})")
        if (self.kind == "pp") != (self.pp_dim >= 0) or not -1 <= self.pp_dim < len(self.shape):
            raise ValueError('a "pp" mesh names its pipeline dimension (pp_dim), and only it does')
        if self.pp_dim >= 0 and (self.pp_dim == self.shard_dim or self.pp_dim == self.tp_dim):
            raise ValueError("the pipeline dimension is neither the one FSDP shards on nor the tensor-parallel one")
        if len(self.stages) > _MAX_CASTS or not all(
            isinstance(s, int)
            and not isinstance(s, bool)
            and 0 <= s < (self.shape[self.pp_dim] if self.pp_dim >= 0 else 0)
            for s in self.stages
        ):
            raise ValueError("stages must be pipeline coordinates of the mesh, one per parameter")
        if (
            not isinstance(self.grad_divisor, int)
            or isinstance(self.grad_divisor, bool)
            or not 1 <= self.grad_divisor < (1 << 20)
        ):
            raise ValueError("grad_divisor must be a positive integer")
        total = 1
        for size in self.shape:
            total *= size
        if len(self.coords) != total or len(set(self.coords)) != total:
            raise ValueError(f"a {self.shape} mesh needs {total} distinct rank coordinates, found {len(self.coords)}")
        for coord in self.coords:
            if len(coord) != len(self.shape) or any(not 0 <= c < s for c, s in zip(coord, self.shape)):
                raise ValueError(f"coordinate {coord} is outside the {self.shape} mesh")

    @property
    def world_size(self) -> int:
        return len(self.coords)

    @property
    def shard_size(self) -> int:
        """Shards of each parameter (the shard dimension's size)."""
        return self.shape[self.shard_dim]

    def divide_factors(self) -> tuple[int, float] | None:
        """``(pre, post)``: FSDP2 divides a float16 reduction's input by ``pre`` and its output by
        ``post`` (sums both ways, ``pre * post`` the data-parallel size; torch's
        ``_get_gradient_divide_factors``), against overflow; None for another dtype (it averages)."""
        if self.reduce_dtype != "float16":
            return None
        factor, pre = float(self.world_size), 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return pre, factor / pre

    def shard_of(self, rank: int) -> int:
        """The shard coordinate of ``rank``: which rows of each parameter it holds."""
        return self.coords[rank][self.shard_dim]

    def same_shard(self) -> list[tuple[int, ...]]:
        """Groups of ranks that hold the same shard (HSDP replicas of it; groups of one in FSDP;
        with TP, equal shard and TP coordinates)."""
        if self.tp_dim >= 0 or self.pp_dim >= 0:
            held = [d for d in (self.shard_dim, self.tp_dim, self.pp_dim) if d >= 0]
            return self._groups(lambda coord: tuple(coord[d] for d in held))
        return self._groups(lambda coord: coord[self.shard_dim])

    def replicas(self) -> list[tuple[int, ...]]:
        """Groups of ranks that hold one whole model between them (a replica; one group in FSDP)."""
        cut = {self.shard_dim, self.tp_dim, self.pp_dim}
        return self._groups(lambda coord: tuple(c for d, c in enumerate(coord) if d not in cut))

    def reduce_groups(self) -> list[tuple[int, ...]]:
        """Groups of ranks whose shards of the reduced gradient add up to the reduction of their
        (and, in HSDP, the other replicas') local gradients: a replica; with TP, the ranks of one
        TP coordinate (FSDP reduce-scatters TP's slice among them); with PP, of one stage."""
        if self.tp_dim >= 0 or self.pp_dim >= 0:
            return self._groups(lambda coord: tuple(c for d, c in enumerate(coord) if d != self.shard_dim))
        return self.replicas()

    def forward_groups(self) -> list[tuple[int, ...]]:
        """Groups of ranks that compute one forward and backward together over the same
        microbatches: the ranks of one data-parallel coordinate, across TP and the pipeline's
        stages (their collectives and hand-offs join them); groups of one without TP or PP. A
        wrong input on one rank of a group changes every member's gradients."""
        if self.tp_dim < 0 and self.pp_dim < 0:
            return [(rank,) for rank in range(self.world_size)]
        model = {self.tp_dim, self.pp_dim}
        return self._groups(lambda coord: tuple(c for d, c in enumerate(coord) if d not in model))

    @property
    def tp_size(self) -> int:
        """Tensor-parallel degree (1 without TP)."""
        return self.shape[self.tp_dim] if self.tp_dim >= 0 else 1

    def tp_of(self, rank: int) -> int:
        """The tensor-parallel coordinate of ``rank`` (0 without TP)."""
        return self.coords[rank][self.tp_dim] if self.tp_dim >= 0 else 0

    def pp_of(self, rank: int) -> int:
        """The pipeline stage of ``rank`` (0 without PP)."""
        return self.coords[rank][self.pp_dim] if self.pp_dim >= 0 else 0

    def holds(self, rank: int, index: int) -> bool:
        """Whether ``rank``'s stage holds parameter ``index`` (always, without PP)."""
        return self.pp_dim < 0 or index >= len(self.stages) or self.stages[index] == self.pp_of(rank)

    def tp_box(self, rank: int, index: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(local shape, offsets)``: TP's slice of parameter ``index`` (of ``shape``) on
        ``rank`` (``tp_shards[index]``, an even split; the whole where replicated): the gradient
        a TP rank computes, before FSDP reduce-scatters it; nothing (a zero-size box) where
        another pipeline stage holds the parameter. Raises ValueError where TP's split is
        uneven (the recorder refuses such a job)."""
        if not self.holds(rank, index):
            return tuple(0 for _ in shape), tuple(0 for _ in shape)
        local, offsets = list(shape), [0] * len(shape)
        cut = self.tp_shards[index] if index < len(self.tp_shards) else -1
        if cut >= 0:
            if cut >= len(shape) or shape[cut] % self.tp_size:
                raise ValueError(f"parameter {index} of shape {tuple(shape)} is not cut evenly on dim {cut} by TP")
            local[cut] = shape[cut] // self.tp_size
            offsets[cut] = self.tp_of(rank) * local[cut]
        return tuple(local), tuple(offsets)

    def rank_box(self, rank: int, index: int, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(local shape, offsets)``: the box of parameter ``index`` (of ``shape``) that ``rank``
        holds: TP's slice (:meth:`tp_box`) first, then FSDP's ``Shard(0)`` rows of that slice
        (``torch.chunk``'s split)."""
        box, at = self.tp_box(rank, index, shape)
        local, offsets = list(box), list(at)
        if shape:
            first, stop = shard_rows(local[0], self.shard_of(rank), self.shard_size)
            offsets[0] += first
            local[0] = stop - first
        return tuple(local), tuple(offsets)

    def _groups(self, key) -> list[tuple[int, ...]]:
        groups: dict[Any, list[int]] = {}
        for rank, coord in enumerate(self.coords):
            groups.setdefault(key(coord), []).append(rank)
        return [tuple(ranks) for _, ranks in sorted(groups.items())]

    def coordinates(self, rank: int) -> str:
        """``"replicate=1, shard=0"`` ("" for a rank outside the mesh)."""
        if not 0 <= rank < self.world_size:
            return ""
        names = [n or f"dim{i}" for i, n in enumerate(self.dim_names)]
        return ", ".join(f"{n}={c}" for n, c in zip(names, self.coords[rank]))

    def where(self, rank: int) -> str:
        """``"mesh (replicate=1, shard=0)"`` for a message."""
        return f"mesh ({self.coordinates(rank)})" if 0 <= rank < self.world_size else ""

    def describe(self) -> str:
        """``"hsdp, mesh 2 x 2 (replicate, shard)"`` (``", computed in bfloat16, reduced in float32"``
        after it for a mixed-precision job)."""
        names = [n or f"dim{i}" for i, n in enumerate(self.dim_names)]
        text = f"{self.kind}, mesh {' x '.join(map(str, self.shape))} ({', '.join(names)})"
        if self.grad_divisor > 1:
            text += f", gradients divided by {self.grad_divisor} microbatches"
        if self.param_dtype:
            text += f", computed in {self.param_dtype}"
        if self.reduce_dtype:
            text += f", reduced in {self.reduce_dtype}"
        return text

    def to_json(self) -> dict[str, Any]:
        doc = {
            "kind": self.kind,
            "shape": list(self.shape),
            "dim_names": list(self.dim_names),
            "shard_dim": self.shard_dim,
            "coords": [list(c) for c in self.coords],
        }
        # optional: a job reducing in its parameters' dtype writes none
        if self.reduce_dtype:
            doc["reduce_dtype"] = self.reduce_dtype
        # optional, as reduce_dtype
        if self.param_dtype:
            doc["param_dtype"] = self.param_dtype
        if self.casts:
            doc["casts"] = [list(c) for c in self.casts]
        if self.groups:
            doc["groups"] = [list(g) for g in self.groups]
        # optional: a TP job's only
        if self.tp_dim >= 0:
            doc["tp_dim"] = self.tp_dim
            doc["tp_shards"] = list(self.tp_shards)
        # optional: a PP job's only
        if self.pp_dim >= 0:
            doc["pp_dim"] = self.pp_dim
            doc["stages"] = list(self.stages)
            doc["grad_divisor"] = self.grad_divisor
        return doc

    @classmethod
    def from_json(cls, doc: Any, world_size: int) -> ShardMesh:
        """Parse the manifest's ``"parallel"`` object (untrusted): ValueError says what is wrong."""
        if not isinstance(doc, dict):
            raise ValueError("must be an object")
        kind, shape, names, dim, coords = (doc.get(k) for k in ("kind", "shape", "dim_names", "shard_dim", "coords"))
        if not isinstance(shape, list) or not all(_small_int(s) for s in shape):
            raise ValueError('"shape" must be a list of positive integers')
        if not isinstance(names, list) or not all(isinstance(n, str) and len(n) <= _MAX_NAME for n in names):
            raise ValueError(f'"dim_names" must be a list of strings of at most {_MAX_NAME} characters')
        if not _small_int(dim, 0):
            raise ValueError('"shard_dim" must be an integer')
        if not isinstance(coords, list) or len(coords) != world_size:
            raise ValueError(f'"coords" must list the coordinates of all {world_size} ranks')
        if not all(isinstance(c, list) and all(_small_int(x, 0) for x in c) for c in coords):
            raise ValueError('"coords" must be lists of integers')
        reduce_dtype = doc.get("reduce_dtype", "")
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f'"reduce_dtype" must be one of {", ".join(repr(d) for d in REDUCE_DTYPES)}')
        param_dtype, casts, groups = doc.get("param_dtype", ""), doc.get("casts", []), doc.get("groups", [])
        if param_dtype not in PARAM_DTYPES:
            raise ValueError(f'"param_dtype" must be one of {", ".join(repr(d) for d in PARAM_DTYPES)}')
        if not isinstance(casts, list) or not all(isinstance(c, list) for c in casts):
            raise ValueError('"casts" must be a list of [module, inputs, outputs] lists')
        if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
            raise ValueError('"groups" must be a list of lists of parameter indices')
        tp_dim, tp_shards = doc.get("tp_dim", -1), doc.get("tp_shards", [])
        if not isinstance(tp_dim, int) or isinstance(tp_dim, bool):
            raise ValueError('"tp_dim" must be an integer')
        if not isinstance(tp_shards, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in tp_shards
        ):
            raise ValueError('"tp_shards" must be a list of integers')
        pp_dim, stages, divisor = doc.get("pp_dim", -1), doc.get("stages", []), doc.get("grad_divisor", 1)
        if not isinstance(pp_dim, int) or isinstance(pp_dim, bool):
            raise ValueError('"pp_dim" must be an integer')
        if not isinstance(stages, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in stages):
            raise ValueError('"stages" must be a list of integers')
        if not isinstance(divisor, int) or isinstance(divisor, bool):
            raise ValueError('"grad_divisor" must be an integer')
        return cls(
            kind=str(kind),
            shape=tuple(shape),
            dim_names=tuple(names),
            shard_dim=int(dim),
            coords=tuple(tuple(c) for c in coords),
            reduce_dtype=reduce_dtype,
            param_dtype=param_dtype,
            casts=tuple(tuple(c) for c in casts),
            groups=tuple(tuple(g) for g in groups),
            tp_dim=tp_dim,
            tp_shards=tuple(tp_shards),
            pp_dim=pp_dim,
            stages=tuple(stages),
            grad_divisor=divisor,
        )


def _small_int(value: Any, lo: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < (1 << 31)


def shard_rows(rows: int, shard: int, shards: int) -> tuple[int, int]:
    """``(first, stop)`` rows of shard ``shard`` of ``shards`` of a parameter of ``rows`` rows
    (FSDP2's ``Shard(0)``, ``torch.chunk``'s split; empty shards at the end)."""
    chunk = -(-rows // shards) if rows else 0
    first = min(shard * chunk, rows)
    return first, min(first + chunk, rows)
