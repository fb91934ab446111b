"""Replay: re-execute steps N..M from checkpoint N with DDP semantics on one device, and compare.

For each step ``s`` of the window, with the replay's weights theta_s:

1. per rank ``r``: its microbatches (IDs from the trace) fetched through the recipe, the input
   digest, the loss and the local gradient accumulated as in training (``backward()`` per
   microbatch), fingerprinted per DDP bucket with the recorded layout (``buckets.attempt-AAA.json``),
   so it is comparable with the recorded ``local_*`` exactly;
2. the average over ranks, in the collective's summation order when one reproduces the recorded
   reduced digest (``replay.env.reduce_buckets``);
3. ``recipe.before_step``, ``optimizer.step()``, ``recipe.after_step``; the weights digest.

Every recomputed fingerprint is compared with the recorded one per rank and step. Exact (digest)
comparison is used while the replay is bitwise reproducible: from a checkpoint, and for as long
as a reduction order reproduces the recorded reduced digest. When every rank's local digest
differs but within the sketch tolerance (another device, another kernel), or when no reduction
order reproduces the healthy ranks' reduced digest, the comparison of later steps switches to the
sketch tolerance, and the result says from which step. A rank whose recomputation disagrees with
the record while nothing else breaks the tie is recomputed a second time: majority of three.

Over 400 lines on purpose: one class, the step loop and the state it carries from step to step
(weights, optimizer, learnt summation order, restored settings); the comparisons of a step are
``compare.py``'s and the environment ``env.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from sdc_forensics import recipe as recipe_mod
from sdc_forensics.errors import CheckpointError, InvalidInputError, RecipeError, SdcError
from sdc_forensics.fingerprint import tolerance
from sdc_forensics.fingerprint.core import Fingerprint, combine, combine_digests, digest, fingerprint, num_sketch_blocks
from sdc_forensics.replay import distributed
from sdc_forensics.replay import env as env
from sdc_forensics.replay.buffers import AUTHORITATIVE_RANK, BufferBroadcast, changed_buffers
from sdc_forensics.replay.clipping import clipping_as_recorded
from sdc_forensics.replay.mixed import computing_as_recorded
from sdc_forensics.trace.checkpoints import hex64
from sdc_forensics.evidence import Evidence, EvidenceKind
from sdc_forensics.replay.options import AnalysisOptions
from sdc_forensics.replay.compare import StepComparisons
from sdc_forensics.statedict import tensor_digests, weights_digest
from sdc_forensics.trace.reader import Trace, step_threads

#: Extra slack of replay-vs-record sketch comparisons once the replay's weights may differ from the
#: recorded ones in the last bits: the drift of a few roundings per step, per step replayed since.
DRIFT_PER_STEP = 4.0
#: Recorded thread counts above this are ignored (the replay keeps its current count).
_MAX_THREADS = 1024


class StartStateMismatch(CheckpointError):
    """The checkpoint a replay starts from does not hold the weights the replicas agreed on."""

    def __init__(self, message: str, *, step: int, expected: str, found: str) -> None:
        super().__init__(message)
        self.step, self.expected, self.found = step, expected, found


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """One replay window (built from the user's :class:`~sdc_forensics.replay.options.AnalysisOptions` by :meth:`of`).

    Attributes:
        start_step: N, the checkpoint the replay starts from (it holds theta_N).
        stop_step: M, the last step replayed (inclusive; step M writes theta_M+1).
        checkpoint_path: the file of checkpoint N.
        expected_weights_digest: hex digest the replicas agreed on for theta_N ("" to skip).
        device: torch device spec.
        force_device: replay even on a suspect's GPU.
        suspect_gpus: ``{gpu_uuid: rank}`` the replay must not run on.
        stop_at_divergence: stop after the first step with strong evidence of a mismatch (weak
            tolerant residuals never stop a replay).
        num_threads: CPU intra-op threads for every step (None: each rank-step's recorded count,
            else the manifest's, else torch's default). Another count than training's makes a CPU
            replay non-bitwise: the comparison goes tolerant.
        force_tolerant: compare within the sketch tolerance from the first step, even where the
            replay is bitwise reproducible (to exercise and measure the tolerant path).
        reduction_order: the summation order an earlier replay of this run found (``gloo-ring``,
            ``sequential``), "" if none yet.
        collective: all-reduce with the replay's own process group (``AnalysisOptions.collective``).
    """

    start_step: int
    stop_step: int
    checkpoint_path: Path
    expected_weights_digest: str = ""
    device: str = "cpu"
    force_device: bool = False
    suspect_gpus: dict[str, int] = dataclasses.field(default_factory=dict)
    stop_at_divergence: bool = True
    num_threads: int | None = None
    reduction_order: str = ""
    force_tolerant: bool = False
    collective: bool = False

    def __post_init__(self) -> None:
        if self.stop_step < self.start_step:
            raise InvalidInputError(
                f"replay window {self.start_step}..{self.stop_step} is empty: --to must be >= --from"
            )

    @classmethod
    def of(cls, chosen: AnalysisOptions, **window) -> "ReplayOptions":
        """The options of one window: the user's ``device``, ``force_device``, ``num_threads`` and
        ``force_tolerant`` from ``chosen``, the window's own fields (and any override) from ``window``."""
        return cls(
            **{
                "device": chosen.device,
                "force_device": chosen.force_device,
                "num_threads": chosen.num_threads,
                "force_tolerant": chosen.force_tolerant,
                "collective": chosen.collective,
                **window,
            }
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayResult:
    """What one replay found.

    Attributes:
        start_step, stop_step: the window asked for; ``last_step``: the last step replayed.
        device: the device it ran on, named.
        comparison: ``exact`` when every comparison was bitwise, else ``tolerant``.
        tolerant_from: first step compared with the sketch tolerance (None when all exact).
        reduction_order: the summation order that reproduced the recorded reduced digest.
        evidence: replay and input mismatches found.
        first_divergent_step: the first step with strong evidence of a mismatch, None if none
            (weak tolerant residuals are in ``evidence`` but do not set it).
        settings: the deterministic settings applied.
        notes: sentences for the report (why the comparison switched, tie-breaks).
        max_residual_ratio: the largest residual / tolerance of the tolerant comparisons (0 when
            every comparison was exact); on clean runs it measures the replay's drift artefacts.
    """

    start_step: int
    stop_step: int
    last_step: int
    device: str
    comparison: str
    tolerant_from: int | None
    reduction_order: str
    evidence: tuple[Evidence, ...]
    first_divergent_step: int | None
    settings: dict
    notes: tuple[str, ...] = ()
    max_residual_ratio: float = 0.0

    @property
    def num_steps(self) -> int:
        return self.last_step - self.start_step + 1


class _RankStep:
    """One rank's recomputed step; digests, sketches and input digests are computed on demand
    (an exact match needs only the gradient digest, so the rest is paid for mismatches only)."""

    def __init__(self, replayer: "Replayer", buckets: list[torch.Tensor], batches: list, loss: float) -> None:
        self._replayer, self.buckets, self._batches, self.loss = replayer, buckets, batches, loss
        # the recomputation depends on the global RNG state the trace does not hold
        self.rng_dependent = False
        self._digest: int | None = None
        self._fp: Fingerprint | None = None
        self._input: int | None = None

    @property
    def digest(self) -> int:
        if self._digest is None:
            self._digest = self._fp.digest if self._fp is not None else self._replayer.digest_of(self.buckets)
        return self._digest

    @property
    def fp(self) -> Fingerprint:
        if self._fp is None:
            self._fp = self._replayer.fp_of(self.buckets)
        return self._fp

    @property
    def input_digest(self) -> int:
        if self._input is None:
            seed = self._replayer.seed
            self._input = combine_digests([d for batch in self._batches for d in tensor_digests(batch, seed)])
        return self._input


class Replayer(StepComparisons):
    """Replays windows of one trace with one recipe on one device."""

    def __init__(self, trace: Trace, recipe, device: torch.device) -> None:
        self.trace = trace
        self.recipe = recipe
        self.device = device
        self.seed = trace.manifest.fingerprint.seed
        self.k = trace.sketch_k
        self.grad_dtype = trace.manifest.fingerprint.grad_dtype
        # the roundoff tolerant comparisons use (run(): env.recompute_dtype)
        self.tolerance_dtype = self.grad_dtype
        self.world_size = trace.world_size
        # the summation order that reproduced this run's all-reduce, once seen
        self.known_order = ""
        # --threads
        self.forced_threads = 0
        # the manifest's count, for traces without per-step counts
        self.default_threads = 0
        # the CPU thread counts the replayed steps ran with (run())
        self.threads_used: set[int] = set()
        # the largest tolerant residual / tolerance seen (clean artefacts are measured with it)
        self.max_ratio = 0.0
        # flat gradient buffers reused from step to step (a fresh tensor per rank and step costs page
        # faults on every touch): one per rank slot, one per reduction order
        self._rank_buffers: dict[int, torch.Tensor] = {}
        self._reduce_buffers: dict[str, torch.Tensor] = {}
        self.rng_dependent: bool | None = (
            None  # the recipe's step depends on the global RNG (None: not seen drawing yet)
        )
        # DDP's broadcast of module buffers, per window
        self.module_buffers: BufferBroadcast | None = None
        # a sharded job: reduced gradients and weights are recorded per shard
        self.mesh = trace.manifest.parallel
        # the recipe model's (a sharded job's reduction is cast back to it)
        self.param_dtype: torch.dtype | None = None

    # -- one rank's local gradient -------------------------------------------------------------
    def local_step(self, model, record, buckets_layout, slot: int | None = None) -> _RankStep:
        """Recompute one rank's loss and local gradient (per bucket) at one step, with the CPU
        thread count that rank's step ran with (reductions change order with it).

        ``slot``: the buffers to copy the gradient into, reused at every step (the rank's
        index); the result is valid until the next call with the same slot. None: new buffers.
        """
        self._use_threads(int(step_threads(record)))
        params = list(model.parameters())
        entry = _rng_states(self.device)
        grads, batches, total_loss = self._gradients(model, params, record)
        if self.rng_dependent is None and _rng_states(self.device) != entry:
            # the step drew from the global RNG (dropout, augmentation not seeded from the microbatch
            # ID): reproducible only if the recipe seeds it itself. Recompute once from another RNG
            # state: a different gradient means the step depends on draws training made from an RNG
            # state the trace does not hold, and no comparison of it can be trusted.
            first = [None if g is None else g.clone() for g in grads]
            _set_rng_states(self.device, _perturbed(self.device, entry))
            again, _, _ = self._gradients(model, params, record)
            self.rng_dependent = any(
                (a is None) != (b is None) or (a is not None and not torch.equal(a, b)) for a, b in zip(first, again)
            )
            _set_rng_states(self.device, entry)
            grads, batches, total_loss = self._gradients(model, params, record)
        if self.module_buffers is not None:
            self.module_buffers.after_rank(int(record["rank"]))
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
        dtypes = {g.dtype for g in grads}
        out = None
        # mixed dtypes: torch.cat promotes, no buffer to reuse
        if slot is not None and len(dtypes) == 1:
            out = self._buffers(
                self._rank_buffers, slot, [sum(grads[i].numel() for i in b) for b in buckets_layout], dtypes.pop()
            )
        buckets = [
            torch.cat([grads[i].reshape(-1) for i in bucket], out=out[b])
            if out is not None
            else torch.cat([grads[i].reshape(-1) for i in bucket])
            for b, bucket in enumerate(buckets_layout)
        ]
        # FSDP2 reduced (and the recorder read) it in this dtype
        if self.mesh is not None and self.mesh.reduce_dtype:
            low = getattr(torch, self.mesh.reduce_dtype)
            buckets = [b.to(low) for b in buckets]
            factors = self.mesh.divide_factors()
            # a float16 reduction: FSDP2 divides its input first
            if factors is not None and factors[0] != 1:
                buckets = [b.div_(factors[0]) for b in buckets]
        step = _RankStep(self, buckets, batches, total_loss)
        step.rng_dependent = bool(self.rng_dependent)
        return step

    def _gradients(self, model, params, record):
        """The rank's local gradient (per parameter, None where none), its batches and summed loss."""
        for p in params:
            p.grad = None
        if self.module_buffers is not None:
            # every rank starts from rank 0's buffers, as DDP broadcasts them
            self.module_buffers.before_rank()
        batches, total_loss = [], 0.0
        low = getattr(torch, self.mesh.reduce_dtype) if self.mesh is not None and self.mesh.reduce_dtype else None
        accumulated: list = [None] * len(params)
        # a sharded job's param_dtype and casts, as FSDP2 applied them
        with computing_as_recorded(model, self.mesh):
            for mb_id in self.trace.microbatch_ids(record):
                batch = self.recipe.fetch_microbatch(int(mb_id), self.device)
                loss = recipe_mod.loss_and_backward(self.recipe, model, batch)
                total_loss += float(loss.detach())
                batches.append(batch)
                if (
                    low is not None
                    # FSDP2 accumulates across microbatches in the reduce dtype (FSDPParam.to_accumulated_grad_if_needed)
                ):
                    for i, p in enumerate(params):
                        if p.grad is not None:
                            accumulated[i] = p.grad.to(low) if accumulated[i] is None else accumulated[i].add_(p.grad)
                            p.grad = None
        if low is not None:
            return accumulated, batches, total_loss
        return [p.grad for p in params], batches, total_loss

    def _buffers(self, pool: dict, key, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """Contiguous views of sizes ``sizes`` into one flat buffer ``pool[key]``, reallocated only
        when it is too small or of another dtype (a new bucket layout reuses it)."""
        total = sum(sizes)
        flat = pool.get(key)
        if flat is None or flat.dtype != dtype or flat.numel() < total:
            flat = torch.empty(total, dtype=dtype, device=self.device)
            pool[key] = flat
        views, offset = [], 0
        for n in sizes:
            views.append(flat[offset : offset + n])
            offset += n
        return views

    def reduce(self, per_rank: list[list[torch.Tensor]], order: str) -> list[torch.Tensor]:
        """The ranks' average in ``order`` (``replay.env.reduce_buckets``), written into this
        order's reused buffer: valid until the next step's reduction in the same order."""
        if self.mesh is not None and len(self.mesh.replicas()) > 1 and order == env.ORDERED:
            return self._to_params(self._hsdp_ordered(per_rank))
        if order == env.SHARDED_GLOO:
            return self._to_params([self._sharded_gloo([buckets[0] for buckets in per_rank])])
        if self.mesh is not None and self.mesh.divide_factors() is not None and order == env.ORDERED:
            # a float16 reduction sums (divided before and after)
            from sdc_forensics.reduction import ordered_sum

            return self._to_params(
                [ordered_sum([per_rank[r][b] for r in range(len(per_rank))]) for b in range(len(per_rank[0]))]
            )
        dtypes = {t.dtype for t in per_rank[0]}
        if len(dtypes) != 1:
            return self._to_params(env.reduce_buckets(per_rank, order, compress=self.compress))
        out = self._buffers(self._reduce_buffers, order, [t.numel() for t in per_rank[0]], dtypes.pop())
        return self._to_params(env.reduce_buckets(per_rank, order, out=out, compress=self.compress))

    def _to_params(self, reduced: list[torch.Tensor]) -> list[torch.Tensor]:
        """A sharded job that reduced in another dtype: FSDP2 divides a float16 sum by its
        post-factor, then casts the reduced shard back to the parameters' dtype before the optimizer
        (and the recorder) read it."""
        if self.mesh is None or not self.mesh.reduce_dtype or self.param_dtype is None:
            return reduced
        factors = self.mesh.divide_factors()
        if factors is not None and factors[1] != 1:
            reduced = [r.div(factors[1]) for r in reduced]
        return [r.to(self.param_dtype) for r in reduced]

    def _hsdp_ordered(self, per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """HSDP recorded with the ordered reduction: each replica's ordered mean of its ranks (the
        reduce-scatter), then the ordered mean of the replicas' in replica order (the recorder redoes
        the replicas' all-reduce so: ``fsdp_tap.ReduceScatterTap._after_all_reduce``), elementwise, so the
        shards of the result are what every rank received, bit for bit."""
        from sdc_forensics.reduction import ordered_mean, ordered_sum

        add = (
            ordered_sum if self.mesh.divide_factors() is not None else ordered_mean
            # float16: sums, divided around them
        )
        means = [
            [add([per_rank[r][b] for r in group]) for b in range(len(per_rank[0]))] for group in self.mesh.replicas()
        ]
        return [add([mean[b] for mean in means]) for b in range(len(per_rank[0]))]

    def _sharded_gloo(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """A sharded job's own reduction on gloo, rebuilt: for each FSDP2 parameter group (the
        mesh's ``groups``), every rank's reduce-scatter input (each parameter's rows of shard ``c``,
        padded to ``ceil(rows / S)``, in chunk ``c``), summed within each replica in gloo's ring order
        (its reduce-scatter is its ring all-reduce of the whole input, sliced) and divided (``AVG``);
        in HSDP the replicas' outputs of one shard then all-reduced likewise (ring over the replicas,
        divided). Returns the mean as one flat gradient."""
        mesh, size = self.mesh, self.mesh.shard_size
        shapes = self._grad_shapes
        starts = [0]
        for rows, per_row in shapes:
            starts.append(starts[-1] + rows * per_row)
        if any(i >= len(shapes) for g in mesh.groups for i in g):
            raise InvalidInputError(
                "the trace's FSDP groups name more parameters than the recipe's model trains: the recipe "
                "builds another model than the job trained"
            )
        out = torch.zeros_like(flats[0])
        coord = {r: mesh.coords[r] for r in range(mesh.world_size)}
        other = [d for d in range(len(mesh.shape)) if d != mesh.shard_dim]
        # a float16 reduction sums (SUM), FSDP2 divides around it
        summing = mesh.divide_factors() is not None
        for group in mesh.groups:
            padded = [-(-shapes[i][0] // size) * shapes[i][1] for i in group]

            def rs_input(flat: torch.Tensor) -> torch.Tensor:
                parts = []
                for i, width in zip(group, padded):
                    rows, per_row = shapes[i]
                    whole = torch.zeros(
                        size * width // per_row if per_row else 0, per_row, dtype=flat.dtype, device=flat.device
                    )
                    whole[:rows] = flat[starts[i] : starts[i + 1]].view(rows, per_row)
                    parts.append(whole.view(size, width))
                return torch.cat(parts, dim=1).reshape(-1)

            inputs = [rs_input(f) for f in flats]
            by_replica = {}
            # the reduce-scatter's group: ring order is the shard coordinate's
            for replica in mesh.replicas():
                members = sorted(replica, key=mesh.shard_of)
                total = env.ring_sum([inputs[r] for r in members])
                by_replica[replica] = (total if summing else total / len(members)).view(size, -1)
            # HSDP: each shard's replica outputs, all-reduced in replicate-coordinate order
            if len(by_replica) > 1:
                replicas = sorted(by_replica, key=lambda rep: tuple(coord[rep[0]][d] for d in other))
                sums = [env.ring_sum([by_replica[rep][c] for rep in replicas]) for c in range(size)]
                mean = torch.stack(sums if summing else [t / len(replicas) for t in sums])
            else:
                mean = next(iter(by_replica.values()))
            column = 0
            for i, width in zip(group, padded):
                rows, per_row = shapes[i]
                block = mean[:, column : column + width].reshape(-1, per_row)[:rows] if width else mean[:, :0]
                out[starts[i] : starts[i + 1]] = block.reshape(-1)
                column += width
        return out

    def _use_threads(self, recorded: int) -> None:
        if self.device.type != "cpu":
            return
        wanted = self.forced_threads or recorded or self.default_threads
        # a damaged or hostile trace: not a count anyone trained with
        if wanted > _MAX_THREADS:
            wanted = 0
        if wanted and torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        self.threads_used.add(torch.get_num_threads())

    def digest_of(self, buckets: list[torch.Tensor]) -> int:
        """The exact digest of a gradient held in bucket buffers (``combine`` of the buckets' digests)."""
        return combine_digests([digest(flat, self.seed) for flat in buckets])

    def fp_of(self, buckets: list[torch.Tensor]) -> Fingerprint:
        """The full fingerprint, buckets sketched with consecutive block offsets, as the recorder does."""
        parts, offset = [], 0
        for flat in buckets:
            parts.append(fingerprint(flat, k=self.k, seed=self.seed, block_offset=offset))
            offset += num_sketch_blocks(flat.numel())
        return combine(parts)

    def _changed_buffers(self, note, determinism: dict, tolerant_from, evidence) -> list[str]:
        """The buffers checkpoint ``note`` saved that must equal this replay's and do not: an exact
        replay of whole replicas (no mesh) that recorded ``broadcast_buffers`` (older traces did not:
        their difference stays a note), a checkpoint saved from the rank whose buffers DDP
        broadcasts, and nothing strong found before it in this window (the replay's state is still
        the record's); [] otherwise."""
        if (
            note is None
            or self.mesh is not None
            or tolerant_from is not None
            or determinism.get("broadcast_buffers") is not True
            or note.saved_by_rank != AUTHORITATIVE_RANK
            or any(e.marks_divergence for e in evidence)
        ):
            return []
        return self.module_buffers.compare(note, self.seed)[1]

    def _tol(self, norm: float, drift_steps: int) -> float:
        rel = tolerance.relative_tolerance(self.tolerance_dtype, self.world_size)
        return rel * max(norm, 1e-30) * (1.0 + DRIFT_PER_STEP * drift_steps)

    # -- the window ---------------------------------------------------------------------------
    def _start(self, options: ReplayOptions, start_digest: str):
        """The window's STEP records, once the loaded checkpoint is known to hold the replicas' weights
        (``start_digest``); raises :class:`StartStateMismatch` or, without records, ``InvalidInputError``."""
        if options.expected_weights_digest and start_digest != options.expected_weights_digest:
            raise StartStateMismatch(
                f"checkpoint {options.checkpoint_path} holds weights {start_digest}, not the replicas' {options.expected_weights_digest}",
                step=options.start_step,
                expected=options.expected_weights_digest,
                found=start_digest,
            )
        windows = list(
            self.trace.step_windows(options.stop_step - options.start_step + 1, options.start_step, options.stop_step)
        )
        if not windows or windows[0].steps[0] != options.start_step:
            raise InvalidInputError(
                f"the trace has no STEP records for steps {options.start_step}..{options.stop_step}"
            )
        return windows[0]

    def run(self, options: ReplayOptions, on_step: Callable[[int], None] | None = None) -> ReplayResult:
        """Replay ``options.start_step .. options.stop_step`` and compare with the trace."""
        self.known_order = options.reduction_order
        self.collective = options.collective
        if self.collective:
            distributed.check_collective(self.world_size)
        self.forced_threads = options.num_threads or 0
        self.default_threads = _recorded_threads(self.trace) or 0
        self.threads_used: set[int] = set()
        model, optimizer, scheduler = _recipe_call("build", self.recipe.build, self.device)
        _recipe_call(
            f"load_checkpoint({options.checkpoint_path})",
            self.recipe.load_checkpoint,
            str(options.checkpoint_path),
            model,
            optimizer,
            scheduler,
        )
        self.param_dtype = next((p.dtype for p in model.parameters()), None)
        self.tolerance_dtype = env.recompute_dtype(self.trace, self.grad_dtype, self.device, model)
        self._grad_shapes = [
            (p.shape[0] if p.dim() else 1, math.prod(p.shape[1:]))
            for p in model.parameters()
            if p.requires_grad
            # (rows, elements per row), flat-gradient order
        ]
        self.module_buffers = BufferBroadcast(model)
        saved = {(n.step, n.attempt): n for n in self.trace.checkpoint_notes()} if self.module_buffers.active else {}
        window = self._start(options, hex64(weights_digest(model.named_parameters(), self.seed)))
        evidence: list[Evidence] = []
        notes: list[str] = []
        tolerant_from: int | None = options.start_step if options.force_tolerant else None
        if options.force_tolerant:
            notes.append("--tolerant: every step compared within the sketch tolerance")
        order_used = ""
        last = options.start_step - 1
        first_divergent: int | None = None
        params = list(model.parameters())
        layouts: dict[int, tuple] = {}
        for row, step in enumerate(window.steps.tolist()):
            present = window.present[row]
            if not present.all():
                notes.append(
                    f"step {step}: rank(s) {', '.join(map(str, np.flatnonzero(~present).tolist()))} have no record; replay stops before it"
                )
                break
            recs = window.records[row]
            lost = [r for r in range(len(recs)) if not self.trace.has_microbatch_ids(recs[r])]
            if lost:
                notes.append(
                    f"step {step}: rank(s) {', '.join(map(str, lost))}'s microbatch IDs are in records that fail their "
                    "checksum (the trace is damaged there), so their inputs cannot be fetched again; replay stops before it"
                )
                break
            attempt = int(window.attempt[row, 0])
            if attempt not in layouts:
                layouts[attempt] = env.bucket_layouts(self.trace.path, attempt)
            layout, recorded_layout = env.layout_at(layouts[attempt], step, len(params))
            determinism = env.attempt_determinism(self.trace, attempt)
            self.order_candidates = env.orders_to_try(determinism)
            self.comm_hook = str(determinism.get("comm_hook") or "") or None
            if _recorded_reduction(self.trace, attempt) == env.ORDERED and not env.is_ordered(self.known_order):
                # the order is known before any step: exact on any device (a job's own hook
                # under it may have divided by W: the variant that reproduces it is kept)
                self.known_order = env.ORDERED
            self.compress = env.compression_of(determinism)
            if not recorded_layout and tolerant_from is None:
                tolerant_from = step
                notes.append("no bucket layout recorded: gradients compared by norm within tolerance only")
            drift = 0 if tolerant_from is None else step - tolerant_from
            self.module_buffers.begin_step()
            ranks = distributed.local_steps(
                self,
                model,
                recs,
                layout,
                step,
                # under torchrun: shared out, then exchanged
            )
            if any(getattr(rs, "rng_dependent", False) for rs in ranks):
                notes.append(
                    f"step {step}: the recipe's step draws from the global RNG (dropout or augmentation not seeded "
                    "from the microbatch ID): training's draws came from RNG states the trace does not hold, so no "
                    "replayed step can be compared; seed them in the recipe (docs/recipes.md), nothing is judged here"
                )
                break
            local_bad, step_evidence = self._compare_locals(
                step, recs, ranks, tolerant_from is not None, drift, recorded_layout
            )
            # every rank differs within tolerance: not bitwise reproducible here
            if local_bad is None:
                tolerant_from = step
                notes.append(
                    f"step {step}: every rank's local gradient differs in the last bits from the record "
                    "(another device or thread count, or the recipe's kernels are not the job's: a model the job "
                    "compiled with torch.compile, or autocast, and the recipe does not, docs/recipes.md): compared "
                    "within the sketch tolerance from here on"
                )
                local_bad, step_evidence = self._compare_locals(step, recs, ranks, True, 0, recorded_layout)
            if local_bad:
                local_bad, tie_notes = self._tie_break(
                    model, step, recs, layout, ranks, local_bad, tolerant_from is not None
                )
                notes += tie_notes
                step_evidence = [
                    e
                    for e in step_evidence
                    if e.kind is not EvidenceKind.REPLAY_MISMATCH or set(e.ranks) & set(local_bad)
                ]
            evidence += step_evidence
            if self.mesh is not None:
                self.bucket_shapes = tuple(tuple(params[i].shape) for i in layout[0]) if layout else ()
            reduced, order, reduce_evidence, reduce_note = self._reduce(
                step, recs, ranks, tolerant_from is not None, drift, recorded_layout
            )
            if local_bad or any(e.kind is EvidenceKind.INPUT_MISMATCH for e in step_evidence):
                # the recorded average carries the bad local gradient: a consequence
                reduce_evidence = []
            evidence += reduce_evidence
            if self.collective_missed and self.collective_missed not in notes:
                notes.append(self.collective_missed)
            if reduce_note and tolerant_from is None and not step_evidence:
                # this step's reduced gradient matched within tolerance only: not exact
                tolerant_from = step
                notes.append(reduce_note)
            order_used = order_used or order
            self.module_buffers.end_step()
            own_grads = self.device.type != "cpu"
            for bucket, flat in zip(layout, reduced):
                offset = 0
                for index in bucket:
                    n = params[index].numel()
                    # a view, as DDP's bucket views
                    grad = flat[offset : offset + n].view_as(params[index])
                    # on a GPU each parameter gets its own gradient tensor, as DDP's default
                    # (gradient_as_bucket_view=False) copies the bucket out: foreach kernels
                    # (clip_grad_norm_'s norms) take another, vectorised path for aligned tensors
                    # than for views at odd offsets, and their sums differ in the last bits
                    params[index].grad = grad.clone() if own_grads else grad
                    offset += n
            # (R,) 0 = not recorded
            counts = step_threads(recs)
            values, freq = np.unique(counts[counts > 0], return_counts=True)
            self._use_threads(int(values[np.argmax(freq)]) if len(values) else 0)
            if self.mesh is not None and self.mesh.grad_divisor > 1:
                # a pipeline schedule divides the reduced gradient by its microbatch count (PipelineStage.scale_grads)
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(self.mesh.grad_divisor)
            # a sharded job's clipping norm, as its ranks computed it
            with clipping_as_recorded(self.mesh):
                recipe_mod.before_step(self.recipe, model, optimizer, step=step)
            optimizer.step()
            recipe_mod.after_step(self.recipe, model, optimizer, scheduler, step=step)
            weights_evidence, departed = self._compare_weights(
                step, recs, model, tolerant_from is not None, bool(step_evidence or reduce_evidence)
            )
            evidence += weights_evidence
            # the replay's weights are no longer the record's: later steps cannot compare bit for bit
            if departed:
                tolerant_from = step + 1
            buffers_note = (
                self.module_buffers.check(saved[step + 1, attempt], self.seed) if (step + 1, attempt) in saved else ""
            )
            changed = self._changed_buffers(saved.get((step + 1, attempt)), determinism, tolerant_from, evidence)
            if changed:
                # an exact replay of buffers DDP broadcasts: a difference is the state's, not a note
                evidence.append(changed_buffers(saved[step + 1, attempt], changed, options.start_step))
                buffers_note = ""
            elif buffers_note and self.mesh is not None and "differ" in buffers_note:
                buffers_note = (
                    f"checkpoint {step + 1}: FSDP2 keeps every rank's module buffers (BatchNorm running statistics) "
                    "apart, never broadcast, and the checkpoint holds one rank's: this replay does not reproduce them "
                    "(the weights and the optimizer state it confirms)"
                )
            elif buffers_note and tolerant_from is not None and "differ" in buffers_note:
                # not bit for bit (--threads, --tolerant, another device): the statistics drift like the weights
                buffers_note = (
                    f"checkpoint {step + 1}: the replayed module buffers (BatchNorm running statistics) differ from the "
                    "saved ones, as this replay, not bit for bit, drifts from training in the last bits: they are not "
                    "confirmed by it"
                )
            if buffers_note:
                notes.append(buffers_note)
            last = step
            if on_step is not None:
                on_step(step)
            if any(e.step == step and e.marks_divergence for e in evidence) and first_divergent is None:
                first_divergent = step
                if options.stop_at_divergence:
                    break
        return ReplayResult(
            start_step=options.start_step,
            stop_step=options.stop_step,
            last_step=last,
            device=env.describe_device(self.device, self.threads_used),
            comparison="exact" if tolerant_from is None or tolerant_from > last else "tolerant",
            tolerant_from=tolerant_from if tolerant_from is not None and tolerant_from <= last else None,
            reduction_order=order_used,
            evidence=tuple(evidence),
            first_divergent_step=first_divergent,
            settings={},
            notes=tuple(notes),
            max_residual_ratio=round(self.max_ratio, 4),
        )


def _rng_states(device: torch.device) -> list[bytes]:
    """The global RNG states a step can draw from: CPU, and the replay GPU's."""
    states = [torch.random.get_rng_state().numpy().tobytes()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device).numpy().tobytes())
    return states


def _set_rng_states(device: torch.device, states: list[bytes]) -> None:
    torch.random.set_rng_state(torch.frombuffer(bytearray(states[0]), dtype=torch.uint8))
    if device.type == "cuda":
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(states[1]), dtype=torch.uint8), device)


def _perturbed(device: torch.device, states: list[bytes]) -> list[bytes]:
    """RNG states other than ``states`` (a fixed seed, or the next one if that is where they are);
    the current states are left as they were."""
    saved = _rng_states(device)
    for seed in (0x5DC, 0x5DD):
        torch.manual_seed(seed)
        other = _rng_states(device)
        if other[0] != states[0]:
            break
    _set_rng_states(device, saved)
    return other


def _recorded_threads(trace: Trace) -> int | None:
    for attempt in sorted(trace.manifest.attempts, key=lambda a: a.attempt, reverse=True):
        value = attempt.determinism.get("num_threads") or attempt.determinism.get("torch_num_threads")
        if value:
            return int(value)
    return None


def _recorded_reduction(trace: Trace, attempt: int) -> str:
    """The all-reduce mechanism ``attempt`` recorded (``native`` for traces that predate the field)."""
    return str(env.attempt_determinism(trace, attempt).get("reduction") or "native")


def _recorded_numerics(trace: Trace, step: int) -> dict:
    """The numerics contract of the attempt that ran ``step`` (the latest attempt starting at or before it)."""
    attempts = [a for a in trace.manifest.attempts if a.start_step <= step] or list(trace.manifest.attempts)
    return dict(max(attempts, key=lambda a: a.attempt).determinism) if attempts else {}


def _recipe_call(what: str, hook: Callable, *args):
    """``hook(*args)``, a recipe's own code: what it raises (a state dict that does not fit its model, a file it cannot
    read) is the recipe's problem, said in one line with exit 3, never a traceback that reads as a crash, or exit 1,
    which means corruption."""
    try:
        return hook(*args)
    except (SdcError, KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of user code, reported as such
        first = (str(exc).strip().splitlines() or [""])[0]
        # torch.optim.Optimizer.load_state_dict's words for groups that do not fit
        check = (
            "check its optimizer's parameter groups against the job's (which parameters each group holds, "
            "e.g. no weight decay on norms and biases)"
            if "parameter group" in first
            else "check its model against the checkpoint's keys (a compiled module saves '_orig_mod.' ones)"
        )
        raise RecipeError(
            f"the recipe's {what} failed: {type(exc).__name__}: {first[:300]}; the recipe must rebuild the job's "
            f"model and optimizer and load its checkpoints (docs/recipes.md): {check}"
        ) from None
