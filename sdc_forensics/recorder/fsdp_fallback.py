"""Reading a sharded job where FSDP2 has no reduce-scatter to wrap.

The FSDP recorder reads a rank's local gradient from its reduce-scatter input, through the
parameter group's custom reduce-scatter (``FSDPModule.set_custom_reduce_scatter``). A torch
whose FSDP2 lacks it calls the collective directly, so there the recorder takes the gradient one
moment earlier: each parameter group's ``post_backward`` (which FSDP2 runs once the group's
unsharded gradients are complete, and which reduce-scatters them) is wrapped on the group, and
when it is about to reduce, the unsharded gradients are read (the accumulated one where FSDP2
accumulates in the reduce dtype, cast to the reduce dtype otherwise: what the collective would be
given) and fingerprinted as pieces of the whole local gradient, by element index. The trace is
the same as the reduce-scatter tap's.

The online check of the reduction then runs on the step's results instead of on each call: rank
``r``'s reduced shard (``reduced_*``, which it reads after the backward) must be the mean over every
rank of their local gradients' rows of that shard (sketches are linear), so a wrong reduce-scatter
or HSDP all-reduce output is named on the rank that holds it. The reduction itself is the job's:
``reduction="ordered"`` needs the custom reduce-scatter and is refused, so the replay compares the
reduced gradient within tolerance (detection, no certificate).

``SDC_FORENSICS_FSDP_TAP=post-backward`` in the environment takes this path on any torch (the
tests do, to run it where the custom reduce-scatter exists).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import shards
from sdc_forensics.fingerprint.core import Fingerprint
from sdc_forensics.recorder import fsdp_monitor as fm
from sdc_forensics.recorder.checks import Check, Finding
from sdc_forensics.trace.mesh import ShardMesh, shard_rows

TAP_ENV = "SDC_FORENSICS_FSDP_TAP"


def wanted() -> bool:
    """Whether the recorder reads gradients in ``post_backward`` (no custom reduce-scatter here, or asked)."""
    from torch.distributed.fsdp import FSDPModule

    return os.environ.get(TAP_ENV, "") == "post-backward" or not hasattr(FSDPModule, "set_custom_reduce_scatter")


def missing(model: torch.nn.Module) -> str | None:
    """What this torch's FSDP2 lacks for the ``post_backward`` tap, in one line (None: nothing)."""
    for group in fm.param_groups(model):
        if not callable(getattr(group, "post_backward", None)) or not hasattr(group, "fsdp_params"):
            return "this torch's FSDP2 parameter groups have no post_backward to read the gradients in"
        for fsdp_param in group.fsdp_params:
            if not all(hasattr(fsdp_param, a) for a in ("unsharded_accumulated_grad", "sharded_param")):
                return (
                    "this torch's FSDP2 parameters keep their unsharded gradients where the recorder cannot read them"
                )
    return None


def refusal(model: torch.nn.Module, ordered: bool, specs: list) -> str | None:
    """What the recorder cannot record through this tap, in one line (None: nothing); ``ordered``:
    the job asked for the ordered reduction; ``specs``: its fault drills."""
    lacking = missing(model)
    if lacking:
        return f"{lacking}: the recorder cannot read a sharded job's gradients with this torch (2.8 or later can)"
    if ordered:
        return (
            "reduction='ordered' replaces FSDP2's reduce-scatter through set_custom_reduce_scatter, which this "
            "torch's FSDP2 lacks (2.8 or later has it): record with reduction='native' (on gloo the replay "
            "reproduces it; elsewhere it compares within tolerance)"
        )
    wrong = sorted({s.location for s in specs if s.location in ("reduce-scatter-output", "all-reduce-output")})
    if wrong:
        return (
            f"fault location(s) {', '.join(wrong)} need set_custom_reduce_scatter, which this torch's FSDP2 "
            "lacks; local-gradient, all-gather-output, weights, update and input work"
        )
    return None


class PostBackwardTap:
    """The local gradient, as pieces, read in each parameter group's ``post_backward``; and the
    reduction's check from the step's results (see the module)."""

    def __init__(
        self, *, offsets: dict[int, int], mesh: ShardMesh, sketch_k: int, seed: int, start_step: int = 0
    ) -> None:
        self._offsets = offsets
        self._mesh = mesh
        self._k = sketch_k
        self._seed = seed
        self.step = start_step
        self.place = ""
        self._places: list[str] | None = None
        # fsdp_monitor.spec_injector: the local-gradient drill
        self._inject: Callable | None = None
        self.recording = False
        self.pieces: list[shards.Piece] = []
        self._per_shard: list[list[shards.Piece]] = [[] for _ in range(mesh.shard_size)]
        self._groups_seen: set[int] = set()
        self._calls = 0
        self.error: BaseException | None = None
        self.dtype = ""
        # FSDP2's mean over every rank (reduce-scatter, then HSDP's all-reduce)
        self.scale = 1.0 / mesh.world_size
        # where the check's numbers are all-reduced (the model's device)
        self.device = torch.device("cpu")

    def install(self, model: torch.nn.Module) -> None:
        self.device = next((p.device for p in model.parameters()), self.device)
        for group in fm.param_groups(model):
            factor = getattr(group, "gradient_divide_factor", None)
            # FSDP2 reduces to sum / factor instead of the mean
            if factor:
                self.scale = 1.0 / float(factor)
            if getattr(group, "_sdc_post_backward", None) is not None:
                raise UsageError("this model is already recorded: one Recorder per model")
            original = group.post_backward
            group._sdc_post_backward = original
            group.post_backward = self._wrap(group, original)

    def uninstall(self, model: torch.nn.Module) -> None:
        """Give every parameter group its own ``post_backward`` back."""
        for group in fm.param_groups(model):
            if getattr(group, "_sdc_post_backward", None) is not None:
                # the instance's wrapper: the class's method again
                del group.post_backward
                group._sdc_post_backward = None

    def _wrap(self, group, original):
        def post_backward(*args: Any, **kwargs: Any):
            if getattr(group, "reduce_grads", True):
                self._read(group)
            return original(*args, **kwargs)

        return post_backward

    def start(self, step: int | None) -> None:
        self.recording = step is not None
        self.pieces = []
        self._per_shard = [[] for _ in range(self._mesh.shard_size)]
        self._groups_seen = set()
        self._calls = 0
        self.error = None
        if step is not None:
            self.step = step

    def _read(self, group) -> None:
        """The group's unsharded gradients, as FSDP2 is about to reduce-scatter them."""
        grads = []
        for fsdp_param in group.fsdp_params:
            add = getattr(fsdp_param, "accumulate_unsharded_grad_if_needed", None)
            # FSDP2's own first act in post_backward (then a no-op there): this microbatch added
            if add is not None:
                add()
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                grad = None if unsharded is None else unsharded.grad
            if grad is not None:
                grads.append((fsdp_param, grad))
        # the group took no part in this backward (FSDP2 calls post_backward idempotently)
        if not grads:
            return
        if self._inject is not None:
            # in place: what FSDP2 then reduces
            self._inject("local-gradient", self._calls, grads[0][1])
        self._calls += 1
        if not self.recording or self.error is not None:
            return
        if id(group) in self._groups_seen:
            self.error = UsageError(
                "a parameter group reduce-scattered twice in one step (gradient accumulation that communicates every "
                "microbatch): call model.set_requires_gradient_sync(False) on every microbatch but the last, as "
                "FSDP2 recommends; the recorder records one reduce-scatter of the summed local gradient per step"
            )
            return
        self._groups_seen.add(id(group))
        try:
            for fsdp_param, grad in grads:
                reduce_dtype = getattr(fsdp_param, "reduce_dtype", None)
                values = grad.detach() if reduce_dtype is None else grad.detach().to(reduce_dtype)
                self.dtype = str(values.dtype).removeprefix("torch.")
                offset = self._offsets[id(fsdp_param.sharded_param)]
                rows = values.shape[0] if values.dim() else 1
                per_row = values.numel() // max(rows, 1)
                flat = values.reshape(-1)
                for shard in range(self._mesh.shard_size):
                    first, stop = shard_rows(rows, shard, self._mesh.shard_size)
                    if stop <= first:
                        continue
                    piece = shards.fingerprint_piece(
                        flat[first * per_row : stop * per_row],
                        offset=offset + first * per_row,
                        k=self._k,
                        seed=self._seed,
                    )
                    self.pieces.append(piece)
                    self._per_shard[shard].append(piece)
        except Exception as exc:  # noqa: BLE001 - said at the step's end, on every rank, never inside FSDP
            self.error = exc

    @property
    def groups_reduced(self) -> int:
        """Parameter groups read for their reduce-scatter in this step so far."""
        return len(self._groups_seen)

    def local(self) -> Fingerprint | None:
        """The step's whole local gradient, as a DDP trace's one bucket."""
        if self.error is not None:
            raise self.error
        return shards.one_bucket(self.pieces)

    def check(self, step: int, *, reduced: Fingerprint | None = None, policy: str = "return") -> fm.StepCheck:
        """This rank's reduced shard against the mean of every rank's local rows of it: each rank's
        per-shard numbers summed over the world (one all-reduce of ``S x (k + 3)`` numbers), each
        rank's verdict on its own shard, then the verdicts gathered (a collective)."""
        k = self._k
        rows = []
        for pieces in self._per_shard:
            fp = shards.combine_pieces(pieces) if pieces else None
            rows.append(
                [*map(float, fp.sketch), float(fp.norm), float(fp.nonfinite)] if fp is not None else [0.0] * (k + 2)
            )
        own = None if reduced is None else [*map(float, reduced.sketch), float(reduced.norm), float(reduced.nonfinite)]
        # (S, k + 3), over the world
        total = fm.sum_over(rows, None, self.device, k)
        rank = dist.get_rank()
        dtype = self.dtype or "float32"
        mine = own_verdict(rank, self._mesh, total, sum(int(r[k + 1]) for r in rows), own, dtype, k, self.scale)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [self.place if self._places is None else None, mine])
        if self._places is None:
            self._places = [g[0] for g in gathered]
        self.step = step + 1
        findings = sorted(
            (f for g in gathered for f in g[1]), key=lambda f: (f.check != Check.NONFINITE_BEFORE, f.rank)
        )
        # a NaN/Inf input: its rank is the finding
        if any(f.check == Check.NONFINITE_BEFORE for f in findings):
            findings = [f for f in findings if f.check == Check.NONFINITE_BEFORE]
        findings = [dataclasses.replace(f, where=self._places[f.rank]) for f in findings]
        return fm.StepCheck(step=step, calls=1 if any(self._per_shard) else 0, findings=tuple(findings))


def own_verdict(
    rank: int, mesh: ShardMesh, total: np.ndarray, own_nan: int, reduced: list | None, dtype: str, k: int, scale: float
) -> list[Finding]:
    """Rank ``rank``'s findings: NaN/Inf in its local gradient; else, when every rank's was finite
    (``total``: every rank's per-shard terms summed, ``fsdp_monitor._terms``), NaN/Inf in its
    reduced shard, or that shard against ``scale`` times the sum of every rank's rows of it."""
    if own_nan:
        return [
            Finding(
                check=Check.NONFINITE_BEFORE,
                rank=rank,
                detail=f"{own_nan} NaN/Inf in its local gradient before the reduce-scatter",
            )
        ]
    if reduced is None or total[:, k + 2].sum():
        return []
    sketch, norm, nonfinite = np.asarray(reduced[:k]), float(reduced[k]), int(reduced[k + 1])
    if nonfinite:
        return [
            Finding(
                check=Check.NONFINITE_AFTER,
                rank=rank,
                detail=f"{nonfinite} NaN/Inf in its reduced shard, from finite inputs",
            )
        ]
    problem = fm.sum_check(total[mesh.shard_of(rank)], mesh.world_size, scale, sketch, norm, dtype, k)
    if problem:
        return [
            Finding(check=Check.REDUCE_SCATTER, rank=rank, detail=f"its reduced shard {problem} (W={mesh.world_size})")
        ]
    return []
