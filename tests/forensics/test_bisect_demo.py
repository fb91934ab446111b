"""Must-show: ``bisect`` on real 4-process gloo DDP demo runs names the injected step and rank.

Every injection location of the recorder is covered, with sign, exponent and high-mantissa flips,
at a step in the middle of a checkpoint interval (4, in 3..6) and exactly on a checkpoint step
(3). Not the full cartesian product (each run costs ~10 s on 2 cores): every location gets at
least one run, every bit and both step kinds appear for several locations. Each demo run is made
once per session and shared. The last clean checkpoint is checked against the rule of the design
brief independently of bisect: N <= s*, its weights equal the replicas' majority digest the trace
holds for theta_N, and it has no NaN/Inf.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sdc_forensics.demo.recipe import recipe as demo_recipe
from sdc_forensics.forensics.bisect import BisectOptions, bisect
from sdc_forensics.forensics.evidence import EvidenceKind
from sdc_forensics.forensics.triage import triage_trace
from sdc_forensics.statedict import weights_digest
from sdc_forensics.trace import format as F
from sdc_forensics.trace.checkpoints import hex64
from sdc_forensics.trace.reader import Trace

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3
SIGN, EXPONENT, HIGH_MANTISSA = 31, 30, 22
MID, ON_CHECKPOINT = 4, 3

# (location, step, rank, bit, expected location class)
CASES = [
    ("grad", MID, 2, SIGN, "local_compute"),
    ("grad", ON_CHECKPOINT, 1, EXPONENT, "local_compute"),
    ("allreduce", MID, 1, EXPONENT, "collective"),
    ("allreduce", ON_CHECKPOINT, 2, SIGN, "collective"),
    ("allreduce-all", ON_CHECKPOINT, 0, HIGH_MANTISSA, "collective"),
    ("allreduce-all", MID, 0, EXPONENT, "collective"),
    ("weights", ON_CHECKPOINT, 0, SIGN, "local_compute"),
    ("weights", MID, 3, HIGH_MANTISSA, "local_compute"),
    ("update", MID, 2, HIGH_MANTISSA, "optimizer_update"),
    ("update", ON_CHECKPOINT, 3, EXPONENT, "optimizer_update"),
    ("input", MID, 3, EXPONENT, "input_data"),
    ("input", ON_CHECKPOINT, 0, SIGN, "input_data"),
    ("checkpoint-file", ON_CHECKPOINT, 0, EXPONENT, "storage"),
]


def _spec(location: str, step: int, rank: int, bit: int) -> str:
    return f"{location}:step={step}:rank={rank}:bit={bit}"


def _majority_theta(trace: Trace, n: int) -> str | None:
    """The replicas' strict-majority weights digest of theta_n (recorded after step n-1)."""
    window = next(trace.step_windows(1, n - 1, n - 1))
    rec = window.records[0]
    has_w = window.present[0] & ((rec["flags"] & int(F.Flag.HAS_WEIGHTS)) != 0)
    values, counts = np.unique(rec["weights_digest"][has_w], return_counts=True)
    return hex64(int(values[np.argmax(counts)])) if counts.max() * 2 > has_w.sum() else None


def assert_last_clean_obeys_rule(result, out: Path, first: int | None, corrupt_file_step: int | None = None) -> None:
    trace = Trace.open(out / "trace")
    checkpoints = sorted(int(p.stem.split("-")[1]) for p in (out / "checkpoints").glob("step-*.pt"))
    eligible = [n for n in checkpoints if (first is None or n <= first) and n != corrupt_file_step]
    last = result.last_clean_checkpoint
    assert last is not None and last.step == max(eligible)
    for c in result.checkpoints:
        if c.clean:
            assert first is None or c.step <= first
            model, optimizer, scheduler = demo_recipe.build("cpu")
            demo_recipe.load_checkpoint(c.path, model, optimizer, scheduler)
            assert all(torch.isfinite(p).all() for p in model.parameters())
            if c.step > 0:
                assert hex64(weights_digest(model.named_parameters())) == _majority_theta(trace, c.step)
    if corrupt_file_step is not None:
        assert {c.step: c.status for c in result.checkpoints}[corrupt_file_step] == "corrupt"


@pytest.mark.parametrize("location,step,rank,bit,where", CASES, ids=[f"{c[0]}-s{c[1]}-r{c[2]}-b{c[3]}" for c in CASES])
def test_bisect_names_injected_step_and_rank(demo_run, location, step, rank, bit, where):
    out = demo_run(_spec(location, step, rank, bit), steps=STEPS, checkpoint_every=EVERY)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    assert result.verdict.value == "corruption"
    [suspect] = result.suspects
    assert suspect.location.value == where
    if location == "checkpoint-file":
        assert result.first_divergent_step is None  # the training never diverged; the file did
        assert step in suspect.steps and suspect.rank is not None
        assert_last_clean_obeys_rule(result, out, None, corrupt_file_step=step)
        return
    assert result.first_divergent_step == step
    if location == "allreduce-all":
        assert suspect.rank is None
    else:
        assert suspect.rank == rank and suspect.host and suspect.gpu
    assert not suspect.recurring
    assert_last_clean_obeys_rule(result, out, step)
    # with trace evidence, at most one checkpoint interval is replayed per incident
    assert result.replayed.steps_replayed <= EVERY + 1


def test_fault_without_trace_evidence_is_found_by_replay(demo_run):
    """A low (not lowest) mantissa flip of a local gradient: inside the sketch tolerance, no audit."""
    out = demo_run(_spec("grad", 1, 1, 12), steps=STEPS, checkpoint_every=EVERY)
    assert triage_trace(Trace.open(out / "trace")).findings == ()
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    assert (result.verdict.value, result.first_divergent_step) == ("corruption", 1)
    [suspect] = result.suspects
    assert (suspect.rank, suspect.location.value) == (1, "local_compute")
    assert {e.kind for e in suspect.evidence} == {EvidenceKind.REPLAY_MISMATCH}
    assert result.replayed.comparison == "exact"
    # nothing in the trace: the last interval first, then one interval further back, stop at the divergence
    assert [(w.start, w.last) for w in result.replayed.windows] == [(3, 5), (0, 1)]
    assert_last_clean_obeys_rule(result, out, 1)


def test_clean_run_is_clean(demo_run):
    out = demo_run("none", steps=STEPS, checkpoint_every=EVERY)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    assert (result.verdict.value, result.first_divergent_step, result.suspects) == ("clean", None, ())
    assert result.replayed.comparison == "exact" and result.replayed.steps_replayed == STEPS
    assert result.last_clean_checkpoint.step == STEPS
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["verdict"] == "clean" and doc["replayed"]["comparison"] == "exact"


def test_audit_majority_of_three_names_the_rank_from_the_trace_alone(demo_run):
    """The same invisible fault on an audited step: the audit's third vote localises it, no replay."""
    out = demo_run(_spec("grad", MID, 1, 12), steps=STEPS, checkpoint_every=EVERY, audit_every=2)
    result = bisect(out / "trace", BisectOptions(trace_only=True))
    assert (result.verdict.value, result.first_divergent_step, result.mode) == ("corruption", MID, "trace-only")
    [suspect] = result.suspects
    assert (suspect.rank, suspect.location.value) == (1, "local_compute")
    assert [e.kind for e in suspect.evidence] == [EvidenceKind.AUDIT_MISMATCH]
    assert result.replayed.windows == ()
