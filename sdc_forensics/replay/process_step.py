"""What a replay spread over torchrun processes does the same way whatever the split: the sharded
replay (``sharded_replayer.py``: FSDP over k processes) and the exact tensor-parallel replay
(``tp_exact.py``: the job's TP plan) differ in how they recompute each recorded rank's local
gradient and its reduction, not in how a step is judged and ended. Written once here:

* :func:`same_optimizer`: the recipe's optimizer rebuilt over the replay's own parameters;
* :func:`judge_locals`: the local gradients compared with the record (exact, or within tolerance
  once the replay has departed), a mismatch replayed again for a majority of three;
* :func:`update_and_compare`: the recipe's update on the replay's parameters, then the weights
  compared with the record;
* :func:`result`: the replay's :class:`ReplayResult`.
"""

from __future__ import annotations

import contextlib
import inspect

from sdc_forensics import recipe as recipe_mod
from sdc_forensics.evidence import EvidenceKind
from sdc_forensics.replay import env
from sdc_forensics.replay.replayer import ReplayResult


def same_optimizer(meta_opt, meta_params, params):
    """The recipe's optimizer (class, hyperparameters, groups) rebuilt over ``params``, the replay's
    own parameters in the order of ``meta_params`` (the recipe's); None where this process holds no
    such parameter (another pipeline stage's: ``pp_exact.py``), left out of its group."""
    where = {id(p): i for i, p in enumerate(meta_params)}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [params[where[id(p)]] for p in g["params"] if params[where[id(p)]] is not None],
        }
        for g in meta_opt.param_groups
    ]
    groups = [g for g in groups if g["params"]]
    # the defaults the constructor takes (AdamW's carry decoupled_weight_decay, which its __init__ does not);
    # every group holds every hyperparameter already
    accepted = inspect.signature(type(meta_opt).__init__).parameters
    return type(meta_opt)(groups, **{k: v for k, v in meta_opt.defaults.items() if k in accepted})


def microbatches_backward(replayer, model, record) -> tuple[float, list]:
    """The record's microbatches fetched again, each forward and backward through ``model`` (inside
    the recipe's ``train_context``): ``(loss total, batches)``."""
    batches, total = [], 0.0
    for mb_id in replayer.trace.microbatch_ids(record):
        batch = replayer.recipe.fetch_microbatch(int(mb_id), replayer.device)
        loss = recipe_mod.loss_and_backward(replayer.recipe, model, batch)
        total += float(loss.detach())
        batches.append(batch)
    return total, batches


def judge_locals(replayer, step, recs, ranks, tolerant: bool, tie_break, notes: list):
    """The step's local gradients against the record: ``(bad ranks, evidence, departed)``.

    A step whose every rank differs in the last bits is not exact here: compared within tolerance
    from it on (``departed``). A mismatch in an exact replay is replayed again (``tie_break(step,
    recs, ranks, bad)`` -> (bad, notes)) and only the ranks the vote keeps are named."""
    departed = False
    local_bad, step_evidence = replayer._compare_locals(step, recs, ranks, tolerant, 0, True)
    if local_bad is None:
        notes.append(f"step {step}: every rank's local gradient differs in the last bits: not exact here")
        local_bad, step_evidence = replayer._compare_locals(step, recs, ranks, True, 0, True)
        departed = tolerant = True
    if local_bad and not tolerant:
        local_bad, tie_notes = tie_break(step, recs, ranks, local_bad)
        notes += tie_notes
        step_evidence = [
            e for e in step_evidence if e.kind is not EvidenceKind.REPLAY_MISMATCH or set(e.ranks) & set(local_bad)
        ]
    return local_bad, step_evidence, departed


def update_and_compare(replayer, step, recs, model, optimizer, scheduler, tolerant, suspicious, clip=None):
    """The recipe's ``before_step`` (inside ``clip``, the context that makes clipping's norm the
    job's), ``optimizer.step()``, ``after_step``, then the weights compared with the record:
    ``(evidence, departed)`` as ``replayer._compare_weights`` returns them."""
    with clip if clip is not None else contextlib.nullcontext():
        recipe_mod.before_step(replayer.recipe, model, optimizer, step=step)
    optimizer.step()
    recipe_mod.after_step(replayer.recipe, model, optimizer, scheduler, step=step)
    optimizer.zero_grad(set_to_none=True)
    return replayer._compare_weights(step, recs, model, tolerant, suspicious)


def result(replayer, options, *, last, device, departed_from, evidence, first_divergent, notes) -> ReplayResult:
    """The :class:`ReplayResult` of a replay spread over processes (always the ordered reduction);
    ``departed_from``: the first step compared within tolerance, kept only if it was replayed."""
    tolerant_from = departed_from if departed_from is not None and departed_from <= last else None
    return ReplayResult(
        start_step=options.start_step,
        stop_step=options.stop_step,
        last_step=last,
        device=device,
        comparison="exact" if tolerant_from is None else "tolerant",
        tolerant_from=tolerant_from,
        reduction_order=env.ORDERED,
        evidence=tuple(evidence),
        first_divergent_step=first_divergent,
        settings={},
        notes=tuple(notes),
        max_residual_ratio=round(replayer.max_ratio, 4),
    )


def compare_reduced(replayer, step, recs, expected_of, piece: str, mean: str) -> list:
    """Each recorded rank's ``piece`` (``shard``, ``box``) of the replayed ``mean`` against its
    recorded reduced digest: the ranks in the minority named (``compare._reduced_minority``), or,
    when no rank received what the replay computed, the collective itself. ``expected_of()``: the
    replay's digest per recorded rank (computed only for steps that recorded gradients)."""
    import numpy as np

    from sdc_forensics.evidence import Evidence, Location
    from sdc_forensics.trace import format as F

    if not ((recs["flags"] & int(F.Flag.HAS_GRADS)) != 0).all():
        return []
    expected = expected_of()
    if (recs["reduced_digest"].astype(np.uint64) == expected).any():
        return replayer._reduced_minority(step, recs, expected)
    return [
        Evidence(
            kind=EvidenceKind.REPLAY_MISMATCH,
            step=step,
            ranks=(),
            source="replay",
            location=Location.COLLECTIVE,
            expected=f"every rank's {piece} of the replayed {mean}",
            found=f"no rank's {piece} as replayed",
            detail="the reduce-scatter result every rank received is not the mean of the replayed local gradients",
        )
    ]
