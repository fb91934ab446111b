"""The replay of a pipeline-parallel job at its layout: ``pp x tp`` processes, one stage each.

``torchrun --nproc-per-node PP*TP -m sdc_forensics certify TRACE`` with as many processes as the
job's pipeline degree times its TP degree (PP alone: ``PP``): ``replay/window.py`` chooses this
replay when the trace is a pipeline job with one stage per rank (``recorder/pp_layout.py``), the
processes are that many and the recipe has the ``pipeline_stage`` and ``pipeline_loss`` hooks (and
``parallelize`` where the job has TP; docs/recipes.md). No process holds more than its stage, as in
the job; without them the whole model is replayed on one process (``replay/pp.py``) or, for a
3-D job, on ``tp`` processes each holding every stage (``replay/tp_exact.py``).

Process ``s * TP + t`` is stage ``s``, TP coordinate ``t``: it plays the recorded ranks
``(pp=s, dp=d, tp=t)`` for every data-parallel coordinate ``d``. It builds the recipe's whole
model, keeps stage ``s`` (``pipeline_stage(model, s, PP)``: the job's own cut, whose parameters
keep their whole-model names), applies the recipe's TP plan on the ``tp`` dimension of a
``(pp, tp)`` mesh of the replay's processes, rebuilds the recipe's optimizer over the stage's
parameters and loads the checkpoint into them (``load_checkpoint``: DCP reads only the stage's
tensors). Per step and DP coordinate, each microbatch runs forward stage by stage, each process
sending its output to the next stage's process of its TP coordinate and the last computing
``pipeline_loss(output, batch)``, then backward stage by stage, each sending the gradient of its
input back: the job's schedule's arithmetic (each stage's gradient accumulated over the
microbatches in order; ``Schedule1F1B`` and ``ScheduleGPipe`` run the same backwards in the same
order per stage, only interleaved differently in time), with real point-to-point hand-offs. The
rest is the exact TP replay's (:class:`~sdc_forensics.replay.tp_exact.TpExactReplayer`): each
rank's local gradient compared bit for bit by its box, the DP mean in DP order, the schedule's
division, clipping's norm as the job's stages computed it (``clipping.tp_total_norm``, the stages
combined across the processes), the optimizer's step, the boxes of the reduced gradient and the
weights. Each process holds one stage's parameters, optimizer state and activations: the replay
needs what one rank of the job needed, times its DP count's microbatches in turn.

Not replayed here (the other replays remain): several stages per rank (an interleaved schedule:
the one-process replay), a stage whose output is a DTensor rather than the plain tensor
``PipelineStage`` hands on (refused in one line).
"""

from __future__ import annotations

import dataclasses

import torch

from sdc_forensics.errors import RecipeError
from sdc_forensics.evidence import EvidenceKind
from sdc_forensics.fingerprint.core import combine_digests, digests
from sdc_forensics.trace import format as F
from sdc_forensics.replay import distributed, process_step
from sdc_forensics.replay.replayer import _recipe_call
from sdc_forensics.replay.tp_exact import TpExactReplayer

# the dtypes an activation is handed on in (their code in the header sent before it)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
#: the most dimensions a handed-on activation has (the header's size)
_MAX_DIMS = 8


def one_stage_per_rank(mesh) -> bool:
    """Whether each pipeline coordinate holds one contiguous stage (the whole model's parameters in
    stage order), not several (an interleaved schedule's "loop" placement)."""
    return bool(mesh.stages) and list(mesh.stages) == sorted(mesh.stages)


def processes(trace) -> int:
    """How many processes replay the pipeline job at its layout: ``PP x TP``."""
    mesh = trace.manifest.parallel
    return mesh.shape[mesh.pp_dim] * mesh.tp_size


def wanted(trace, recipe) -> bool:
    """Whether this replay is the one: a pipeline trace with one stage per rank, ``PP x TP``
    processes, a recipe with the stage hooks (and ``parallelize`` for a TP job)."""
    mesh = trace.manifest.parallel
    group = distributed.current()
    return (
        mesh is not None
        and mesh.pp_dim >= 0
        and group is not None
        and one_stage_per_rank(mesh)
        and group.size == processes(trace)
        and callable(getattr(recipe, "pipeline_stage", None))
        and callable(getattr(recipe, "pipeline_loss", None))
        and (mesh.tp_size == 1 or callable(getattr(recipe, "parallelize", None)))
    )


def check_memory(trace, options, device, infos) -> None:
    """Refuse (one line, exit 2) a replay whose processes cannot each hold their part: the model's
    state and the recipe's optimizer's divided over the ``PP x TP`` processes (``replay/memory.py``).

    Raises:
        MemoryRefused: it does not fit the budget.
    """
    from sdc_forensics.replay import memory, sharded

    plan, n = sharded.plan_of(trace, options, device, infos), processes(trace)
    if plan is not None and not plan.fits(n):
        # the job's layout fixes the process count: no other count to suggest
        raise memory.MemoryRefused(
            f"the replay at the job's layout ({n} processes, one stage each) needs "
            f"{memory.human(plan.per_process(n))} per process and the budget is {memory.human(plan.budget)} "
            f"({plan.budget_source}): raise {memory.BUDGET_ENV} or use a device with more memory"
        )


class PpExactReplayer(TpExactReplayer):
    """The replay of a pipeline trace with one stage per process (see the module)."""

    KIND = "pipeline parallel"

    def _prepare(self, group, model, optimizer):
        """Stage ``rank // TP`` of the recipe's model, with the TP plan on ``tp`` where the job has TP."""
        mesh = self.mesh
        tp, stages = mesh.tp_size, mesh.shape[mesh.pp_dim]
        self.stage, self.tp_coordinate = divmod(group.rank, tp)
        whole = list(model.parameters())
        where = {name: j for j, (name, _) in enumerate(model.named_parameters())}
        geometry = [(tuple(p.shape), p.requires_grad) for p in whole]
        part = _recipe_call("pipeline_stage", self.recipe.pipeline_stage, model, self.stage, stages)
        named = list(part.named_parameters())
        index = [where.get(name, -1) for name, _ in named]
        recorded = [j for j, s in enumerate(mesh.stages) if s == self.stage]
        problem = ""
        if -1 in index:
            problem = (
                f"the recipe's pipeline_stage(model, {self.stage}, {stages}) holds {named[index.index(-1)][0]!r}, not a "
                "parameter name of the whole model: keep the whole model's names in each stage (torchtitan's cut)"
            )
        elif sorted(index) != recorded:
            problem = (
                f"the recipe's stage {self.stage} holds parameters {_span(sorted(index))} of the whole model; the "
                f"job's stage {self.stage} recorded {_span(recorded)}: cut the model as the job did"
            )
        # every process stops alike (one alone would leave the others waiting in the checkpoint's load)
        problems = [p for p in distributed.exchange_objects(problem) if p]
        if problems:
            raise RecipeError(problems[0])
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            grid = init_device_mesh(self.device.type, (stages, tp), mesh_dim_names=("pp", "tp"))
            part = _recipe_call("parallelize", self.recipe.parallelize, part, grid["tp"]) or part
        params = [p for _, p in part.named_parameters()]
        slots = [None] * len(whole)
        for j, p in zip(index, params):
            slots[j] = p
        optimizer = process_step.same_optimizer(optimizer, whole, slots)
        self._stages = stages
        return part, optimizer, params, index, geometry

    def _plays(self, rank: int) -> bool:
        return self.mesh.pp_of(rank) == self.stage and self.mesh.tp_of(rank) == self.tp_coordinate

    def _note(self, group) -> str:
        tp = self.mesh.tp_size
        return (
            f"pipeline parallel, exact, at the job's layout: {group.size} processes, one stage each "
            f"({self._stages} stages" + (f" x TP {tp}" if tp > 1 else "") + "), the activations handed on between them"
        )

    def _forward_backward(self, model, record) -> tuple[float, list]:
        """The record's microbatches through the stages in turn (see the module): ``(loss total, batches)``;
        the total is the last stage's (other stages compute no loss)."""
        import contextlib

        context = getattr(self.recipe, "train_context", None)
        tp = self.mesh.tp_size
        before = (self.stage - 1) * tp + self.tp_coordinate
        after = (self.stage + 1) * tp + self.tp_coordinate
        last = self.stage == self._stages - 1
        batches, total, sent, back = [], 0.0, [], []
        for mb_id in self.trace.microbatch_ids(record):
            batch = self.recipe.fetch_microbatch(int(mb_id), self.device)
            batches.append(batch)
            with context() if context is not None else contextlib.nullcontext():
                if self.stage == 0:
                    x = self.recipe.pipeline_input(batch) if hasattr(self.recipe, "pipeline_input") else batch[0]
                else:
                    x = _receive(before, self.device).requires_grad_()
                out = model(x)
                if last:
                    loss = self.recipe.pipeline_loss(out, batch)
                    loss.backward()
                    total += float(loss.detach())
                else:
                    if hasattr(out, "device_mesh"):
                        raise RecipeError(
                            f"stage {self.stage} returns a DTensor: a pipeline stage hands on a plain tensor "
                            "(use_local_output=True on its last layer's plan), as PipelineStage requires"
                        )
                    _send(out.detach(), after)
                    grad = _receive(after, self.device)
                    out.backward(grad)
                    sent += digests([out.detach()], self.seed)
                    back += digests([grad], self.seed)
                if self.stage > 0:
                    _send(x.grad, before)
        # what the recorder's HANDOFF record holds (recorder/pp_layout.py)
        self._handoff = None if last else (_combined(sent), _combined(back))
        return total, batches

    def _local(self, model, record, ranks):
        found, grads = super()._local(model, record, ranks)
        for rank in found:
            found[rank]["handoff"] = self._handoff
        return found, grads

    def _compare_locals(self, step, recs, ranks, tolerant, drift, recorded_layout):
        """The comparisons of every replay, then a forward that went wrong put on the stage it went
        wrong in (:func:`through_handoffs`), where the job recorded its hand-offs."""
        bad, evidence = super()._compare_locals(step, recs, ranks, tolerant, drift, recorded_layout)
        if bad and not tolerant and not any(e.kind is EvidenceKind.INPUT_MISMATCH for e in evidence):
            recorded = self._recorded_handoffs()
            handoffs = {
                r: (recorded.get((int(recs[r]["attempt"]), step, r)), ranks[r].handoff) for r in range(self.world_size)
            }
            evidence = through_handoffs(evidence, set(bad), handoffs, self.mesh)
        return bad, evidence

    def _recorded_handoffs(self) -> dict:
        """``{(attempt, step, rank): (sent on, handed back)}`` of the trace's HANDOFF records, read once."""
        if getattr(self, "_handoffs", None) is None:
            recs = self.trace.records(F.Kind.HANDOFF)
            self._handoffs = {
                (int(a), int(s), int(r)): (int(o), int(b))
                for a, s, r, o, b in zip(
                    recs["attempt"], recs["step"], recs["rank"], recs["aux_digest"], recs["input_digest"]
                )
            }
        return self._handoffs


def through_handoffs(evidence: list, bad: set, handoffs: dict, mesh) -> list:
    """A wrong forward in one stage reaches every stage of its pipeline: the later ones through the
    activations it sends on, the earlier ones through the gradients it hands back. Where the job
    recorded its hand-offs (``handoffs``: rank -> (recorded, replayed) ``(sent on, handed back)``,
    None for the last stage or a trace without them), the stage a wrong forward began in is the
    first whose recorded output differs from the replay's; failing that, the one after the last
    stage handed back a gradient that differs. The other stages' replay mismatches are put on that
    stage's ranks (the rank of the same TP coordinate) where those differ themselves; every other
    piece of evidence stays."""
    moved_to: dict[int, int] = {}
    for group in mesh.forward_groups():
        # rank -> (its output differs, the gradient handed back differs), where both sides are known
        differs = {}
        for r in group:
            recorded, replayed = handoffs.get(r) or (None, None)
            if recorded is not None and replayed is not None:
                differs[r] = (recorded[0] != replayed[0], recorded[1] != replayed[1])
        sent = sorted(mesh.pp_of(r) for r, (out, _) in differs.items() if out)
        handed = sorted(mesh.pp_of(r) for r, (_, back) in differs.items() if back)
        if sent:
            stage = sent[0]
        elif handed:
            stage = handed[-1] + 1
        else:
            continue
        origin = {mesh.tp_of(r): r for r in group if mesh.pp_of(r) == stage and r in bad}
        if not origin:
            continue
        for r in group:
            if mesh.pp_of(r) != stage:
                moved_to[r] = origin.get(mesh.tp_of(r), next(iter(origin.values())))
    own, moved = [], []
    for e in evidence:
        rank = e.ranks[0] if len(e.ranks) == 1 else -1
        if e.kind is EvidenceKind.REPLAY_MISMATCH and rank in moved_to:
            to = moved_to[rank]
            moved.append(
                dataclasses.replace(
                    e,
                    ranks=(to,),
                    detail=f"rank {rank}'s recorded local gradient differs too: it shares a pipeline with rank {to}, "
                    f"whose stage {mesh.pp_of(to)} went wrong in the forward (the activations it handed on, or the "
                    "gradients it handed back, differ from the replay's)",
                )
            )
        else:
            own.append(e)
    return own + moved


def _combined(found: list[int]) -> int:
    return combine_digests(found) % (1 << 64) if found else 0


def _span(indices: list[int]) -> str:
    return f"{indices[0]}..{indices[-1]}" if indices else "none"


def _send(tensor: torch.Tensor, to: int) -> None:
    """``tensor`` to process ``to``: a header (dtype, dimensions), then its values."""
    import torch.distributed as dist

    tensor = tensor.contiguous()
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise RecipeError(f"a stage hands on a {tensor.dtype} tensor of {tensor.dim()} dimensions: not replayed")
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    dist.send(header.to(tensor.device), to)
    dist.send(tensor, to)


def _receive(source: int, device) -> torch.Tensor:
    """The tensor process ``source`` sends (:func:`_send`)."""
    import torch.distributed as dist

    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, source)
    header = header.cpu()
    dtype, dims = _DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty(tuple(int(n) for n in header[2 : 2 + dims]), dtype=dtype, device=device)
    dist.recv(tensor, source)
    return tensor
