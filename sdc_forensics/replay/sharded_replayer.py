"""The sharded replay's step loop: the recipe's model ``fully_shard``-ed over the replay's ``k``
processes (``replay/sharded.py`` chooses it under torchrun).

Per step, the recorded ranks are replayed in rounds of ``k`` (round ``j``: process ``p`` replays
recorded rank ``j * k + p``), every process running FSDP2's all-gathers together:

1. the rank's microbatches, forward and backward with gradient sync off: FSDP2 leaves the rank's
   whole *unsharded* local gradient on each parameter (what its reduce-scatter would take as
   input, and what the job itself held while it accumulated microbatches without sync); its digest
   and fingerprint are the single-process replay's (one flat vector in the model's order),
   compared with the record by the same code (``compare.StepComparisons``);
2. each process sends every other its rows of that gradient (``all_to_all_single``, FSDP2's
   ``Shard(0)`` cut over ``k``) and adds the ``k`` received rows in recorded-rank order to an
   accumulator (``reduction.accumulation_dtype``): in FSDP ``reduction.ordered_mean``'s operations
   over the ``W`` ranks; in HSDP each replica's ordered mean of its ranks, then the ordered mean of
   the replicas' in replica order (``Replayer._hsdp_ordered``); elementwise, so the shard of the
   mean is the recorded ordered reduction's bit for bit;
3. the accumulator becomes the sharded ``.grad``, the recipe's ``before_step`` with clipping's
   total norm as the job's ``W`` shards computed it (``clipping.resharded_total_norm``: each
   gradient gathered whole in turn, cut as the job's ranks held it, their norms summed in the
   recorded mesh order), the optimizer step on the shards, ``after_step``;
4. every recorded rank's shard (of ``W``'s shard dimension) of the reduced gradient and of the
   weights is fingerprinted as pieces by global element index, from the replay's shards (of
   ``k``), the pieces gathered and combined (``fingerprint/shards.py``) and compared with the
   record: HSDP's replicas of a shard each against the same replayed shard.

Mixed precision (``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)``): each module is
``fully_shard``-ed with the recorded policy (:func:`_policies`: the manifest's ``param_dtype``,
``reduce_dtype`` and ``casts``), so FSDP2 casts the float32 shards itself (element by element, the
same bits whatever the cut) and, with sync off, accumulates each microbatch's low-precision
gradient into a float32 one (``FSDPParam.to_accumulated_grad_if_needed``): the reduce-scatter's
input, as the recorder fingerprinted it and as the one-process replay (``replay/mixed.py``)
computes it. The reduction and the optimizer then run in float32 as without a policy.

Supported: FSDP (1-D mesh) and HSDP (replicate x shard, the shard dimension last) recorded with
the ordered reduction in the parameters' own dtype or, under a ``param_dtype``, in float32,
SGD/AdamW-like optimizers rebuilt over the shards with the recipe's groups and hyperparameters,
``clip_grad_norm_``/``get_total_norm`` in ``before_step``. Refused up front by :func:`supported`,
with the whole-model replay named as the alternative: gloo's native order (its ring over the job's
``W`` ranks is modelled on whole gradients only, ``Replayer._sharded_gloo``), a low-precision
``reduce_dtype`` (bfloat16, float16 divided around its sum); by :func:`_policies`, a recorded cast
on a module the replay does not ``fully_shard``. Not reproduced: module buffers FSDP2 keeps per
rank, schedulers built by the recipe (the recipe's ``after_step`` runs on the replay's optimizer).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from sdc_forensics.errors import UsageError
from sdc_forensics.evidence import EvidenceKind
from sdc_forensics.replay import distributed, env, process_step
from sdc_forensics.replay.clipping import clipping_as_recorded
from sdc_forensics.replay.replayer import Replayer, ReplayResult, _recipe_call, _recorded_threads
from sdc_forensics.trace.checkpoints import hex64
from sdc_forensics.trace.reader import step_threads
from sdc_forensics.trace.mesh import shard_rows


@dataclasses.dataclass
class _Step:
    """One recorded rank's recomputed step as the comparisons read it."""

    loss: float
    digest: int
    input_digest: int
    fp: object
    rng_dependent: bool = False
    buckets: tuple = ()


def supported(mesh, trace) -> str:
    """Why this trace cannot be replayed sharded yet ("" when it can)."""
    if mesh.kind not in ("fsdp", "hsdp"):
        return f"a {mesh.kind} job (tensor parallelism) is not replayed sharded"
    if mesh.shard_dim != len(mesh.shape) - 1:
        return "a mesh whose shard dimension is not the last is not replayed sharded"
    if mesh.reduce_dtype not in ("", "float32"):
        return f"a job reduced in {mesh.reduce_dtype} (MixedPrecisionPolicy reduce_dtype) is not replayed sharded"
    if mesh.param_dtype and mesh.reduce_dtype != "float32":
        return "a job computed in param_dtype without reduce_dtype=float32 is not replayed sharded"
    reductions = {str(a.determinism.get("reduction") or "native") for a in trace.manifest.attempts}
    if reductions != {"ordered"}:
        return "a job reduced in its collective library's own order (not the ordered reduction) is not replayed sharded"
    return ""


def wrapping(model, groups) -> list:
    """The modules to ``fully_shard`` (deepest first, the root last) so that FSDP2's parameter groups
    are the recorded ``groups`` (indices into the model's trainable parameters)."""
    index = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    owned = {name: {index[id(p)] for p in m.parameters() if id(p) in index} for name, m in model.named_modules()}
    modules = dict(model.named_modules())
    chosen = []
    for group in sorted((set(g) for g in groups), key=len):
        others = set().union(*(set(g) for g in groups if set(g) != group))
        fits = [n for n, s in owned.items() if n and group <= s and s - group <= others]
        if not fits:
            # the root's group: what no submodule holds alone
            continue
        chosen.append(min(fits, key=lambda n: len(owned[n])))
    chosen.sort(key=lambda n: -n.count("."))
    return [modules[n] for n in chosen]


class ShardedReplayer(Replayer):
    """The replay of a sharded trace with the model sharded over this torchrun launch's processes."""

    def run(self, options, on_step=None) -> ReplayResult:  # noqa: C901 - one step loop, as Replayer.run
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        group = distributed.current()
        self.k_proc, self.me = group.size, group.rank
        mesh = self.mesh
        why = supported(mesh, self.trace)
        if why:
            raise UsageError(f"sharded replay: {why}; replay it on one process (or set SDC_FORENSICS_REPLAY_SHARDED=0)")
        self.known_order = env.ORDERED
        self.collective = False
        self.forced_threads = options.num_threads or 0
        self.default_threads = _recorded_threads(self.trace) or 0
        with torch.device("meta"):
            model, meta_opt, scheduler = _recipe_call("build", self.recipe.build, "meta")
        meta_params = list(model.parameters())
        replay_mesh = init_device_mesh(self.device.type, (self.k_proc,))
        for module, policy in _policies(model, wrapping(model, mesh.groups) + [model], mesh):
            fully_shard(module, mesh=replay_mesh, **policy)
        model.to_empty(device=self.device)
        params = list(model.parameters())
        optimizer = process_step.same_optimizer(meta_opt, meta_params, params)
        _recipe_call(
            f"load_checkpoint({options.checkpoint_path})",
            self.recipe.load_checkpoint,
            str(options.checkpoint_path),
            model,
            optimizer,
            scheduler,
        )
        self.param_dtype = params[0].dtype if params else None
        if mesh.reduce_dtype and any(p.dtype != torch.float32 for p in params):
            raise UsageError(
                "sharded replay: a job reduced in float32 whose parameters are not float32 is not replayed sharded; "
                "replay it on one process (or set SDC_FORENSICS_REPLAY_SHARDED=0)"
            )
        self.tolerance_dtype = env.recompute_dtype(self.trace, self.grad_dtype, self.device, model)
        self._shapes = [tuple(p.shape) for p in params]
        self._starts = np.cumsum([0] + [int(np.prod(s)) if s else 1 for s in self._shapes]).tolist()
        self._fsdp = _fsdp_params(model, params)
        window = self._start(options, hex64(self._weights_digest(params)))
        evidence, notes = (
            [],
            [
                f"sharded replay: the model fully_shard-ed over {self.k_proc} processes, the recorded "
                f"{self.world_size} ranks replayed in rounds of {self.k_proc}"
            ],
        )
        last, first_divergent, departed_from = options.start_step - 1, None, None
        for row, step in enumerate(window.steps.tolist()):
            if not window.present[row].all():
                notes.append(f"step {step}: a rank has no record; replay stops before it")
                break
            recs = window.records[row]
            tolerant = departed_from is not None
            ranks, acc = self._rounds(model, recs, step)
            local_bad, step_evidence, departed = process_step.judge_locals(
                self, step, recs, ranks, tolerant, lambda *a: self._tie_break_sharded(model, *a), notes
            )
            if departed:
                # compared within tolerance from this step on, its reduction and update included (as replayer.py)
                departed_from, tolerant = step, True
            evidence += step_evidence
            reduce_evidence = self._compare_reduced(step, recs, acc) if not tolerant else []
            if local_bad or any(e.kind is EvidenceKind.INPUT_MISMATCH for e in step_evidence):
                reduce_evidence = []
            evidence += reduce_evidence
            for i, p in enumerate(params):
                grad = torch.zeros_like(p)
                local = grad.to_local()
                local.copy_(acc[self._acc_slice(i)].view_as(local))
                p.grad = grad
            # the accumulator is in the gradients now: freed before the next step's rounds allocate theirs
            del acc
            counts = step_threads(recs)
            values, freq = np.unique(counts[counts > 0], return_counts=True)
            self._use_threads(int(values[np.argmax(freq)]) if len(values) else 0)
            # clipping's total norm as the job's W shards computed it, not the replay's k
            weights_evidence, departed = process_step.update_and_compare(
                self,
                step,
                recs,
                model,
                optimizer,
                scheduler,
                tolerant,
                bool(step_evidence or reduce_evidence),
                clip=clipping_as_recorded(mesh, resharded=True),
            )
            evidence += weights_evidence
            if departed and departed_from is None:
                departed_from = step + 1
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
            device=env.describe_device(self.device) + f" x {self.k_proc} processes (sharded)",
            departed_from=departed_from,
            evidence=evidence,
            first_divergent=first_divergent,
            notes=notes,
        )

    def _local(self, model, record):
        """This process's recorded rank's loss, whole local gradient (one flat vector) and batches."""
        from sdc_forensics.fingerprint.core import combine_digests
        from sdc_forensics.statedict import tensor_digests

        self._use_threads(int(step_threads(record)))
        model.set_requires_gradient_sync(False)
        total, batches = process_step.microbatches_backward(self, model, record)
        # each parameter's unsharded gradient copied into one flat vector and freed at once: one whole
        # gradient held, not two
        flat = torch.empty(self._starts[-1], dtype=self.param_dtype, device=self.device)
        for i, fp in enumerate(self._fsdp):
            g = fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None else fp._unsharded_param.grad
            piece = flat[self._starts[i] : self._starts[i + 1]]
            if g is None:
                piece.zero_()
            else:
                piece.copy_(g.detach().reshape(-1))
            fp.unsharded_accumulated_grad = None
            fp._unsharded_param.grad = None
            del g
        inputs = combine_digests([d for batch in batches for d in tensor_digests(batch, self.seed)])
        return total, flat, inputs

    def _rounds(self, model, recs, step):
        """Every recorded rank's step (rank order) and this process's shard of their ordered mean.

        The mean is the one-process replay's (``Replayer.reduce``): in FSDP ``reduction.ordered_mean``
        over the ``W`` ranks; in HSDP each replica's ordered mean of its ranks (its reduce-scatter),
        cast to the parameters' dtype, then the ordered mean of the replicas' in replica order (the
        all-reduce as the recorder redid it). Elementwise, so this process's rows of it are the
        recorded reduction's rows, bit for bit; a replica's partial mean is folded in as soon as its
        last rank is added (contiguous replicas: at most two partial shards held at once).
        """
        import torch.distributed as dist

        from sdc_forensics.reduction import accumulation_dtype

        k, W = self.k_proc, self.world_size
        acc_dtype = accumulation_dtype(self.param_dtype)
        replicas = self.mesh.replicas()
        replica_of = {r: i for i, group in enumerate(replicas) for r in group}
        scales = [torch.tensor(1.0 / len(group), dtype=acc_dtype).item() for group in replicas]
        outer = torch.tensor(1.0 / len(replicas), dtype=acc_dtype).item()
        partial, added, folded, total, results = {}, [0] * len(replicas), 0, None, {}
        for j in range(-(-W // k)):
            r = min(j * k + self.me, W - 1)
            loss, flat, inputs = self._local(model, recs[r])
            mine = {
                "rank": r,
                "loss": loss,
                "digest": self.digest_of([flat]),
                "input": inputs,
                "fp": self.fp_of([flat]),
            }
            members = [(q, j * k + q) for q in range(k) if j * k + q < W]
            for rep in {replica_of[rr] for _, rr in members} - set(partial):
                partial[rep] = torch.empty(self._acc_starts[-1], dtype=acc_dtype, device=self.device)
            # one parameter at a time: the exchange holds one parameter's rows, not the whole gradient's
            for i in range(len(self._shapes)):
                received, held = self._all_to_all(flat, i), self._acc_slice(i)
                for q, rr in members:
                    rep = replica_of[rr]
                    term = torch.mul(received[q].to(acc_dtype), scales[rep])
                    # the replica's first rank starts its mean; the others add in rank order
                    if rr == replicas[rep][0]:
                        partial[rep][held].copy_(term)
                    else:
                        partial[rep][held].add_(term)
                del received
            for _, rr in members:
                added[replica_of[rr]] += 1
            # replicas complete in replica order fold into the mean of the replicas'
            while folded < len(replicas) and added[folded] == len(replicas[folded]):
                mean = partial.pop(folded)
                if len(replicas) > 1:
                    mean = torch.mul(mean.to(self.param_dtype).to(acc_dtype), outer)
                    mean = mean if total is None else total.add_(mean)
                total, folded = mean, folded + 1
            for got in distributed.exchange_objects(mine):
                results.setdefault(got["rank"], got)
            del flat
        dist.barrier()
        ranks = [
            _Step(
                loss=results[r]["loss"],
                digest=results[r]["digest"],
                input_digest=results[r]["input"],
                fp=results[r]["fp"],
            )
            for r in range(W)
        ]
        return ranks, total.to(self.param_dtype)

    def _tie_break_sharded(self, model, step, recs, ranks, bad):
        """Majority of three: every process recomputes a disagreeing rank once more, the next process's result counts."""
        confirmed, notes = [], []
        for r in bad:
            _, flat, _ = self._local(model, recs[r])
            seconds = distributed.exchange_objects(self.digest_of([flat]))
            again = seconds[(r % self.k_proc + 1) % self.k_proc]
            if again == ranks[r].digest:
                confirmed.append(r)
                notes.append(
                    f"step {step}, rank {r}: a second replay agrees with the first (2 votes to 1 against the record)"
                )
            elif again == int(recs[r]["local_digest"]):
                notes.append(
                    f"step {step}, rank {r}: a second replay agrees with the record; the first replay was wrong"
                )
            else:
                confirmed.append(r)
                notes.append(
                    f"step {step}, rank {r}: record and two replays all differ: this device is not bitwise reproducible"
                )
        return confirmed, notes

    # -- the replay's own cut (k) and the recorded one (W) ----------------------------------------
    def _my_cut(self):
        return [shard_rows(s[0] if s else 1, self.me, self.k_proc) for s in self._shapes]

    def _per_row(self, i) -> int:
        s = self._shapes[i]
        return int(np.prod(s[1:])) if len(s) > 1 else 1

    def _all_to_all(self, flat, i):
        """``received[q]``: process ``q``'s recorded rank's gradient of parameter ``i``, this process's
        rows of it (FSDP2's ``Shard(0)`` cut over ``k``: the processes' rows in order are the whole
        parameter, so the send buffer is the parameter's slice of ``flat`` itself)."""
        import torch.distributed as dist

        k, per, rows = self.k_proc, self._per_row(i), self._shapes[i][0] if self._shapes[i] else 1
        sizes = [(stop - first) * per for first, stop in (shard_rows(rows, q, k) for q in range(k))]
        mine = sizes[self.me]
        out = torch.empty(k * mine, dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(
            out, flat[self._starts[i] : self._starts[i + 1]], output_split_sizes=[mine] * k, input_split_sizes=sizes
        )
        return out.view(k, mine)

    def _recorded_pieces(self, values_of, k: int):
        """Per recorded shard ``c`` (of ``W``): the pieces this process holds of it, of the flat vector
        whose rows of parameter ``i`` on this process are ``values_of(i)`` (rows ``self._my_cut()[i]``)."""
        from sdc_forensics.fingerprint import shards

        W = self.mesh.shard_size
        out = {c: [] for c in range(W)}
        for i, (first, stop) in enumerate(self._my_cut()):
            per = self._per_row(i)
            values = values_of(i).reshape(-1)
            rows = self._shapes[i][0] if self._shapes[i] else 1
            for c in range(W):
                a, b = shard_rows(rows, c, W)
                lo, hi = max(a, first), min(b, stop)
                if lo < hi:
                    out[c].append(
                        shards.fingerprint_piece(
                            values[(lo - first) * per : (hi - first) * per],
                            offset=self._starts[i] + lo * per,
                            k=k,
                            seed=self.seed,
                        )
                    )
        return out

    def _combined(self, pieces_by_shard, k: int) -> dict:
        from sdc_forensics.fingerprint import shards

        gathered = distributed.exchange_objects(pieces_by_shard)
        return {
            c: shards.combine_pieces([p for part in gathered for p in part[c]] or [shards._empty(k, self.seed)])
            for c in range(self.mesh.shard_size)
        }

    def _compare_reduced(self, step, recs, acc):
        """Each recorded rank's shard of the replayed mean against its recorded reduced digest."""

        def expected():
            fps = self._combined(self._recorded_pieces(lambda i: acc[self._acc_slice(i)], self.k), self.k)
            return np.array([fps[self.mesh.shard_of(r)].digest for r in range(self.world_size)], dtype=np.uint64)

        return process_step.compare_reduced(self, step, recs, expected, "shard", "ordered mean")

    def _acc_slice(self, i):
        return slice(self._acc_starts[i], self._acc_starts[i + 1])

    def _expected_weights(self, model) -> np.ndarray:
        from sdc_forensics.fingerprint.shards import local_piece

        locals_ = [local_piece(p)[0] for p in model.parameters()]
        fps = self._combined(self._recorded_pieces(lambda i: locals_[i], 1), 1)
        return np.array([fps[self.mesh.shard_of(r)].digest for r in range(self.world_size)], dtype=np.uint64)

    def _weights_digest(self, params) -> int:
        """The whole model's weights digest (``statedict.weights_digest``) from the shards: per parameter, pieces combined."""
        from sdc_forensics.fingerprint import shards
        from sdc_forensics.fingerprint.core import combine_digests

        self._params_list = params
        cut = self._my_cut()
        sizes = [(stop - first) * self._per_row(i) for i, (first, stop) in enumerate(cut)]
        self._acc_starts = np.cumsum([0] + sizes).tolist()
        mine = []
        for p in params:
            values, offset = shards.local_piece(p)
            mine.append(shards.fingerprint_piece(values.reshape(-1), offset=offset, k=1, seed=self.seed))
        gathered = distributed.exchange_objects(mine)
        return combine_digests(
            [shards.combine_pieces([part[i] for part in gathered]).digest for i in range(len(params))]
        )


def _policies(model, modules, mesh) -> list:
    """``(module, fully_shard keyword arguments)``: the recorded ``MixedPrecisionPolicy`` on each module
    (``param_dtype`` and ``reduce_dtype`` as recorded, each module's input and output casts as the
    manifest's ``casts`` name them), so that FSDP2 itself casts the float32 shards (element by element:
    the same bits whatever the cut) and accumulates the local gradient in ``reduce_dtype``."""
    if not (mesh.param_dtype or mesh.reduce_dtype or mesh.casts):
        return [(m, {}) for m in modules]
    from torch.distributed.fsdp import MixedPrecisionPolicy

    names = {id(m): n for n, m in model.named_modules()}
    casts = {name: (inputs, outputs) for name, inputs, outputs in mesh.casts}
    wrapped = {names[id(m)] for m in modules}
    missing = sorted(set(casts) - wrapped)
    if missing:
        raise UsageError(
            f"sharded replay: the job cast the forward of module {missing[0]!r}, which the replay's wrapping does "
            "not fully_shard; replay it on one process (or set SDC_FORENSICS_REPLAY_SHARDED=0)"
        )
    out = []
    for module in modules:
        inputs, outputs = casts.get(names[id(module)], ("", ""))
        policy = MixedPrecisionPolicy(
            param_dtype=getattr(torch, mesh.param_dtype) if mesh.param_dtype else None,
            reduce_dtype=getattr(torch, mesh.reduce_dtype) if mesh.reduce_dtype else None,
            output_dtype=getattr(torch, outputs) if outputs else None,
            # FSDP2 casts the inputs to param_dtype, the dtype the manifest names
            cast_forward_inputs=bool(inputs),
        )
        out.append((module, {"mp_policy": policy}))
    return out


def _fsdp_params(model, params) -> list:
    """FSDP2's ``FSDPParam`` of each of ``params`` (the sharded parameters), in their order."""
    by_id = {}
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        state = state_of()
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fp in getattr(group, "fsdp_params", ()) if group is not None else ():
                by_id[id(fp.sharded_param)] = fp
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise UsageError(f"sharded replay: parameters {missing} are not managed by fully_shard")
    return [by_id[id(p)] for p in params]
