"""Audits: a rank on another node recomputes a rank's microbatches with the same weights (theta_s).

Protocol at an audited step (every rank runs it, between the all-reduce and the update):

1. ``all_gather_object`` of every rank's own result: microbatch IDs, loss, local-gradient digest,
   input digest.
2. Each rank ``a`` recomputes the microbatches of its subject ``s`` (the next rank, in rank order,
   on another node) and the results are gathered. A pair whose gradient digests differ is a
   mismatch.
3. Each mismatch gets a third, independent recomputation by a rank on a node that is neither
   ``a``'s nor ``s``'s; the majority of the three digests names the rank that computed wrongly
   (``s`` if the tiebreaker agrees with ``a``, ``a`` if it agrees with ``s``). With fewer than
   three nodes there is no tiebreaker and the finding cannot name a rank.

On CPU the recomputation runs at the subject's intra-op thread count (gathered in step 1): its
reductions are split by that count, so any other count would dispute a clean rank whose job runs
ranks at different counts. Recomputation uses ``torch.autograd.grad`` on the bare module: ``.grad`` fields, DDP's reducer
and the optimizer are never touched; the RNG state and module buffers (e.g. BatchNorm running
statistics) are saved and restored, so training numerics are unchanged. The recipe must be
deterministic (no dropout randomness that differs between calls), as replay also requires.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sdc_forensics.fingerprint.core import Fingerprint, combine, combine_digests, fingerprint, num_sketch_blocks
from sdc_forensics.intraop import intra_op_threads
from sdc_forensics.recorder import records
from sdc_forensics.recorder.checks import AUDIT, Finding
from sdc_forensics.recorder.threads import ThreadWatch
from sdc_forensics.statedict import tensor_digests
from sdc_forensics.trace.format import Flag
from sdc_forensics.trace.manifest import audit_reach

log = logging.getLogger("sdc_forensics.recorder")


def inexact_reason(device: torch.device) -> str | None:
    """Why an audit recomputation on ``device`` cannot be bitwise exact under the job's current
    settings (None when it can): on a GPU, non-deterministic kernels (atomics, the cuDNN autotuner)
    may give another gradient for the same microbatch on a healthy GPU, so a mismatch is not a vote.
    Read at every audited step, so a job that turns determinism on after attaching is audited."""
    if device.type != "cuda":
        # CPU kernels are deterministic at a given thread count (the audit uses the subject's)
        return None
    if not torch.are_deterministic_algorithms_enabled():
        return (
            "the job allows non-deterministic GPU kernels (torch.use_deterministic_algorithms(False)): a "
            "recomputation need not match a healthy rank bit for bit"
        )
    if torch.backends.cudnn.benchmark:
        return "cudnn.benchmark=True lets the autotuner pick other kernels for a recomputation"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OwnResult:
    """What a rank computed itself at the audited step."""

    ids: tuple[int, ...]
    loss: float
    digest: int
    input_digest: int
    # the intra-op CPU thread count that computed the gradient (0: unknown)
    num_threads: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recomputation:
    """One audit recomputation: ``auditor`` recomputed ``subject``'s microbatches."""

    auditor: int
    subject: int
    ids: tuple[int, ...]
    loss: float
    digest: int
    input_digest: int
    subject_digest: int
    # kept by the rank that computed it, not gathered
    fingerprint: Fingerprint | None = None
    tiebreak: bool = False
    mismatch: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditOutcome:
    """What one audited step produced, as seen by one rank."""

    # the ones this rank performed
    recomputations: tuple[Recomputation, ...]
    audited_me: bool
    disputed_me: bool
    findings: tuple[Finding, ...]


def pick_subject(rank: int, nodes: tuple[int, ...]) -> int | None:
    """The first rank after ``rank`` (cyclically) on another node, None on a single node."""
    world_size = len(nodes)
    for d in range(1, world_size):
        other = (rank + d) % world_size
        if nodes[other] != nodes[rank]:
            return other
    return None


def pick_tiebreaker(auditor: int, subject: int, nodes: tuple[int, ...]) -> int | None:
    """A rank on a third node (neither the auditor's nor the subject's), None if there is none."""
    world_size = len(nodes)
    for d in range(1, world_size):
        other = (subject + d) % world_size
        if nodes[other] not in (nodes[auditor], nodes[subject]):
            return other
    return None


def recompute(
    module: torch.nn.Module,
    recipe: Any,
    ids: tuple[int, ...],
    layout: list[list[int]],
    *,
    device: torch.device,
    sketch_k: int,
    seed: int,
) -> tuple[float, Fingerprint, int]:
    """Loss, local-gradient fingerprint and input digest of ``ids`` with the module's current weights.

    The gradient is summed over the microbatches as DDP accumulates it, laid out in the DDP
    bucket order ``layout`` and fingerprinted bucket by bucket, like the comm hook does.
    """
    params = list(module.parameters())
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and device.type == "cuda" else None
    saved_buffers = [b.detach().clone() for b in module.buffers()]
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    grads: dict[int, torch.Tensor] = {}
    loss_sum = 0.0
    input_digests = []
    try:
        for mb_id in ids:
            microbatch = recipe.fetch_microbatch(int(mb_id), device)
            input_digests.extend(tensor_digests(microbatch, seed))
            loss = recipe.loss(module, microbatch)
            loss_sum += float(loss.detach())
            found = torch.autograd.grad(loss, [params[i] for i in trainable], allow_unused=True)
            for i, g in zip(trainable, found):
                if g is not None:
                    grads[i] = g if i not in grads else grads[i] + g
    finally:
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for buf, saved in zip(module.buffers(), saved_buffers):
                buf.copy_(saved)
    parts, offset = [], 0
    for bucket in layout:
        flat = torch.cat(
            [
                grads[i].reshape(-1)
                if i in grads
                else torch.zeros(params[i].numel(), dtype=params[i].dtype, device=device)
                for i in bucket
            ]
        )
        parts.append(fingerprint(flat, k=sketch_k, seed=seed, block_offset=offset))
        offset += num_sketch_blocks(flat.numel())
    return loss_sum, combine(parts), combine_digests(input_digests)


def run_audit(
    *,
    step: int,
    own: OwnResult,
    module: torch.nn.Module,
    recipe: Any,
    layout: list[list[int]],
    nodes: tuple[int, ...],
    group: Any,
    device: torch.device,
    sketch_k: int,
    seed: int,
) -> AuditOutcome:
    """Run the audit protocol (a collective: every rank of ``group`` must call it at the same step)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    owns: list[OwnResult | None] = [None] * world_size
    dist.all_gather_object(owns, own, group=group)

    def _do(subject: int, tiebreak: bool) -> Recomputation:
        # on CPU the subject's gradient is reproducible only at the thread count it ran with
        threads = owns[subject].num_threads if device.type == "cpu" else 0
        with intra_op_threads(threads):
            loss, fp, in_digest = recompute(
                module, recipe, owns[subject].ids, layout, device=device, sketch_k=sketch_k, seed=seed
            )
        return Recomputation(
            auditor=rank,
            subject=subject,
            ids=owns[subject].ids,
            loss=loss,
            digest=fp.digest,
            fingerprint=fp,
            input_digest=in_digest,
            subject_digest=owns[subject].digest,
            tiebreak=tiebreak,
            mismatch=fp.digest != owns[subject].digest,
        )

    subjects = [pick_subject(r, nodes) for r in range(world_size)]
    mine = [_do(subjects[rank], False)] if subjects[rank] is not None else []
    first: list[list[Recomputation] | None] = [None] * world_size
    dist.all_gather_object(first, [dataclasses.replace(m, fingerprint=None) for m in mine], group=group)
    first_flat = [r for per in first for r in per]
    disputes = [r for r in first_flat if r.mismatch]
    jobs = [(d, pick_tiebreaker(d.auditor, d.subject, nodes)) for d in disputes]
    tiebreaks_flat: list[Recomputation] = []
    if disputes:
        for dispute, breaker in jobs:
            if breaker == rank:
                mine.append(_do(dispute.subject, True))
        second: list[list[Recomputation] | None] = [None] * world_size
        dist.all_gather_object(
            second, [dataclasses.replace(m, fingerprint=None) for m in mine if m.tiebreak], group=group
        )
        tiebreaks_flat = [r for per in second for r in per]
    findings = []
    for dispute, breaker in jobs:
        findings.append(_verdict(step, dispute, breaker, tiebreaks_flat, owns))
    return AuditOutcome(
        recomputations=tuple(mine),
        audited_me=any(r.subject == rank for r in first_flat),
        disputed_me=any(r.subject == rank for r in disputes),
        findings=tuple(findings),
    )


def _verdict(step: int, dispute: Recomputation, breaker: int | None, tiebreaks: list[Recomputation], owns) -> Finding:
    a, s = dispute.auditor, dispute.subject
    input_note = ""
    if dispute.input_digest != owns[s].input_digest:
        input_note = "; the refetched input differs from the input rank {s} consumed (input-data fault)".format(s=s)
    third = next((t for t in tiebreaks if t.subject == s and t.auditor == breaker), None)
    base = f"rank {a} recomputed rank {s}'s microbatches {', '.join(map(str, dispute.ids))} at step {step} and got a different gradient"
    if third is None:
        return Finding(
            check=AUDIT,
            step=step,
            rank=-1,
            ranks=(a, s),
            flag=Flag.AUDIT_MISMATCH,
            detail=base + "; no rank on a third node to break the tie" + input_note,
        )
    t_digest, a_digest, s_digest = third.digest, dispute.digest, owns[s].digest
    if t_digest == a_digest != s_digest:
        culprit, why = s, f"rank {breaker} agrees with rank {a}: rank {s} computed its gradient wrongly"
    elif t_digest == s_digest != a_digest:
        culprit, why = a, f"rank {breaker} agrees with rank {s}: the auditor, rank {a}, computed wrongly"
    else:
        culprit, why = -1, f"rank {breaker} agrees with neither: no majority of three"
    return Finding(
        check=AUDIT,
        step=step,
        rank=culprit,
        ranks=(culprit,) if culprit >= 0 else (a, s),
        flag=Flag.AUDIT_MISMATCH,
        detail=f"{base}; {why}{input_note}",
    )


#: the bytes one rank may spend on a sharded job's audit (binary suffixes, as ``SDC_FORENSICS_REPLAY_MEMORY``);
#: unset: the device's free memory when the Recorder is built
AUDIT_BUDGET_ENV = "SDC_FORENSICS_AUDIT_MEMORY"


def sharded_audit_bytes(params: list[torch.Tensor]) -> int:
    """What an audit of a sharded job materialises on every rank for its length (0 for a DDP job,
    whose audits recompute on the job's own module): the recipe's whole model, the whole parameters
    all-gathered into it (``FSDPLayout.audit_module``), the recomputation's whole gradients
    (``torch.autograd.grad``), three times the parameters' whole bytes, plus the replay's activation
    allowance (``replay/memory.py``)."""
    from sdc_forensics.replay.memory import activation_allowance

    if not any(hasattr(p, "full_tensor") for p in params):
        return 0
    whole = sum(p.numel() * p.element_size() for p in params)
    return 3 * whole + activation_allowance(whole)


def audit_refusal(options: Any, params: list[torch.Tensor], device: torch.device) -> str | None:
    """The one line a Recorder with audits on a sharded job refuses with when a rank cannot hold the
    audit's whole model (:func:`sharded_audit_bytes`) within ``SDC_FORENSICS_AUDIT_MEMORY`` (else
    the device's free memory); None when it fits, when audits are off or the budget is unknown."""
    from sdc_forensics.replay.memory import device_budget, human

    if not (options.audit_every or options.audit_steps):
        return None
    need = sharded_audit_bytes(params)
    budget, source = device_budget(str(device), env=AUDIT_BUDGET_ENV)
    if not need or budget is None or need <= budget:
        return None
    return (
        f"audits of this sharded job recompute a rank's microbatches on a whole copy of the model: "
        f"{human(need)} per rank for the audit's length, more than {human(budget)} ({source}); record without "
        f"audit_every/audit_steps (the sharded replay recomputes every rank offline: sdc-forensics certify under "
        f"torchrun), or raise {AUDIT_BUDGET_ENV}"
    )


class Auditor:
    """A recorder's audits: which steps are due, the recipe they recompute with (loaded at the
    first), and the run itself on the module its layout lends (``Layout.audit_module``).

    Args:
        recipe, recipe_args: the replay recipe's ``module:attribute`` and arguments.
        options: the recorder's options (``audit_every``, ``audit_steps``, fingerprint settings).
        rank, nodes, group, device: this rank, every rank's node, the group, the model's device.
    """

    @staticmethod
    def refusal(recorder: Any) -> str | None:
        """:func:`audit_refusal` of a Recorder being built (its options, parameters, device): it is
        checked with the layout's own refusals, on every rank together, before the trace opens."""
        return audit_refusal(recorder.options, recorder.params, recorder.device)

    def __init__(
        self,
        *,
        recipe: str | None,
        recipe_args: dict | None,
        options: Any,
        rank: int,
        nodes: tuple[int, ...],
        group: Any,
        device: torch.device,
    ) -> None:
        self.recipe_ref, self.recipe_args, self.options = recipe, recipe_args, options
        self.rank, self.nodes, self.group, self.device = rank, nodes, group, device
        self.recipe = None
        # the audits skipped for non-deterministic GPU kernels were said once
        self.said_inexact = False
        reach = audit_reach(nodes) if (options.audit_every or options.audit_steps) else None
        # once per job, at attach: not a silent no-op at every audited step
        if reach is not None and rank == 0:
            log.warning("sdc-forensics: audits are on (audit_every=%d), but %s", options.audit_every, reach)

    def due(self, step: int) -> bool:
        """Whether ``step`` is audited now: due by the options, and exact on this device (else
        skipped, not voted, and said once). The same answer on every rank."""
        if not self.options.audits(step):
            return False
        inexact = inexact_reason(self.device)
        if inexact is None:
            return True
        if not self.said_inexact:
            self.said_inexact = True
            if self.rank == 0:
                log.warning(
                    "sdc-forensics: audits are on, but %s: they are skipped, not voted; make the run "
                    "replayable (sdc_forensics.recorder.replayable()) for audits that can name a rank",
                    inexact,
                )
        return False

    def audit_step(self, state: Any, loss: Callable[[], float], module_for: Callable, writer: Any) -> list[Finding]:
        """The audit of ``state``'s step when it is due (a collective), its flags set on the step and
        its AUDIT records written; nothing otherwise. ``loss``: the step's loss, read only then."""
        if not self.due(state.step):
            return []
        own = OwnResult(
            ids=state.ids or (),
            loss=loss(),
            digest=state.local.digest if state.local else 0,
            input_digest=combine_digests(state.input_digests) if state.input_digests else 0,
            num_threads=state.num_threads or ThreadWatch.current(),
        )
        state.audit = outcome = self.run(state.step, own, module_for)
        if outcome.audited_me:
            state.flags |= int(Flag.AUDITED)
        if outcome.disputed_me:
            state.flags |= int(Flag.AUDIT_MISMATCH)
        records.append_audits(writer, state.step, outcome.recomputations)
        return list(outcome.findings)

    def run(
        self,
        step: int,
        own: OwnResult,
        module_for: Callable[[Any], contextlib.AbstractContextManager[tuple[torch.nn.Module, list[list[int]]]]],
    ) -> AuditOutcome:
        """The audit protocol at ``step`` (:func:`run_audit`, a collective) on the module and buckets
        ``module_for(recipe)`` lends for its length."""
        if self.recipe is None:
            from sdc_forensics.recipe import load_recipe

            self.recipe = load_recipe(self.recipe_ref, args=self.recipe_args)
        with module_for(self.recipe) as (module, buckets):
            return run_audit(
                step=step,
                own=own,
                module=module,
                recipe=self.recipe,
                layout=buckets,
                nodes=self.nodes,
                group=self.group,
                device=self.device,
                sketch_k=self.options.sketch_k,
                seed=self.options.seed,
            )
