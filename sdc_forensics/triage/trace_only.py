"""Triage: every piece of evidence the trace alone gives, vectorised over steps x ranks.

numpy only (never imports torch), so ``bisect --trace-only`` and ``certify`` start fast. The
trace is read window by window (:meth:`Trace.step_windows`, ``(S, R)`` tables); per window:

* non-finite values in local gradients (the rank's compute), in the reduced gradient while every
  local one was finite (the collective), in the weights while the reduced gradient was finite
  (the update);
* the all-reduce check: the reduced sketch of each rank against the mean of the ranks' local
  sketches, within the calibrated tolerance (``fingerprint/tolerance.py``), and each rank's
  reduced digest against the ranks' strict majority;
* replica weight divergence: each rank's post-update weights digest against the strict majority,
  reported at its onset;
* audits: subject's own gradient digest and the auditors' recomputations, majority of three;
  the auditor's input digest against the subject's;
* outliers of loss and local gradient norm across ranks (hints only, never a verdict);
* a sharded job's (the manifest's ``parallel`` mesh; ``recorder/fsdp_layout.py``): the shards of a
  replica adding up to the reduction and the replicas of a shard agreeing (instead of the per-rank
  all-reduce check), the weights voted per shard across replicas, and each weight shard at rest
  (its digest when a step began against the last update's).

The result names the first step at which the replicas' state is known to have gone wrong
(:attr:`TriageResult.first_suspect_step`) and the window of steps a replay must examine to
confirm it and localise it further.

Over 400 lines on purpose: one vectorised pass per evidence kind over the same window tables; split
by kind, each module would rebuild the tables or take them as a long argument list.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import numpy as np

from sdc_forensics.fingerprint import tolerance
from sdc_forensics.trace.checkpoints import hex64
from sdc_forensics.evidence import Evidence, EvidenceKind, Location, Strength, divergence_window, sort_key
from sdc_forensics.trace import format as F
from sdc_forensics.trace import scan
from sdc_forensics.trace.consensus import majority_within, strict_majority, vote
from sdc_forensics.trace.mesh import ShardMesh
from sdc_forensics.trace.reader import Damage, StepWindow, Trace

log = logging.getLogger(__name__)
_MAX_OUTLIERS = 20
# the record fields the window scan reads: copying only these halves the bytes moved per window
_FIELDS = (
    "flags",
    "loss",
    "nonfinite_local",
    "nonfinite_reduced",
    "nonfinite_weights",
    "local_norm",
    "reduced_norm",
    "reduced_digest",
    "weights_digest",
    "local_sketch",
    "reduced_sketch",
    "aux_digest",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TriageOptions:
    """How to triage.

    Attributes:
        window_steps: steps per vectorised window (memory is bounded by it).
        start_step, stop_step: limit the steps examined (inclusive), None for all.
        outlier_z: robust z-score (median / MAD) above which a value is an outlier hint.
        outliers: report outlier hints at all.
    """

    window_steps: int = 1024
    start_step: int | None = None
    stop_step: int | None = None
    outlier_z: float = 12.0
    outliers: bool = True

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError("window_steps must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TriageResult:
    """What the trace alone says.

    Attributes:
        evidence: every observation, sorted by step (hints after real evidence at a step).
        first_suspect_step: the first step whose evidence says the replicas' state went wrong
            (theta_step is still clean, theta_step+1 may not be), None if the trace shows none.
        suspect_window: ``(first, last)`` steps a replay must examine to confirm
            ``first_suspect_step`` (wider than one step when weights were not compared every
            step), None when there is nothing to confirm.
        step_range: ``(first, last)`` step recorded, None for an empty trace.
        world_size: number of ranks.
        weights_checked: steps at which replica weights were compared.
        superseded_cells: (step, rank) cells also recorded by an earlier attempt (latest used).
        damage: problems found in the trace files.
        has_gradients: the trace carries gradient fingerprints (replay can compare them).
        scan_path: ``numba`` (the compiled kernels of ``trace/scan.py``) or ``numpy``: which scan
            produced the evidence (the same evidence either way).
    """

    evidence: tuple[Evidence, ...]
    first_suspect_step: int | None
    suspect_window: tuple[int, int] | None
    step_range: tuple[int, int] | None
    world_size: int
    weights_checked: int = 0
    superseded_cells: int = 0
    damage: tuple[Damage, ...] = ()
    has_gradients: bool = True
    scan_path: str = scan.NUMPY

    @property
    def hints(self) -> tuple[Evidence, ...]:
        return tuple(e for e in self.evidence if e.is_hint)

    @property
    def findings(self) -> tuple[Evidence, ...]:
        return tuple(e for e in self.evidence if not e.is_hint)


def triage_trace(trace: Trace, options: TriageOptions | None = None) -> TriageResult:
    """Scan a trace and return every piece of evidence it holds.

    Args:
        trace: an open trace.
        options: :class:`TriageOptions` (defaults if None).

    Returns:
        A :class:`TriageResult`.
    """
    options = options or TriageOptions()
    manifest = trace.manifest
    grad_dtype = manifest.fingerprint.grad_dtype
    # a sharded job's records are per shard: its checks group ranks by mesh (the numpy scan's)
    fast = _scan_fast(trace, options, grad_dtype, manifest.reduction) if manifest.parallel is None else None
    if fast is not None:
        evidence, num_checked, superseded, has_grads = fast
        path = scan.NUMBA
    else:
        evidence, num_checked, superseded, has_grads = _scan_numpy(
            trace, options, grad_dtype, manifest.reduction, manifest.parallel
        )
        path = scan.NUMPY
    log.info("triage: %s scan path", path)
    evidence += _audits(trace, options)
    evidence.sort(key=sort_key)
    # the decision's rule on the trace's evidence: s* and the steps a replay must examine to pin it
    window_range = divergence_window(evidence)
    return TriageResult(
        evidence=tuple(evidence),
        first_suspect_step=window_range[0] if window_range is not None else None,
        suspect_window=window_range,
        step_range=trace.step_range(),
        world_size=trace.world_size,
        weights_checked=num_checked,
        superseded_cells=superseded,
        damage=tuple(trace.damage()),
        has_gradients=has_grads,
        scan_path=path,
    )


def _scan_numpy(trace: Trace, options: TriageOptions, grad_dtype: str, reduction: str, mesh: ShardMesh | None = None):
    """The window scan in numpy: ``(evidence, steps weights-checked, superseded cells, has gradients)``."""
    evidence: list[Evidence] = []
    state = _WeightState(world_size=trace.world_size, groups=None if mesh is None else mesh.same_shard())
    rest = _RestState(world_size=trace.world_size, mesh=mesh, saved=_saved_shards(trace)) if mesh is not None else None
    superseded = 0
    has_grads = False
    outlier_count = 0
    for window in trace.step_windows(options.window_steps, options.start_step, options.stop_step, fields=_FIELDS):
        superseded += int(window.superseded.sum())
        has_grads |= bool(((window.records["flags"] & int(F.Flag.HAS_GRADS)) != 0)[window.present].any())
        evidence += _nonfinite(window)
        evidence += (
            _allreduce(window, grad_dtype, reduction)
            if mesh is None
            else _reduce_scatter(window, grad_dtype, reduction, mesh)
        )
        evidence += state.scan(window)
        if rest is not None:
            evidence += rest.scan(window)
        if options.outliers and outlier_count < _MAX_OUTLIERS:
            hints = _outliers(window, options.outlier_z)[: _MAX_OUTLIERS - outlier_count]
            outlier_count += len(hints)
            evidence += hints
    return evidence, state.num_checked, superseded, has_grads


def _scan_fast(trace: Trace, options: TriageOptions, grad_dtype: str, reduction: str):
    """The same scan by the compiled kernels (``trace/scan.py``), or None where they cannot run.

    The kernels flag the steps where a check may fire and run the weight vote; the numpy checks
    above then run on those steps alone, so the evidence is theirs.
    """
    if trace.kernels() is None:
        return None
    bounds = trace.step_range()
    if bounds is None:
        return [], 0, 0, False
    lo = bounds[0] if options.start_step is None else max(options.start_step, bounds[0])
    hi = bounds[1] if options.stop_step is None else min(options.stop_step, bounds[1])
    scanner = scan.StepScan.open(trace, lo, hi, options.window_steps)
    if scanner is None:
        return None
    from sdc_forensics.trace.scan_kernels import EV_ALLREDUCE, EV_NONFINITE, EV_OUTLIER, EV_WEIGHTS

    evidence: list[Evidence] = []
    outlier_count = 0
    scanner.outlier_z = options.outlier_z if options.outliers else None
    for window in scanner:
        rows = np.flatnonzero(window.events & (EV_NONFINITE | EV_ALLREDUCE | EV_WEIGHTS | EV_OUTLIER))
        if not rows.size:
            continue
        exact = scanner.exact_window(window, rows, _FIELDS)
        evidence += _nonfinite(exact)
        evidence += _allreduce(exact, grad_dtype, reduction)
        for i in np.flatnonzero(window.events[rows] & EV_WEIGHTS):
            row = rows[i]
            last = int(window.pre_last[row])
            state = _WeightState(
                world_size=trace.world_size,
                diverged=window.pre_diverged[:, row].copy(),
                last_checked=None if last < 0 else last,
                first_step=scanner.first_step,
            )
            evidence += state.scan(_row(exact, int(i)))
        if options.outliers and outlier_count < _MAX_OUTLIERS:
            hints = _outliers(exact, options.outlier_z)[: _MAX_OUTLIERS - outlier_count]
            outlier_count += len(hints)
            evidence += hints
            if outlier_count >= _MAX_OUTLIERS:
                # the numpy path stops looking too: from the next window on
                scanner.outlier_z = None
    return evidence, scanner.num_checked, scanner.superseded, scanner.has_gradients


def _row(window: StepWindow, row: int) -> StepWindow:
    pick = slice(row, row + 1)
    return StepWindow(
        steps=window.steps[pick],
        present=window.present[pick],
        attempt=window.attempt[pick],
        superseded=window.superseded[pick],
        records=window.records[pick],
    )


def _ranks(mask_row: np.ndarray) -> tuple[int, ...]:
    return tuple(int(r) for r in np.flatnonzero(mask_row))


def _nonfinite(window: StepWindow) -> list[Evidence]:
    # (S, R)
    rec, present = window.records, window.present
    local = (rec["nonfinite_local"] > 0) & present
    reduced = (rec["nonfinite_reduced"] > 0) & present
    has_w = ((rec["flags"] & int(F.Flag.HAS_WEIGHTS)) != 0) & present
    weights = (rec["nonfinite_weights"] > 0) & has_w
    out: list[Evidence] = []
    # (S,)
    any_local = local.any(axis=1)
    for row in np.flatnonzero(any_local | reduced.any(axis=1) | weights.any(axis=1)):
        step = int(window.steps[row])
        if any_local[row]:
            ranks = _ranks(local[row])
            counts = ", ".join(f"rank {r}: {int(rec['nonfinite_local'][row, r])}" for r in ranks)
            out.append(
                Evidence(
                    kind=EvidenceKind.NONFINITE,
                    step=step,
                    ranks=ranks,
                    expected="0 NaN/Inf in the local gradient",
                    found=counts,
                    location=Location.LOCAL_COMPUTE,
                    detail="NaN/Inf in the local gradient before the all-reduce",
                )
            )
            # the reduced gradient and the weights inherit it
            continue
        if reduced[row].any():
            ranks = _ranks(reduced[row])
            everyone = len(ranks) == int(present[row].sum())
            out.append(
                Evidence(
                    kind=EvidenceKind.NONFINITE,
                    step=step,
                    ranks=() if everyone else ranks,
                    expected="0 NaN/Inf in the reduced gradient (every local gradient was finite)",
                    found=f"NaN/Inf on rank(s) {', '.join(map(str, ranks))}",
                    location=Location.COLLECTIVE,
                    detail="the all-reduce produced NaN/Inf from finite inputs",
                )
            )
            continue
        ranks = _ranks(weights[row])
        out.append(
            Evidence(
                kind=EvidenceKind.NONFINITE,
                step=step,
                ranks=ranks,
                expected="0 NaN/Inf in the updated weights",
                found=", ".join(f"rank {r}: {int(rec['nonfinite_weights'][row, r])}" for r in ranks),
                location=Location.OPTIMIZER_UPDATE,
                detail="NaN/Inf in the weights after an update with a finite reduced gradient",
            )
        )
    return out


def _allreduce(window: StepWindow, grad_dtype: str, reduction: str) -> list[Evidence]:
    rec, present = window.records, window.present
    # (S, R)
    has_grads = ((rec["flags"] & int(F.Flag.HAS_GRADS)) != 0) & present
    # (S,)
    full = has_grads.all(axis=1) & ((rec["nonfinite_local"] == 0) | ~present).all(axis=1)
    if not full.any():
        return []
    # (S, R, k) float32, accumulated in float64 below
    local_sk = rec["local_sketch"]
    if reduction == "mean":
        # (S, k)
        expected = local_sk.mean(axis=1, dtype=np.float64)
    else:
        expected = local_sk.sum(axis=1, dtype=np.float64)
    # (S, R) float64
    residual = np.abs(rec["reduced_sketch"] - expected[:, None, :]).max(axis=2)
    # (S, 1, R)
    local_norms = np.where(present, rec["local_norm"], 0.0)[:, None, :]
    # (S, R)
    tol = tolerance.allreduce_tolerance(grad_dtype, local_norms, rec["reduced_norm"], reduction)
    over = (residual > tol) & full[:, None]
    majority, has_majority = strict_majority(rec["reduced_digest"], has_grads)
    minority = (rec["reduced_digest"] != majority[:, None]) & has_grads & (has_majority & full)[:, None]
    out: list[Evidence] = []
    for row in np.flatnonzero((over | minority).any(axis=1)):
        step = int(window.steps[row])
        bad = over[row] | minority[row]
        everyone = bool(bad[has_grads[row]].all())
        ranks = () if everyone else _ranks(bad)
        worst = int(np.argmax(np.where(bad, residual[row] / np.maximum(tol[row], 1e-300), -1)))
        out.append(
            Evidence(
                kind=EvidenceKind.ALLREDUCE_MISMATCH,
                step=step,
                ranks=ranks,
                expected=f"reduced sketch = {reduction} of local sketches within {tol[row, worst]:.3g}; reduced digest "
                f"{hex64(majority[row])} on every rank",
                found=f"residual {residual[row, worst]:.3g} on rank {worst}"
                + (
                    ""
                    if everyone
                    else f"; reduced digest differs on rank(s) {', '.join(map(str, _ranks(minority[row]))) or 'none'}"
                ),
                location=Location.COLLECTIVE,
                detail="every rank received the same wrong all-reduce result"
                if everyone
                else "the all-reduce result on these ranks differs from what the local gradients sum to",
            )
        )
    return out


def _reduce_scatter(window: StepWindow, grad_dtype: str, reduction: str, mesh: ShardMesh) -> list[Evidence]:
    """A sharded job's reduction (``recorder/fsdp_layout.py``): each rank's ``reduced_*`` is its
    shard. The shards of one replica add up (sketches are linear) to the reduction of every rank's
    local gradient; the replicas of one shard hold equal digests; and the recorder's own check of
    each rank's shard against the chunks it sums set ``ALLREDUCE_MISMATCH`` on that rank's record
    (it names the rank; the sums here name the replica)."""
    rec, present = window.records, window.present
    # (S, R)
    has_grads = ((rec["flags"] & int(F.Flag.HAS_GRADS)) != 0) & present
    # (S,)
    full = has_grads.all(axis=1) & ((rec["nonfinite_local"] == 0) | ~present).all(axis=1)
    flagged = ((rec["flags"] & int(F.Flag.ALLREDUCE_MISMATCH)) != 0) & present
    # a float16 reduction: the recorded local gradient is divided by FSDP2's pre-factor (a power of
    # two, undone exactly here), the sum divided by the post-factor: a mean all the same
    undo = float(mesh.divide_factors()[0]) if mesh.divide_factors() is not None else 1.0
    local_sk = rec["local_sketch"].astype(np.float64) * undo
    expected = (
        local_sk.mean(axis=1, dtype=np.float64) if reduction == "mean" else local_sk.sum(axis=1, dtype=np.float64)
    )
    # (S, 1, R)
    local_norms = np.where(present, rec["local_norm"].astype(np.float64) * undo, 0.0)[:, None, :]
    # (S, R): the rank's replica does not add up
    over = np.zeros(has_grads.shape, dtype=bool)
    residuals = np.zeros(has_grads.shape)
    # tensor (pipeline) parallel: the ranks of one TP coordinate (stage) reduce among themselves, over
    # every replica of the shard in HSDP (a reduce group holds one replica's shards)
    peers: dict[tuple[int, int], list[int]] = {}
    for r in range(mesh.world_size):
        peers.setdefault((mesh.tp_of(r), mesh.pp_of(r)), []).append(r)
    for group in mesh.reduce_groups():
        g = list(group)
        # (S, k)
        if mesh.tp_dim >= 0 or mesh.pp_dim >= 0:
            mine = peers[(mesh.tp_of(g[0]), mesh.pp_of(g[0]))]
            expected = local_sk[:, mine].mean(axis=1) if reduction == "mean" else local_sk[:, mine].sum(axis=1)
        # (S, k)
        summed = rec["reduced_sketch"][:, g, :].sum(axis=1, dtype=np.float64)
        # (S, 1)
        norm = np.sqrt((rec["reduced_norm"][:, g].astype(np.float64) ** 2).sum(axis=1))[:, None]
        # (S,)
        tol = tolerance.allreduce_tolerance(grad_dtype, local_norms, norm, reduction)[:, 0]
        residual = np.abs(summed - expected).max(axis=1)
        residuals[:, g] = (residual / np.maximum(tol, 1e-300))[:, None]
        over[:, g] = ((residual > tol) & full)[:, None]
    # (S, R): a replica of a shard that disagrees with the others
    minority = np.zeros(has_grads.shape, dtype=bool)
    for group in mesh.same_shard():
        if len(group) < 2:
            continue
        g = list(group)
        majority, has_majority = strict_majority(rec["reduced_digest"][:, g], has_grads[:, g])
        minority[:, g] = (rec["reduced_digest"][:, g] != majority[:, None]) & has_grads[:, g] & has_majority[:, None]
    out: list[Evidence] = []
    for row in np.flatnonzero((flagged | over | minority).any(axis=1)):
        named = flagged[row] | minority[row]
        bad = named if named.any() else over[row]
        everyone = bool(bad[has_grads[row]].all())
        ranks = () if everyone else _ranks(bad)
        where = "; ".join(f"rank {r}: {mesh.where(r)}" for r in ranks)
        out.append(
            Evidence(
                kind=EvidenceKind.ALLREDUCE_MISMATCH,
                step=int(window.steps[row]),
                ranks=ranks,
                location=Location.COLLECTIVE,
                expected=f"each shard of the reduced gradient = the {reduction} of that chunk of every rank's local gradient",
                found=(
                    f"the recorder's reduce-scatter check fired on {where}"
                    if flagged[row].any()
                    else f"the replicas of a shard hold different reduced digests ({where})"
                    if minority[row].any()
                    else f"the shards of a replica do not add up (residual {residuals[row].max():.3g}x the tolerance)"
                ),
                detail="the reduce-scatter (or the replicas' all-reduce) output on these ranks differs from what the local "
                "gradients sum to"
                if ranks
                else "the reduced gradient differs from what the local gradients sum to",
            )
        )
    return out


_NO_DIGEST = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def _saved_shards(trace: Trace) -> dict[tuple[int, int], np.ndarray]:
    """``(attempt, N) -> (R,)`` each rank's weight shard digest as its CHECKPOINT record of ``N`` noted it."""
    out: dict[tuple[int, int], np.ndarray] = {}
    for rec in trace.records(F.Kind.CHECKPOINT):
        row = out.setdefault(
            (int(rec["attempt"]), int(rec["step"])), np.full(trace.world_size, _NO_DIGEST, dtype=np.uint64)
        )
        if 0 <= int(rec["rank"]) < trace.world_size:
            row[int(rec["rank"])] = rec["weights_digest"]
    return out


@dataclasses.dataclass(kw_only=True)
class _RestState:
    """A sharded job's weights at rest: each rank's shard digest when step ``s`` began (STEP
    ``aux_digest``) against its digest after step ``s - 1``'s update. A change between them is a
    change at rest on the rank holding the shard, which every rank then gathered and computed with
    (so every rank's gradient differs at ``s``: only this names the rank). And the weights as
    gathered: a rank whose all-gathered parameters the recorder's vote set apart
    (``GATHER_DIVERGED``) computed step ``s`` with other weights than the majority."""

    world_size: int
    mesh: ShardMesh
    saved: dict[tuple[int, int], np.ndarray] = dataclasses.field(
        default_factory=dict
        # (attempt, N) -> (R,) shards at checkpoint N
    )
    # (R,) uint64 digest after the last update seen per rank
    last: np.ndarray | None = None
    # (R,) int64 its step (-2: none)
    last_step: np.ndarray | None = None
    last_attempt: np.ndarray | None = None

    def scan(self, window: StepWindow) -> list[Evidence]:
        rec, present = window.records, window.present
        if self.last is None:
            self.last = np.zeros(self.world_size, dtype=np.uint64)
            self.last_step = np.full(self.world_size, -2, dtype=np.int64)
            self.last_attempt = np.full(self.world_size, -1, dtype=np.int64)
        has_w = ((rec["flags"] & int(F.Flag.HAS_WEIGHTS)) != 0) & present
        out: list[Evidence] = []
        for row, step in enumerate(window.steps.tolist()):
            rest = (rec["flags"][row] & int(F.Flag.REST_WEIGHTS)) != 0
            follows = present[row] & rest & (self.last_step == step - 1) & (self.last_attempt == window.attempt[row])
            before = self.last.copy()
            # the first step of an attempt (or after a gap): the shards its checkpoint noted are the baseline
            for r in np.flatnonzero(present[row] & rest & ~follows).tolist():
                noted = self.saved.get((int(window.attempt[row, r]), step))
                if noted is not None and noted[r] != _NO_DIGEST:
                    before[r], follows[r] = noted[r], True
            changed = follows & (rec["aux_digest"][row] != before)
            if changed.any():
                ranks = _ranks(changed)
                out.append(
                    Evidence(
                        kind=EvidenceKind.WEIGHT_DIVERGENCE,
                        step=step,
                        ranks=ranks,
                        location=Location.STATE_AT_REST,
                        shared=True,
                        reach=tuple(sorted({m for g in self.mesh.replicas() if set(g) & set(ranks) for m in g})),
                        expected=", ".join(
                            f"rank {r}: {hex64(int(before[r]))} (after step {step - 1}'s update, or as checkpoint "
                            f"{step} noted it)"
                            for r in ranks
                        ),
                        found=", ".join(
                            f"rank {r}: {hex64(int(rec['aux_digest'][row, r]))} when step {step} began" for r in ranks
                        ),
                        detail="this rank's weight shard changed at rest between two steps; its replica's ranks gathered it for "
                        f"the forward, so their gradients at step {step} carry it ({'; '.join(self.mesh.where(r) for r in ranks)})",
                    )
                )
            gathered = present[row] & ((rec["flags"][row] & int(F.Flag.GATHER_DIVERGED)) != 0)
            if gathered.any():
                ranks = _ranks(gathered)
                out.append(
                    Evidence(
                        kind=EvidenceKind.WEIGHT_DIVERGENCE,
                        step=step,
                        ranks=ranks,
                        location=Location.LOCAL_COMPUTE,
                        expected=f"every rank gathers the same whole parameters for step {step}'s forward",
                        found=f"the recorder's vote of the gathered parameters named {', '.join(f'rank {r}' for r in ranks)}",
                        detail=f"these ranks computed step {step} with other parameters than the majority gathered (an all-gather "
                        f"output, or a copy of it, changed on them: {'; '.join(self.mesh.where(r) for r in ranks)})",
                    )
                )
            self.last = np.where(has_w[row], rec["weights_digest"][row], self.last)
            self.last_step = np.where(has_w[row], step, self.last_step)
            self.last_attempt = np.where(has_w[row], window.attempt[row], self.last_attempt)
        return out


@dataclasses.dataclass(kw_only=True)
class _WeightState:
    """Replica weight divergence across windows: onsets only, and the last checked step."""

    world_size: int
    groups: list[tuple[int, ...]] | None = (
        None  # ranks that hold the same weights (a sharded job's replicas of a shard); None: all
    )
    # (R,) bool, state at the last checked step
    diverged: np.ndarray | None = None
    last_checked: int | None = None
    first_step: int | None = None
    num_checked: int = 0

    def scan(self, window: StepWindow) -> list[Evidence]:
        rec, present = window.records, window.present
        # (S, R)
        has_w = ((rec["flags"] & int(F.Flag.HAS_WEIGHTS)) != 0) & present
        # (S, R): the rank's group has 2 or more weights to compare
        voting = self._voting(has_w)
        checked_rows = np.flatnonzero(voting.any(axis=1))
        if self.first_step is None and len(window.steps):
            self.first_step = int(window.steps[0])
        if self.diverged is None:
            self.diverged = np.zeros(self.world_size, dtype=bool)
        if not checked_rows.size:
            return []
        # (S, R) each: per rank's group
        majority, has_majority = self._majority(rec["weights_digest"], has_w)
        out: list[Evidence] = []
        for row in checked_rows:
            step = int(window.steps[row])
            self.num_checked += 1
            split = voting[row] & ~has_majority[row]
            if split.any():
                out.append(
                    Evidence(
                        kind=EvidenceKind.WEIGHT_DIVERGENCE,
                        step=step,
                        ranks=(),
                        expected="a strict majority of replicas with equal weights",
                        found=f"{len(set(rec['weights_digest'][row][split].tolist()))} distinct digests"
                        + ("" if self.groups is None else f" among ranks {', '.join(map(str, _ranks(split)))}"),
                        location=Location.UNKNOWN,
                        detail="no strict majority of replica weights"
                        + (
                            ""
                            if self.groups is None
                            else " (the replicas of a shard disagree and no vote can name one: a replay can)"
                        ),
                    )
                )
                if self.groups is None or split.all():
                    self.last_checked = step
                    continue
            # (R,)
            now = (rec["weights_digest"][row] != majority[row]) & has_w[row] & has_majority[row] & voting[row]
            onset = now & ~self.diverged
            if onset.any():
                ranks = _ranks(onset)
                # equal at the previous comparison: the fault happened after it
                earliest = self.last_checked + 1 if self.last_checked is not None else self.first_step
                found = ", ".join(f"rank {r}: {hex64(rec['weights_digest'][row, r])}" for r in ranks)
                out.append(
                    Evidence(
                        kind=EvidenceKind.WEIGHT_DIVERGENCE,
                        step=step,
                        ranks=ranks,
                        expected=f"weights digest {hex64(majority[row, ranks[0]])} (strict majority)",
                        found=found,
                        location=Location.UNKNOWN,
                        earliest_step=earliest if earliest is not None and earliest < step else None,
                        detail="this replica's weights after the update differ from the majority: a wrong update, "
                        "or wrong weights at rest; replay tells them apart",
                    )
                )
            self.diverged = now | (self.diverged & ~has_w[row])
            self.last_checked = step
        return out

    def _majority(self, digests: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(S, R)`` majority digest and whether there is one, of each rank's group (the recorder's vote, once)."""
        return majority_within(digests, valid, self.groups)

    def _voting(self, valid: np.ndarray) -> np.ndarray:
        if self.groups is None:
            return np.repeat((valid.sum(axis=1) >= 2)[:, None], valid.shape[1], axis=1) & valid
        out = np.zeros(valid.shape, dtype=bool)
        for group in self.groups:
            g = list(group)
            out[:, g] = ((valid[:, g].sum(axis=1) >= 2)[:, None]) & valid[:, g]
        return out


def _audits(trace: Trace, options: TriageOptions) -> list[Evidence]:
    audits = trace.records(F.Kind.AUDIT)
    if not len(audits):
        return []
    if options.start_step is not None:
        audits = audits[audits["step"] >= options.start_step]
    if options.stop_step is not None:
        audits = audits[audits["step"] <= options.stop_step]
    steps_needed = np.unique(audits["step"])
    subject_inputs: dict[tuple[int, int], int] = {}
    audit_steps, audit_subjects = audits["step"], audits["aux_rank"].astype(np.int64)
    for window in _audited_windows(trace, options, steps_needed):
        # the subject's own STEP record of each audit in this window, where present
        row = np.minimum(np.searchsorted(window.steps, audit_steps), len(window.steps) - 1)
        ok = (window.steps[row] == audit_steps) & (audit_subjects >= 0) & (audit_subjects < window.present.shape[1])
        ok[ok] = window.present[row[ok], audit_subjects[ok]]
        found = window.records["input_digest"][row[ok], audit_subjects[ok]]
        for step, subject, value in zip(audit_steps[ok].tolist(), audit_subjects[ok].tolist(), found.tolist()):
            subject_inputs[(step, subject)] = value
    out: list[Evidence] = []
    for step, subject, group, votes, winner, strict in audit_votes(audits):
        values = [v for _, v in votes]
        losers = tuple(r for r, v in votes if v != winner)
        if losers:
            if not strict:
                out.append(
                    Evidence(
                        kind=EvidenceKind.AUDIT_MISMATCH,
                        step=step,
                        ranks=(subject,),
                        expected="the subject and its auditor agree",
                        found=f"{len(set(values))} different gradient digests, no third vote",
                        location=Location.UNKNOWN,
                        detail=f"audit of rank {subject}'s microbatch is unresolved; a replay decides",
                    )
                )
            elif subject in losers:
                out.append(
                    Evidence(
                        kind=EvidenceKind.AUDIT_MISMATCH,
                        step=step,
                        ranks=(subject,),
                        expected=hex64(winner),
                        found=hex64(votes[0][1]),
                        location=Location.LOCAL_COMPUTE,
                        detail=f"rank {subject}'s own gradient lost the audit vote {values.count(winner)} to {len(values) - values.count(winner)}",
                    )
                )
            else:
                out.append(
                    Evidence(
                        kind=EvidenceKind.AUDIT_MISMATCH,
                        step=step,
                        ranks=losers,
                        expected=hex64(winner),
                        found=", ".join(hex64(v) for r, v in votes if r in losers),
                        location=Location.LOCAL_COMPUTE,
                        affects_state=False,
                        detail="the auditor's recomputation was wrong; the training state was not affected",
                    )
                )
        subject_input = subject_inputs.get((step, subject))
        for audit in group:
            audited_input = int(audit["input_digest"])
            if audited_input and subject_input is not None and audited_input != subject_input:
                out.append(
                    Evidence(
                        kind=EvidenceKind.INPUT_MISMATCH,
                        step=step,
                        ranks=(subject,),
                        expected=hex64(audited_input),
                        found=hex64(subject_input),
                        location=Location.INPUT_DATA,
                        detail=f"rank {int(audit['rank'])} fetched rank {subject}'s microbatch with a different input digest",
                    )
                )
                break
    return out


def _audited_windows(trace: Trace, options: TriageOptions, steps_needed: np.ndarray):
    """``StepWindow`` s (field ``input_digest``) holding the audited steps: every window of their
    span from ``Trace.step_windows``, or, on the compiled path, only the audited steps' rows."""
    lo = int(steps_needed.min()) if len(steps_needed) else None
    hi = int(steps_needed.max()) if len(steps_needed) else None
    scanner = None
    if lo is not None and trace.kernels() is not None:
        bounds = trace.step_range()
        if bounds is not None and max(lo, bounds[0]) <= min(hi, bounds[1]):
            scanner = scan.StepScan.open(
                trace, max(lo, bounds[0]), min(hi, bounds[1]), options.window_steps, full=False
            )
    if scanner is None:
        yield from trace.step_windows(options.window_steps, lo, hi, fields=("input_digest",))
        return
    for window in scanner:
        rows = np.flatnonzero(np.isin(window.steps, steps_needed))
        if rows.size:
            yield scanner.exact_window(window, rows, ("input_digest",))


def _robust_z(values: np.ndarray, axis: int) -> np.ndarray:
    with warnings.catch_warnings():
        # all-NaN rows (a step where every rank blew up)
        warnings.simplefilter("ignore", RuntimeWarning)
        return _robust_z_inner(values, axis)


def _robust_z_inner(values: np.ndarray, axis: int) -> np.ndarray:
    median = np.nanmedian(values, axis=axis, keepdims=True)
    mad = np.nanmedian(np.abs(values - median), axis=axis, keepdims=True)
    scale = 1.4826 * mad + 1e-6 * np.abs(median) + 1e-30
    return np.abs(values - median) / scale


def _outliers(window: StepWindow, threshold: float) -> list[Evidence]:
    """Loss and local gradient norm far from the ranks' median: robust z above ``threshold`` and
    more than twice the median's distance from zero (a handful of ranks makes the MAD noisy).
    A recorded value that overflowed (finite elements, infinite norm) is the most extreme outlier."""
    rec, present = window.records, window.present
    if present.shape[1] < 4:
        return []
    out: list[Evidence] = []
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for field, what in (("loss", "loss"), ("local_norm", "local gradient norm")):
            # (S, R)
            raw = np.where(present, rec[field].astype(np.float64), np.nan)
            overflow = present & np.isinf(raw)
            values = np.where(np.isfinite(raw), raw, np.nan)
            # (S, 1)
            median = _nanmedian_rows(values)
            # across ranks, per step
            z = np.nan_to_num(_robust_z(values, axis=1), nan=0.0)
            far = np.abs(values - median) > np.abs(median)
            hit = ((z > threshold) & far) | overflow
            for row, rank in zip(*np.nonzero(hit)):
                shown = f"{raw[row, rank]:.4g}" + ("" if overflow[row, rank] else f" (robust z {z[row, rank]:.1f})")
                out.append(
                    Evidence(
                        kind=EvidenceKind.OUTLIER,
                        step=int(window.steps[row]),
                        ranks=(int(rank),),
                        expected=f"{what} near the ranks' median {float(median[row, 0]):.4g}",
                        found=shown,
                        location=Location.UNKNOWN,
                        affects_state=False,
                        strength=Strength.WEAK,
                        detail=f"{what} is an outlier across ranks (a hint only)",
                    )
                )
    return out


def _nanmedian_rows(values: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(values, axis=1, keepdims=True)


def audit_votes(audits: np.ndarray):
    """The vote of each audited (step, subject): the subject's own gradient digest and its
    auditors' recomputations. Yields ``(step, subject, group, votes, winner, strict)``: ``votes``
    ``[(rank, digest)]`` subject first, ``winner`` the digest a strict majority of them computed
    (``consensus.vote``; None without one), ``strict`` whether there is one. The one rule for
    triage's audit evidence and the report's plots."""
    steps, subjects = audits["step"], audits["aux_rank"].astype(np.int64)
    # stable: a group keeps its records' order in ``audits``
    order = np.lexsort((subjects, steps))
    steps, subjects = steps[order], subjects[order]
    starts = (
        np.flatnonzero(np.r_[True, (steps[1:] != steps[:-1]) | (subjects[1:] != subjects[:-1])])
        if len(order)
        else order
    )
    ends = np.r_[starts[1:], len(order)]
    for start, end in zip(
        starts,
        ends,
        # one group per (step, subject), in that order: O(N log N), not a scan per group
    ):
        step, subject = steps[start], subjects[start]
        group = audits[np.sort(order[start:end])]
        votes = [(int(subject), int(group["aux_digest"][0]))] + [
            (int(a["rank"]), int(a["local_digest"])) for a in group
        ]
        winner, _ = vote([v for _, v in votes])
        yield int(step), int(subject), group, votes, winner, winner is not None
