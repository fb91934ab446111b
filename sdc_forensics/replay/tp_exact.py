"""The exact replay of a tensor-parallel job: the job's TP plan on ``tp`` processes under torchrun.

``torchrun --nproc-per-node TP -m sdc_forensics certify TRACE`` (or ``bisect``/``replay``) with
as many processes as the job's TP degree: ``replay/window.py`` chooses this replay when the
trace is a TP job (``recorder/tp_layout.py``), the processes are ``TP`` and the recipe has a
``parallelize(model, tp_mesh)`` hook (docs/recipes.md); otherwise the one-process replay
(``replay/tp.py``), which is tolerant and certifies nothing.

Process ``t`` plays the recorded ranks of TP coordinate ``t``. The recipe's model, parallelised
by its hook on a 1-D ``tp`` mesh of the replay's processes (gloo on CPU), runs the job's own TP
collectives; the checkpoint (DCP) is loaded into it resharded. Per step:

1. for each DP coordinate ``d`` in order, the processes together replay its microbatches: each
   gradient is brought to its parameter's TP placement as FSDP2 does before its reduce-scatter
   (``FSDPParam._get_grad_inner_tensor``: a replicated parameter's partial gradient all-reduced
   over ``tp``), and process ``t``'s local tensors are rank ``(dp=d, tp=t)``'s local gradient,
   fingerprinted by its TP box as the recorder's tap does and compared bit for bit
   (``compare.StepComparisons``); measured bit-identical to the recorded ones on the demo. A
   rank that differs is replayed once more (its DP coordinate, by every process): majority of three;
2. the DP reduction of those local gradients, ``reduction.ordered_mean`` over ``d`` in order:
   the ordered reduction's arithmetic, and gloo's native reduce-scatter's for two DP ranks (a
   two-term sum is order-free, and halving is exact); a native reduction over more DP ranks is
   refused, naming the ordered one. HSDP x TP (``dp_replicate``): the DP coordinates replica by
   replica, each replica's ordered mean of its shards, then the replicas' ordered mean in replica
   order (the recorder redoes the replicas' all-reduce so; gloo's own for two replicas);
3. the mean becomes the TP parameter's ``.grad``, the recipe's ``before_step`` runs with clipping's
   total norm as the job's ``(dp, tp)`` shards computed it (``clipping.tp_total_norm``; per stage
   and across stages for a pipeline job), and the recipe's optimizer (rebuilt over the TP
   parameters with its groups and hyperparameters) steps on the TP slices: elementwise, so each
   FSDP shard's bits are the job's; each rank's box (its FSDP rows of its TP slice) of the
   reduced gradient and of the weights is fingerprinted and compared bit for bit.

Refused in one line before replaying (:func:`refusal`): a native reduction over more than two DP
ranks; and, once the recipe has built the job, a scheduler (bound to the optimizer the replay
rebuilds over the TP parameters).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from sdc_forensics.errors import UsageError
from sdc_forensics.evidence import EvidenceKind
from sdc_forensics.fingerprint import shards
from sdc_forensics.fingerprint.core import combine_digests
from sdc_forensics.replay import distributed, env, process_step
from sdc_forensics.replay.clipping import tp_clipping_as_recorded
from sdc_forensics.replay.replayer import Replayer, ReplayResult, _recipe_call, _recorded_threads
from sdc_forensics.trace.checkpoints import hex64
from sdc_forensics.trace.mesh import shard_rows
from sdc_forensics.trace.reader import step_threads


#: how the exact replay is launched (docs and messages)
COMMAND = "torchrun --nproc-per-node {tp} -m sdc_forensics certify TRACE"


@dataclasses.dataclass
class _Step:
    """One recorded rank's recomputed step as the comparisons read it."""

    loss: float
    digest: int
    input_digest: int
    fp: object
    rng_dependent: bool = False
    # a pipeline stage's hand-offs as replayed: (outputs sent on, gradients handed back), digests
    handoff: tuple[int, int] | None = None


def wanted(trace, recipe) -> bool:
    """Whether this replay is the exact TP one: a TP trace, ``tp`` processes, a recipe with ``parallelize``."""
    mesh = trace.manifest.parallel
    group = distributed.current()
    return (
        mesh is not None
        and mesh.tp_dim >= 0
        and group is not None
        and group.size == mesh.tp_size
        and callable(getattr(recipe, "parallelize", None))
    )


def refusal(trace, recipe) -> str:
    """Why the TP job cannot be replayed exactly ("" when it can)."""
    mesh = trace.manifest.parallel
    dp, replicas = mesh.shard_size, len(mesh.replicas())
    reductions = {str(a.determinism.get("reduction") or "native") for a in trace.manifest.attempts}
    if reductions != {"ordered"} and max(dp, replicas) > 2:
        counted = f"{dp} DP ranks" if replicas == 1 else f"{dp} DP shards x {replicas} replicas"
        return (
            f"a TP job reduced in gloo/NCCL's own order over {counted} is not replayed exactly (record it with "
            "reduction='ordered'); the one-process replay compares it within tolerance"
        )
    return ""


class TpExactReplayer(Replayer):
    """The replay of a TP trace with the job's TP plan over this torchrun launch's processes (see the module)."""

    #: what the replay is called in its messages and its device line
    KIND = "tensor parallel"

    def run(self, options, on_step=None) -> ReplayResult:
        import torch.distributed as dist

        why = refusal(self.trace, self.recipe)
        if why:
            raise UsageError(f"exact {self.KIND} replay: {why}")
        group = distributed.current()
        self.me = group.rank
        self.known_order = env.ORDERED
        self.collective = False
        self.forced_threads = options.num_threads or 0
        self.default_threads = _recorded_threads(self.trace) or 0
        model, optimizer, scheduler = _recipe_call("build", self.recipe.build, self.device)
        if scheduler is not None:
            raise UsageError(
                f"exact {self.KIND} replay: the recipe's scheduler is bound to the optimizer over the unparallelised "
                "parameters, which the replay rebuilds over the parallel ones: set the rate in after_step from the step "
                "it is handed, or replay on one process (no torchrun)"
            )
        model, optimizer, params, index, whole = self._prepare(group, model, optimizer)
        _recipe_call(
            f"load_checkpoint({options.checkpoint_path})",
            self.recipe.load_checkpoint,
            str(options.checkpoint_path),
            model,
            optimizer,
            scheduler,
        )
        self.param_dtype = params[0].dtype if params else None
        self._params, self._index, self._n_whole = params, index, len(whole)
        self._shapes = [tuple(p.shape) for p in params]
        # where each parameter starts in the flat vector of the whole model's parameters (weights) and of
        # its trainable ones (gradients)
        starts = _starts([shape for shape, _ in whole])
        self._offsets = [starts[j] for j in index]
        trainable = [j for j, (_, trained) in enumerate(whole) if trained]
        grad_starts = dict(zip(trainable, _starts([whole[j][0] for j in trainable])))
        self._trained = [i for i, p in enumerate(params) if p.requires_grad]
        self._grad_offsets = [grad_starts[index[i]] for i in self._trained]
        # the recorded ranks this process plays, by DP coordinate (replica by replica, HSDP; shard by
        # shard within each): (dp=d, tp=me), one per pipeline stage
        mesh = self.mesh
        self._replicas = [
            [[r for r in replica if mesh.shard_of(r) == d and self._plays(r)] for d in range(mesh.shard_size)]
            for replica in mesh.replicas()
        ]
        self._mine = [ranks for replica in self._replicas for ranks in replica]
        # every recorded rank's DP coordinate (its index in _mine), whatever its TP coordinate
        self._dp_of = {
            r: j * mesh.shard_size + mesh.shard_of(r) for j, replica in enumerate(mesh.replicas()) for r in replica
        }
        self._played = [r for ranks in self._mine for r in ranks]
        window = self._start(options, hex64(self._weights_digest()))
        evidence = []
        notes = [self._note(group)]
        last, first_divergent, tolerant_from = options.start_step - 1, None, None
        for row, step in enumerate(window.steps.tolist()):
            if not window.present[row].all():
                notes.append(f"step {step}: a rank has no record; replay stops before it")
                break
            recs = window.records[row]
            tolerant = tolerant_from is not None
            ranks, acc = self._locals(model, recs)
            local_bad, step_evidence, departed = process_step.judge_locals(
                self, step, recs, ranks, tolerant, lambda *a: self._tie_break_tp(model, *a), notes
            )
            if departed:
                # compared within tolerance from this step on, its reduction and update included (as replayer.py)
                tolerant_from, tolerant = step, True
            evidence += step_evidence
            reduce_evidence = [] if tolerant else self._compare_reduced(step, recs, acc)
            if local_bad or any(e.kind is EvidenceKind.INPUT_MISMATCH for e in step_evidence):
                # the recorded reduction carries the bad local gradient: a consequence
                reduce_evidence = []
            evidence += reduce_evidence
            for i, grad in zip(self._trained, acc):
                # a pipeline schedule divides the reduced gradient by its microbatch count (PipelineStage.scale_grads)
                params[i].grad = _like(params[i], grad / mesh.grad_divisor if mesh.grad_divisor > 1 else grad)
            weights_evidence, departed = process_step.update_and_compare(
                self,
                step,
                recs,
                model,
                optimizer,
                scheduler,
                tolerant,
                bool(step_evidence or reduce_evidence),
                # clipping's total norm as the job's (dp, tp) shards computed it
                clip=tp_clipping_as_recorded(mesh, self._whole_grads),
            )
            evidence += weights_evidence
            if departed and tolerant_from is None:
                tolerant_from = step + 1
            last = step
            if on_step is not None:
                on_step(step)
            if any(e.step == step and e.marks_divergence for e in evidence) and first_divergent is None:
                first_divergent = step
                if options.stop_at_divergence:
                    break
        dist.barrier()
        return process_step.result(
            self,
            options,
            last=last,
            device=env.describe_device(self.device) + f" x {group.size} processes ({self.KIND})",
            departed_from=tolerant_from,
            evidence=evidence,
            first_divergent=first_divergent,
            notes=notes,
        )

    # -- what the processes hold: the variant's part ---------------------------------------------
    def _prepare(self, group, model, optimizer):
        """The recipe's model as this process replays it: ``(model, optimizer, params, index, whole)``.
        ``params``: the model's parameters (DTensors for TP); ``index``: each one's place among the
        whole model's parameters; ``whole``: ``(shape, trainable)`` of each of the whole model's.
        Here: the recipe's TP plan on a 1-D ``tp`` mesh of every process, each holding every parameter."""
        from torch.distributed.device_mesh import init_device_mesh

        plain = list(model.parameters())
        whole = [(tuple(p.shape), p.requires_grad) for p in plain]
        tp_mesh = init_device_mesh(self.device.type, (group.size,), mesh_dim_names=("tp",))
        model = _recipe_call("parallelize", self.recipe.parallelize, model, tp_mesh) or model
        params = list(model.parameters())
        optimizer = process_step.same_optimizer(optimizer, plain, params)
        return model, optimizer, params, list(range(len(params))), whole

    def _plays(self, rank: int) -> bool:
        """Whether this process plays recorded ``rank``: every rank of its TP coordinate (every stage)."""
        return self.mesh.tp_of(rank) == self.me

    def _note(self, group) -> str:
        return (
            f"tensor parallel, exact: the recipe's parallelize over {group.size} processes (the job's TP degree), "
            "each playing the recorded ranks of its TP coordinate"
        )

    def _forward_backward(self, model, record) -> tuple[float, list]:
        """The record's microbatches, each forward and backward through the model: ``(loss total, batches)``."""
        return process_step.microbatches_backward(self, model, record)

    def _whole_grads(self) -> list:
        """The gradient of each of the whole model's parameters this process holds (None elsewhere)."""
        grads = [None] * self._n_whole
        for j, p in zip(self._index, self._params):
            grads[j] = p.grad
        return grads

    # -- the local gradients, DP coordinate by DP coordinate -------------------------------------
    def _local(self, model, record, ranks: list[int]):
        """``{rank: its loss, input digest, local-gradient fingerprint}`` of the recorded ``ranks`` (one
        DP coordinate's, this process's TP coordinate: one per pipeline stage, each its stage's boxes)
        and the TP slices (one per trainable parameter), every process replaying its own TP
        coordinate of the same DP coordinate."""
        from sdc_forensics.statedict import tensor_digests

        self._use_threads(int(step_threads(record)))
        total, batches = self._forward_backward(model, record)
        grads, pieces = [], {rank: [] for rank in ranks}
        for i, offset in zip(self._trained, self._grad_offsets):
            p = self._params[i]
            if p.grad is None:
                grad = torch.zeros_like(_local(p))
            else:
                # FSDP2's reduce-scatter input: the gradient at the parameter's TP placement
                placed = p.grad.redistribute(placements=p.placements) if hasattr(p.grad, "placements") else p.grad
                grad = _local(placed).detach().clone()
            grads.append(grad)
            for rank in ranks:
                runs = shards.box_runs(self._shapes[i], *self.mesh.tp_box(rank, self._index[i], self._shapes[i]))
                pieces[rank] += shards.box_pieces(grad, runs, offset=offset, k=self.k, seed=self.seed)
        model.zero_grad(set_to_none=True)
        inputs = combine_digests([d for batch in batches for d in tensor_digests(batch, self.seed)])
        out = {}
        for rank in ranks:
            fp = shards.one_bucket(pieces[rank])
            out[rank] = {"loss": total, "digest": fp.digest, "input": inputs, "fp": fp}
        return out, grads

    def _locals(self, model, recs):
        """Every recorded rank's step (rank order, gathered) and this process's TP slices of their DP mean."""
        from sdc_forensics.reduction import ordered_mean

        per_dp, mine = [], {}
        for ranks in self._mine:
            found, grads = self._local(model, recs[ranks[0]], ranks)
            mine.update(found)
            per_dp.append(grads)
        results = {}
        for got in distributed.exchange_objects(mine):
            results.update(got)
        ranks = [
            _Step(
                loss=results[r]["loss"],
                digest=results[r]["digest"],
                input_digest=results[r]["input"],
                fp=results[r]["fp"],
                handoff=results[r].get("handoff"),
            )
            for r in range(self.world_size)
        ]
        # HSDP: each replica's ordered mean (its reduce-scatter), then the replicas' in replica order
        # (the all-reduce, as the recorder redoes it ordered; for two replicas gloo's own, order-free)
        size = self.mesh.shard_size
        means = [
            [ordered_mean([grads[j] for grads in per_dp[k : k + size]]) for j in range(len(self._trained))]
            for k in range(0, len(per_dp), size)
        ]
        acc = means[0] if len(means) == 1 else [ordered_mean([m[j] for m in means]) for j in range(len(self._trained))]
        return ranks, acc

    def _tie_break_tp(self, model, step, recs, ranks, bad):
        """Majority of three: each disagreeing rank's DP coordinate replayed once more by every process."""
        confirmed, notes = [], []
        for r in bad:
            mine = self._mine[self._dp_of[r]]
            again, _ = self._local(model, recs[mine[0]], mine)
            seconds = {}
            for got in distributed.exchange_objects({rank: found["digest"] for rank, found in again.items()}):
                seconds.update(got)
            if seconds[r] == ranks[r].digest:
                confirmed.append(r)
                notes.append(
                    f"step {step}, rank {r}: a second replay agrees with the first (2 votes to 1 against the record)"
                )
            elif seconds[r] == int(recs[r]["local_digest"]):
                notes.append(
                    f"step {step}, rank {r}: a second replay agrees with the record; the first replay was wrong"
                )
            else:
                confirmed.append(r)
                notes.append(
                    f"step {step}, rank {r}: record and two replays all differ: this device is not bitwise reproducible"
                )
        return confirmed, notes

    # -- each recorded rank's box: its FSDP rows of its TP slice ----------------------------------
    def _box_digests(self, tensors, indices, offsets, k: int) -> np.ndarray:
        """Every recorded rank's digest of its box of ``tensors`` (this process's TP slices of the
        parameters ``indices``, placed at ``offsets``), gathered."""
        mine = {}
        for rank in self._played:
            runs = []
            for t, i, offset in zip(tensors, indices, offsets):
                shape = self._shapes[i]
                values = t
                if shape:
                    first, stop = shard_rows(values.shape[0], self.mesh.shard_of(rank), self.mesh.shard_size)
                    values = values[first:stop]
                flat = values.detach().reshape(-1)
                for s, n, place in shards.box_runs(shape, *self.mesh.rank_box(rank, self._index[i], shape)):
                    runs.append((flat[s : s + n], offset + place))
            mine[rank] = shards.fingerprint_runs(runs, k=k, seed=self.seed).digest
        found = {}
        for got in distributed.exchange_objects(mine):
            found.update(got)
        return np.array([found[r] for r in range(self.world_size)], dtype=np.uint64)

    def _compare_reduced(self, step, recs, acc):
        """Each recorded rank's box of the replayed DP mean against its recorded reduced digest."""
        return process_step.compare_reduced(
            self,
            step,
            recs,
            lambda: self._box_digests(acc, self._trained, self._grad_offsets, self.k),
            "box",
            "DP mean",
        )

    def _expected_weights(self, model) -> np.ndarray:
        with torch.no_grad():
            return self._box_digests([_local(p) for p in self._params], range(len(self._params)), self._offsets, 1)

    def _weights_digest(self) -> int:
        """The whole model's weights digest (``statedict.weights_digest``) from the TP slices: per
        parameter, the processes' pieces combined (a replicated parameter counted once, from TP 0)."""
        mine = {}
        with torch.no_grad():
            for i, p in enumerate(self._params):
                j = self._index[i]
                # a rank of DP coordinate 0 played here whose pipeline stage holds the parameter
                rank = next(r for r in self._mine[0] if self.mesh.holds(r, j))
                if self.mesh.tp_of(rank) and (j >= len(self.mesh.tp_shards) or self.mesh.tp_shards[j] < 0):
                    continue  # replicated over TP: counted from TP 0
                runs = shards.box_runs(self._shapes[i], *self.mesh.tp_box(rank, j, self._shapes[i]))
                pieces = shards.box_pieces(_local(p), runs, k=1, seed=self.seed)
                if pieces:
                    mine[j] = shards.merge_pieces(pieces)
        gathered = distributed.exchange_objects(mine)
        return combine_digests(
            [shards.combine_pieces([part[j] for part in gathered if j in part]).digest for j in range(self._n_whole)]
        )


def _starts(shapes) -> list[int]:
    """Where each tensor of ``shapes`` starts in their flat vector."""
    return np.cumsum([0] + [int(np.prod(s)) if s else 1 for s in shapes]).tolist()[:-1]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "device_mesh") else tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``param`` (a DTensor with its placements where it is one)."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
