"""An in-process stand-in for a recorded DDP run of the demo recipe (fast tests of replay and bisect).

``simulate(out_dir, steps=10, checkpoint_every=4, world_size=4, fault=None)`` (one fault or a
tuple, at most one per step) keeps one replica per
rank, computes each rank's local gradient on its microbatches, averages them in gloo's ring order,
steps every replica's optimizer and writes the trace the recorder would (STEP records with
fingerprints, bucket layout, checkpoint notes and ``torch.save`` checkpoints of theta_N), with one
bit flipped at a chosen place. The multi-process demo (``sdc_forensics.demo.run``) is the real
thing; this is its single-process twin for unit tests.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from sdc_forensics.demo.recipe import DemoRecipe
from sdc_forensics.fingerprint import constants as C
from sdc_forensics.fingerprint.core import combine, combine_digests, digest, fingerprint
from sdc_forensics.trace.checkpoints import hex64
from sdc_forensics.forensics.replay_env import reduce_buckets
from sdc_forensics.statedict import flatten_state, weights_digest
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import CheckpointNote, write_checkpoint_note
from sdc_forensics.trace.manifest import Attempt, FingerprintSettings, Manifest, RankIdentity, write_manifest
from sdc_forensics.trace.writer import RankTraceWriter

RECIPE_REF = "sdc_forensics.demo.recipe:recipe"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimFault:
    """``where``: grad | allreduce | allreduce-all | weights | update | input. ``bit``: 31 sign, 30..23 exponent."""

    where: str
    step: int
    rank: int = 0
    bit: int = 31
    index: int = 5


def flip(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` of element ``index`` of a float32 tensor, in place."""
    flat = tensor.detach().view(-1)
    view = flat.view(torch.int32)
    view[index] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


def simulate(out_dir: Path, *, steps: int = 10, checkpoint_every: int = 4, world_size: int = 4,
             fault: SimFault | tuple[SimFault, ...] | None = None) -> Path:
    """Write ``out_dir/trace`` and ``out_dir/checkpoints``; returns ``out_dir``."""
    recipe = DemoRecipe()
    trace_dir, ckpt_dir = Path(out_dir) / "trace", Path(out_dir) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    k, seed = C.DEFAULT_SKETCH_K, C.DEFAULT_SEED
    idents = tuple(RankIdentity(rank=r, host=f"sim{r // 2}", node_rank=r // 2, gpu_uuid=f"GPU-sim-{r}") for r in range(world_size))
    trace_dir.mkdir(parents=True, exist_ok=True)
    write_manifest(trace_dir, Manifest(
        format_version=F.FORMAT_VERSION, world_size=world_size, fingerprint=FingerprintSettings(seed=seed, sketch_k=k),
        recipe=RECIPE_REF, checkpoint_every=checkpoint_every, node_of_rank=tuple(r // 2 for r in range(world_size)),
        attempts=(Attempt(attempt=0, start_step=0, ranks=idents, determinism={"num_threads": torch.get_num_threads()}),),
    ))
    model, optimizer, _ = recipe.build("cpu")
    replicas = [(copy.deepcopy(model), None) for _ in range(world_size)]
    replicas = [(m, torch.optim.AdamW(m.parameters(), lr=recipe.lr, weight_decay=0.01)) for m, _ in replicas]
    names = [n for n, _ in model.named_parameters()]
    layout = [list(reversed(range(len(names))))]
    (trace_dir / "buckets.attempt-000.json").write_text(json.dumps({"layouts": [{"from_step": 0, "buckets": layout}]}))
    faults = fault if isinstance(fault, tuple) else (fault,) if fault is not None else ()
    writers = [RankTraceWriter(trace_dir, rank=r, attempt=0, world_size=world_size, sketch_k=k, seed=seed) for r in range(world_size)]
    for step in range(steps):
        fault = next((f for f in faults if f.step == step), None)  # at most one per step
        hit = fault is not None
        if step % checkpoint_every == 0:
            _checkpoint(recipe, replicas, step, trace_dir, ckpt_dir, names, seed)
        if hit and fault.where == "weights":
            flip(next(replicas[fault.rank][0].parameters()), fault.index, fault.bit)
        local, local_fps, losses, inputs = [], [], [], []
        for r, (m, _) in enumerate(replicas):
            params = list(m.parameters())
            for p in params:
                p.grad = None
            digests, total = [], 0.0
            for mb_id in recipe.microbatch_ids(step, r, world_size):
                batch = recipe.fetch_microbatch(mb_id)
                if hit and fault.where == "input" and r == fault.rank:
                    flip(batch[0], fault.index, fault.bit)
                digests += [digest(t, seed) for t in flatten_state(batch).values()]
                loss = recipe.loss(m, batch)
                loss.backward()
                total += float(loss.detach())
            flat = torch.cat([params[i].grad.reshape(-1) for i in layout[0]])
            if hit and fault.where == "grad" and r == fault.rank:
                flip(flat, fault.index, fault.bit)
            local.append([flat])
            local_fps.append(combine([fingerprint(flat, k=k, seed=seed)]))
            losses.append(total)
            inputs.append(combine_digests(digests))
        reduced = [reduce_buckets(local, "gloo-ring")[0].clone() for _ in range(world_size)]
        if hit and fault.where == "allreduce":
            flip(reduced[fault.rank], fault.index, fault.bit)
        if hit and fault.where == "allreduce-all":
            for red in reduced:
                flip(red, fault.index, fault.bit)
        reduced_fps = [combine([fingerprint(red, k=k, seed=seed)]) for red in reduced]
        weights = []
        for r, (m, opt) in enumerate(replicas):
            params, offset = list(m.parameters()), 0
            for i in layout[0]:
                n = params[i].numel()
                params[i].grad = reduced[r][offset : offset + n].view_as(params[i]).clone()
                offset += n
            opt.step()
            if hit and fault.where == "update" and r == fault.rank:
                flip(params[0].data, fault.index, fault.bit)
            weights.append(weights_digest(m.named_parameters(), seed))
        for r, writer in enumerate(writers):
            rec = writer.new(F.Kind.STEP, step)
            rec["flags"] = int(F.Flag.CONTIGUOUS_IDS | F.Flag.HAS_GRADS | F.Flag.HAS_WEIGHTS | F.Flag.WEIGHTS_CHECKED)
            rec["loss"] = losses[r]
            rec["input_digest"] = inputs[r]
            ids = recipe.microbatch_ids(step, r, world_size)
            rec["microbatch_first"], rec["microbatch_count"] = ids[0], len(ids)
            rec["microbatch_digest"] = combine_digests(ids)
            for prefix, fp in (("local", local_fps[r]), ("reduced", reduced_fps[r])):
                rec[f"{prefix}_digest"] = fp.digest
                rec[f"{prefix}_norm"] = fp.norm
                rec[f"{prefix}_max_abs"] = fp.max_abs
                rec[f"{prefix}_sketch"] = fp.sketch
            rec["nonfinite_local"], rec["nonfinite_reduced"] = local_fps[r].nonfinite, reduced_fps[r].nonfinite
            rec["weights_digest"] = weights[r]
            writer.append(rec)
    if steps % checkpoint_every == 0:
        _checkpoint(recipe, replicas, steps, trace_dir, ckpt_dir, names, seed)
    for writer in writers:
        writer.close()
    return Path(out_dir)


def _checkpoint(recipe, replicas, step, trace_dir, ckpt_dir, names, seed) -> None:
    digests = [weights_digest(m.named_parameters(), seed) for m, _ in replicas]
    values, counts = np.unique(np.array(digests, dtype=np.uint64), return_counts=True)
    majority = int(values[np.argmax(counts)])
    saver = digests.index(majority)
    path = ckpt_dir / f"step-{step:08d}.pt"
    model, opt = replicas[saver]
    recipe.save_checkpoint(path, model, opt, None, step)
    write_checkpoint_note(trace_dir, CheckpointNote(
        step=step, path=str(path), weights_digest=hex64(majority), param_names=tuple(names), saved_by_rank=saver,
        agreeing_ranks=tuple(r for r, d in enumerate(digests) if d == majority),
        diverged_ranks=tuple(r for r, d in enumerate(digests) if d != majority),
    ))
