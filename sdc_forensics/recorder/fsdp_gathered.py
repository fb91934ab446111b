"""A sharded job's consensus without replicas: every rank gathers the same whole parameters for its
forward (FSDP2's all-gather), so the ranks' digests of what they gathered are voted.

Composed by ``fsdp_layout.py``: :func:`watch` digests this rank's gathered copies at each forward of
a ``fully_shard`` module (on the steps whose weights are compared), :func:`vote` votes the ranks'
combined digests (``GATHER_DIVERGED``), and :func:`drill` is the ``all-gather-output`` fault drill.
Its own module so that the layout stays one screenful per concern (issue 34).
"""

from __future__ import annotations

import numpy as np
import torch

from sdc_forensics.fingerprint.core import combine_digests, digests
from sdc_forensics.inject import flip_bit_
from sdc_forensics.recorder import checks
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checks import Check, Finding
from sdc_forensics.recorder.layout import Job, local_tensor
from sdc_forensics.recorder.step import StepState
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import hex64


def watch(modules: list[torch.nn.Module], job: Job) -> list:
    """The consensus a sharded job has without replicas: every rank gathers the same whole
    parameters for its forward. At each forward of a ``fully_shard`` module (after FSDP gathered
    its group) this rank's copies are digested, on the steps whose weights are compared
    (``weights_every``); :func:`vote` votes the ranks' combined digests."""
    options = job.options

    def hook(module, args, kwargs):
        state = job.current()
        if state is None or not options.compares_weights(state.step):
            return None
        for group in fm.groups_of(module):
            params = [fp.unsharded_param.detach().reshape(-1) for fp in group.fsdp_params]
            state.gathered.append(combine_digests(digests(params, options.seed)))
        return None

    # appended: FSDP's own pre-forward (prepended) has gathered the group
    return [module.register_forward_pre_hook(hook, with_kwargs=True) for module in modules]


def vote(state: StepState, table: np.ndarray, me: int, mesh, *, explained: bool) -> list[Finding]:
    """The ranks' digests of the parameters they gathered this step (0: none taken) voted: a
    strict majority names the ranks that computed with other parameters (``GATHER_DIVERGED``);
    without one (2 ranks, or HSDP's replicas split evenly, as a shard changed at rest makes
    them) the finding names no rank, and the rest check or the replay settles it; ``explained``:
    the rest check named a shard changed at rest this step, which splits the replicas so."""
    if not table.any() or not table.all():
        return []
    found = checks.strict_majority(table)
    if not found.diverged or (found.value is None and explained):
        return []
    if found.value is None:
        return [
            Finding(
                check=Check.WEIGHTS,
                step=state.step,
                rank=-1,
                flag=F.Flag.NO_MAJORITY,
                ranks=(),
                detail=f"the ranks gathered different parameters for step {state.step}'s forward and no strict majority "
                f"agrees ({', '.join(f'rank {r}: {hex64(int(v))}' for r, v in enumerate(table))})",
            )
        ]
    if me in found.diverged:
        state.flags |= int(F.Flag.GATHER_DIVERGED)
    return [
        Finding(
            check=Check.WEIGHTS,
            step=state.step,
            rank=rank,
            flag=F.Flag.GATHER_DIVERGED,
            ranks=(rank,),
            detail=f"rank {rank} ({mesh.where(rank)}): the parameters it gathered for step {state.step}'s forward "
            f"differ from the {len(found.agreeing)} ranks' that agree ({hex64(int(table[rank]))}, not {hex64(int(found.value))})",
        )
        for rank in found.diverged
    ]


def drill(modules: list[torch.nn.Module], job: Job, specs: list) -> list:
    """``all-gather-output`` drills: at the first forward of a ``fully_shard`` module in the step,
    after FSDP gathered its parameters, flip a bit of this rank's gathered copy of the group's
    first parameter (the forward computes with it; the backward gathers again)."""
    fired: set = set()

    def hook(module, args, kwargs):
        state = job.current()
        if state is None:
            return None
        for spec in specs:
            if spec.step != state.step or spec.rank != job.rank or id(spec) in fired:
                continue
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            if group is None or not group.fsdp_params:
                continue
            fired.add(id(spec))
            with torch.no_grad():
                # this rank's own tensor: under TP the gathered parameter is a DTensor, whose reshape would be a
                # collective that this rank alone enters (the job hangs)
                flat = local_tensor(group.fsdp_params[0].unsharded_param).data.reshape(-1)
                flip_bit_(flat, (spec.element or 0) % flat.numel(), spec.bit)
        return None

    # registered after FSDP's own pre-forward: the parameters are gathered
    return [module.register_forward_pre_hook(hook, with_kwargs=True) for module in modules]
