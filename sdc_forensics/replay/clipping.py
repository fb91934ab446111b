"""A sharded job's gradient clipping, replayed as its ranks computed it.

An FSDP2/HSDP job clips with ``torch.nn.utils.clip_grad_norm_`` on its DTensor parameters. In
torch 2.13 that is ``_get_total_norm`` on DTensors, whose arithmetic is not the unsharded one:

1. every rank takes ``torch._foreach_norm`` of the local shards of the gradients (DTensor is a
   type the foreach path takes; ``foreach=False``: ``vector_norm`` of each), a ``_NormPartial(p)``
   each;
2. ``torch.stack`` keeps them partial: one vector of the rank's per-parameter norms;
3. ``vector_norm`` of that vector first makes it whole: ``x ** p`` elementwise, one all-reduce
   (``SUM``) of the vector over the shard dimension's group (in HSDP the replicas agree: each
   replica reduces its own shards), ``** (1 / p)`` (``p = inf``: ``Partial("max")``, an
   all-reduce ``MAX``, exact in any order), then the norm of the replicated vector;
4. ``clip_grads_with_norm_``: every gradient times ``min(max_norm / (total + 1e-6), 1)``.

So the total norm is a function of each rank's shard of each gradient and of the all-reduce's
summation order, not of the whole gradients: the unsharded ``clip_grad_norm_`` of a one-process
replay differs in its last bits (0.43311017751693726 against 0.4331101179122925), and so does
every update after it. :func:`sharded_total_norm` recomputes it from the whole gradients the
replay holds, cut as the job's ranks held them (``trace/mesh.shard_rows``, FSDP2's ``Shard(0)``),
step by step as above, the all-reduce in gloo's ring order for the shard group
(``replay.env.ring_sum``: checked bit for bit against real FSDP2 jobs in
``tests/replay/test_sharded_clipping.py``). An NCCL job's all-reduce order is not modelled.

:func:`clipping_as_recorded` is how the replay learns of it: the recipe's ``before_step`` clips
as the job's loop did (``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``: the
protocol is the DDP one), and a sharded replay runs it with torch's total norm
(``torch.nn.utils.clip_grad._get_total_norm``, which ``clip_grad_norm_`` calls, and the public
``torch.nn.utils.get_total_norm`` that torchtitan's clipping calls) computed as the job's
ranks did, for the length of the hook only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.utils.clip_grad as _clip_grad

from sdc_forensics.errors import RecipeError
from sdc_forensics.replay.env import ring_sum
from sdc_forensics.trace.mesh import ShardMesh, shard_rows


def _check_norm_type(norm_type: float) -> None:
    """Raises ``RecipeError`` for a norm type other than a positive one or ``inf`` (torch reduces
    those with placements these replays do not model)."""
    if not (norm_type > 0 or norm_type == math.inf):
        raise RecipeError(
            f"the recipe clips with norm_type={norm_type}: a sharded job's replay reproduces the total norm "
            "for a positive norm type or inf"
        )


def _local_shard(tensor: torch.Tensor, shard: int, num_shards: int) -> torch.Tensor:
    """The rows of ``tensor`` that the rank holding shard ``shard`` of ``num_shards`` held."""
    whole = tensor if tensor.dim() else tensor.reshape(1)
    first, stop = shard_rows(whole.shape[0], shard, num_shards)
    return whole[first:stop]


@torch.no_grad()
def sharded_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    num_shards: int,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The total ``norm_type``-norm of ``tensors`` (whole gradients) as ``clip_grad_norm_`` on
    FSDP2's ``Shard(0)`` DTensors over ``num_shards`` ranks computed it (see the module).

    Raises:
        RecipeError: a norm type other than a positive one or ``inf`` (torch reduces those with
            placements this replay does not model).
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite (torch's own error).
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    _check_norm_type(norm_type)
    first_device = tensors[0].device
    # (S,) each rank's vector of its per-tensor local norms, in the order given
    per_shard = []
    for shard in range(num_shards):
        local = [_local_shard(t, shard, num_shards) for t in tensors]
        norms = (
            [torch.linalg.vector_norm(t, norm_type) for t in local]
            if foreach is False
            else torch._foreach_norm(local, norm_type)
        )
        per_shard.append(torch.stack([n.to(first_device) for n in norms]))
    return _total_of(per_shard, norm_type, error_if_nonfinite)


def _total_of(per_shard: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """Steps 3 of the module: the ranks' vectors of local norms made whole (the all-reduce in
    gloo's ring order, or ``MAX``), then the norm of that vector."""
    if norm_type == math.inf:
        whole = torch.stack(per_shard).amax(dim=0)
    else:
        whole = ring_sum([v**norm_type for v in per_shard]) ** (1.0 / norm_type)
    return _finite(torch.linalg.vector_norm(whole, norm_type), norm_type, error_if_nonfinite)


def _finite(total: torch.Tensor, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    """``total``, or torch's own error where ``error_if_nonfinite`` and it is NaN or infinite."""
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


@torch.no_grad()
def resharded_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    num_shards: int,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """:func:`sharded_total_norm` of gradients the sharded replay holds as DTensors cut over its own
    ``k`` processes (``replay/sharded_replayer.py``), as the job's ``num_shards`` ranks computed it.

    One gradient at a time is gathered whole (``full_tensor``: an all-gather over the replay's
    processes, as FSDP2's own unshard of a parameter), cut as the job's ranks held it, and each
    cut's norm taken alone (``_foreach_norm`` of a one-tensor list: its per-tensor result does not
    depend on the other tensors of the list), so no process holds more than one whole gradient. Every
    process computes the same total; it is returned replicated on the gradients' mesh, as torch's
    own DTensor total is.
    """
    from torch.distributed.tensor import DTensor, Replicate

    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    _check_norm_type(norm_type)
    mesh = next((t.device_mesh for t in tensors if isinstance(t, DTensor)), None)
    per_tensor = []
    for t in tensors:
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        local = [_local_shard(whole, shard, num_shards) for shard in range(num_shards)]
        per_tensor.append(
            [torch.linalg.vector_norm(piece, norm_type) for piece in local]
            if foreach is False
            else [torch._foreach_norm([piece], norm_type)[0] for piece in local]
        )
        del whole, local
    first_device = per_tensor[0][0].device
    per_shard = [torch.stack([norms[shard].to(first_device) for norms in per_tensor]) for shard in range(num_shards)]
    total = _total_of(per_shard, norm_type, error_if_nonfinite)
    if mesh is None:
        return total
    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)


@torch.no_grad()
def pipeline_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    mesh: ShardMesh,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The total norm of a pipeline job's gradients (the whole model's, one per parameter) as
    torchtitan computes it across the stages (``dist_utils.clip_grad_norm_`` with a ``pp`` mesh):
    each stage's norm over its own parameters, as ``clip_grad_norm_`` on its FSDP2 DTensors over the
    stage's data-parallel ranks (:func:`sharded_total_norm`), then ``norm ** p`` summed over the
    stages (their all-reduce: two terms are order-free; more are added in stage order) and
    ``** (1 / p)``; ``inf``: the stages' maximum."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    if len(tensors) != len(mesh.stages):
        raise RecipeError(
            f"the recipe clips {len(tensors)} gradients of a pipeline job whose stages hold {len(mesh.stages)} "
            "parameters: the replay reproduces clipping over every parameter of the whole model (frozen parameters "
            "are not replayed clipped yet)"
        )
    stages = sorted(set(mesh.stages))
    norms = [
        sharded_total_norm(
            [t for t, s in zip(tensors, mesh.stages) if s == stage], mesh.shard_size, norm_type, False, foreach
        )
        for stage in stages
    ]
    return _finite(_across_stages(norms, norm_type), norm_type, error_if_nonfinite)


def _across_stages(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torchtitan's combination of the stages' total norms: ``** p`` all-reduced over ``pp`` (two
    terms are order-free; more are added in stage order), ``** (1 / p)``; ``inf``: the maximum."""
    if norm_type == math.inf:
        return torch.stack(norms).amax()
    total = norms[0] ** norm_type
    for norm in norms[1:]:
        total = total + norm**norm_type
    return total ** (1.0 / norm_type)


@torch.no_grad()
def tp_total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    mesh: ShardMesh,
    grads: list[torch.Tensor | None],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The total norm of a tensor-parallel job's gradients as ``clip_grad_norm_`` on its ``(dp, tp)``
    DTensors computed it, from the exact TP replay's gradients (``replay/tp_exact.py``: DTensors on a
    1-D ``tp`` mesh of the replay's processes, process ``t`` holding TP slice ``t`` of each whole
    along ``dp``). ``grads``: the replay's gradient of each of the trace's parameters (None for a
    frozen one), so that each tensor clipped is known by its parameter.

    torch 2.13's arithmetic on the job's ranks (held bit for bit, for norm type 2, by the
    certifications of real clipped TP x FSDP2 jobs, DP 2 and 3 x TP 2, and a 3-D one, in
    ``tests/replay/test_tp_clipping.py``; ``inf`` follows torch's ``Partial("max")`` and is not
    tested):

    1. rank ``(d, t)`` takes ``_foreach_norm`` of its local shards (FSDP's rows ``d`` of TP's slice
       ``t``): ``_NormPartial(p)`` on ``dp``, and on ``tp`` too for a TP-cut parameter
       (``Replicate`` for a replicated one);
    2. ``torch.stack`` follows the partial placement on each dimension where any input is partial:
       a replicated norm is made partial over ``tp`` by ``_NormPartial._partition_value``,
       ``n / tp ** (1 / p)`` (``Partial("max")`` for ``inf``: unchanged);
    3. ``vector_norm`` of the stacked vector makes it whole one mesh dimension at a time, the outer
       (``dp``) first: ``** p``, an all-reduce (gloo's ring order, ``env.ring_sum``), ``** (1 / p)``
       (``inf``: the maximum), then the same over ``tp``, then the norm of the whole vector.

    A pipeline job's (``mesh.pp_dim >= 0``, PP x DP x TP) is that per stage, over the stage's
    parameters, combined across stages as torchtitan does (:func:`_across_stages`). Every process
    computes the same total (the ``tp`` step exchanges the processes' partial vectors); it is
    returned replicated on the gradients' mesh, as torch's own DTensor total is.
    """
    from torch.distributed.tensor import DTensor, Replicate

    from sdc_forensics.replay import distributed

    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    _check_norm_type(norm_type)
    where = {id(g): i for i, g in enumerate(grads) if g is not None}
    indices = [where.get(id(t)) for t in tensors]
    if None in indices:
        raise RecipeError(
            "the recipe clips tensors that are not the model's gradients: the exact tensor-parallel replay "
            "reproduces clipping of the gradients of the model it replays"
        )
    stage_of = (lambda i: mesh.stages[i]) if mesh.pp_dim >= 0 else (lambda i: 0)
    dp, tp = mesh.shard_size, mesh.tp_size

    def cut(i: int) -> int:
        return mesh.tp_shards[i] if i < len(mesh.tp_shards) else -1

    def reduce(vectors: list[torch.Tensor]) -> torch.Tensor:
        if norm_type == math.inf:
            return torch.stack(vectors).amax(dim=0)
        return ring_sum([v**norm_type for v in vectors]) ** (1.0 / norm_type)

    mine = {}
    for stage in sorted({stage_of(i) for i in indices}):
        chosen = [(t, i) for t, i in zip(tensors, indices) if stage_of(i) == stage]
        tp_partial = any(cut(i) >= 0 for _, i in chosen)
        per_dp = [[] for _ in range(dp)]
        for t, i in chosen:
            local = t.to_local() if isinstance(t, DTensor) else t
            for d in range(dp):
                piece = _local_shard(local, d, dp)
                norm = (
                    torch.linalg.vector_norm(piece, norm_type)
                    if foreach is False
                    else torch._foreach_norm([piece], norm_type)[0]
                )
                if tp_partial and cut(i) < 0 and norm_type != math.inf:
                    norm = norm / math.pow(tp, 1 / norm_type)
                per_dp[d].append(norm)
        vectors = [torch.stack(norms) for norms in per_dp]
        mine[stage] = (reduce(vectors), tp_partial)
    # every process's stages (each holds every stage, or its own: ``replay/pp_exact.py``), its TP
    # coordinates in process order
    every = distributed.exchange_objects(mine)
    norms = []
    for stage in sorted({s for part in every for s in part}):
        held = [part[stage] for part in every if stage in part]
        over_dp, tp_partial = held[0]
        whole = reduce([vector for vector, _ in held]) if tp_partial else over_dp
        norms.append(torch.linalg.vector_norm(whole, norm_type))
    total = _finite(_across_stages(norms, norm_type), norm_type, error_if_nonfinite)
    device_mesh = next((t.device_mesh for t in tensors if isinstance(t, DTensor)), None)
    if device_mesh is None:
        return total
    return DTensor.from_local(total, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)


@contextlib.contextmanager
def clipping_as_recorded(mesh: ShardMesh | None, resharded: bool = False) -> Iterator[None]:
    """Within it, torch's total gradient norm (``clip_grad_norm_``, ``get_total_norm``) is the
    sharded job's (:func:`sharded_total_norm` over ``mesh``'s shard dimension; ``resharded``: the
    gradients are the sharded replay's DTensors, :func:`resharded_total_norm`); outside, and for
    ``mesh`` None (a DDP trace), torch's own."""
    if mesh is None:
        yield
        return
    size = mesh.shard_size
    norm_of = resharded_total_norm if resharded else sharded_total_norm

    def total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None):
        if mesh.pp_dim >= 0:
            # a pipeline job: the norm across its stages, as torchtitan clips
            return pipeline_total_norm(tensors, mesh, norm_type, error_if_nonfinite, foreach)
        return norm_of(tensors, size, norm_type, error_if_nonfinite, foreach)

    with _total_norm_is(total_norm):
        yield


@contextlib.contextmanager
def tp_clipping_as_recorded(mesh: ShardMesh, grads) -> Iterator[None]:
    """Within it, torch's total gradient norm is the tensor-parallel job's (:func:`tp_total_norm`);
    ``grads()``: the exact TP replay's gradient of each of the trace's parameters (None: frozen)."""

    def total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None):
        return tp_total_norm(tensors, mesh, grads(), norm_type, error_if_nonfinite, foreach)

    with _total_norm_is(total_norm):
        yield


@contextlib.contextmanager
def _total_norm_is(total_norm) -> Iterator[None]:
    """torch's ``_get_total_norm`` (which ``clip_grad_norm_`` calls) and the public ``get_total_norm``
    (torchtitan's) replaced by ``total_norm`` within it."""
    saved = (_clip_grad._get_total_norm, torch.nn.utils.get_total_norm)
    _clip_grad._get_total_norm = total_norm
    torch.nn.utils.get_total_norm = total_norm
    try:
        yield
    finally:
        _clip_grad._get_total_norm, torch.nn.utils.get_total_norm = saved
