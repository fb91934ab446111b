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
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.demo.recipe import recipe as demo_recipe
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.evidence import EvidenceKind
from sdc_forensics.replay.options import BisectOptions
from sdc_forensics.triage.trace_only import triage_trace
from sdc_forensics.present.bisect import bisect_document
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
    ("weights", ON_CHECKPOINT, 0, SIGN, "state_at_rest"),
    ("weights", MID, 3, HIGH_MANTISSA, "state_at_rest"),
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
        assert {c.step: c.status.value for c in result.checkpoints}[corrupt_file_step] == "corrupt"


def _headline(result) -> str:
    import io

    from rich.console import Console

    from sdc_forensics.present.bisect import render_bisect

    out = io.StringIO()
    render_bisect(result, Console(file=out, width=400, color_system=None))
    return out.getvalue().splitlines()[0]


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
    # θ_step as computed and saved is clean; a copy changed at rest is said to be one rank's
    headline = _headline(result)
    assert f"first divergent step {step} (θ_{step} clean" in headline
    assert ("copy of it changed in memory" in headline) == (where == "state_at_rest"), headline
    if where == "optimizer_update":
        # a weight changed at rest below the forward's precision (bfloat16 autocast) leaves the same evidence
        replayed = [e for e in suspect.evidence if e.source == "replay"]
        assert replayed and all("or its weights changed in memory before the update" in e.detail for e in replayed)
    assert_last_clean_obeys_rule(result, out, step)
    # every step up to the divergence is replayed (to certify the checkpoints before it), none after
    assert result.replayed.steps_replayed == step + 1
    assert_commands_agree(out)


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
    assert sorted((w.start, w.last) for w in result.replayed.windows) == [(0, 1), (3, 5)]
    assert_last_clean_obeys_rule(result, out, 1)


def test_clean_run_is_clean(demo_run):
    out = demo_run("none", steps=STEPS, checkpoint_every=EVERY)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    assert (result.verdict.value, result.first_divergent_step, result.suspects) == ("clean", None, ())
    assert result.replayed.comparison == "exact" and result.replayed.steps_replayed == STEPS
    assert result.last_clean_checkpoint.step == STEPS
    doc = json.loads(json.dumps(bisect_document(result)))
    assert doc["verdict"] == "clean" and doc["replayed"]["comparison"] == "exact"
    assert_commands_agree(out)


def test_audit_majority_of_three_names_the_rank_from_the_trace_alone(demo_run):
    """The same invisible fault on an audited step: the audit's third vote localises it, no replay."""
    out = demo_run(_spec("grad", MID, 1, 12), steps=STEPS, checkpoint_every=EVERY, audit_every=2)
    result = bisect(out / "trace", BisectOptions(trace_only=True))
    assert (result.verdict.value, result.first_divergent_step, result.mode) == ("corruption", MID, "trace-only")
    [suspect] = result.suspects
    assert (suspect.rank, suspect.location.value) == (1, "local_compute")
    assert [e.kind for e in suspect.evidence] == [EvidenceKind.AUDIT_MISMATCH]
    assert result.replayed.windows == ()
    assert_commands_agree(out)


def _cli(*args) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code in (0, 1, 4), result.output
    return result.exit_code, json.loads(result.stdout)


def assert_commands_agree(out: Path, modes=((), ("--trace-only",))) -> None:
    """bisect, certify, verify-checkpoint --trace (each checkpoint) and report give one answer:
    the same first divergent step, suspects and status of every checkpoint, in replay and
    trace-only modes (the design brief's "One decision"); ``modes`` can add a tolerant replay
    (``("--threads", "2")``)."""
    trace, ckpts = out / "trace", out / "checkpoints"
    for mode in modes:
        code, doc = _cli("bisect", trace, "--checkpoints", ckpts, "--json", *mode)
        statuses = {c["step"]: c["status"] for c in doc["checkpoints"]}
        suspects = [s["rank"] for s in doc["suspects"]]
        _, cert = _cli("certify", trace, "--checkpoints", ckpts, "--json", *mode)
        assert cert["first_divergent_step"] == doc["first_divergent_step"] and cert["verdict"] == doc["verdict"]
        assert {c["step"]: c["status"] for c in cert["checkpoints"]} == statuses
        report = out / f"review{len(mode)}.md"
        report.unlink(missing_ok=True)
        rcode, rdoc = _cli("report", trace, "--checkpoints", ckpts, "--json", "-o", report, *mode)
        assert (rcode, rdoc["first_divergent_step"], [s["rank"] for s in rdoc["suspects"]]) == (
            code,
            doc["first_divergent_step"],
            suspects,
        )
        assert {c["step"]: c["status"] for c in rdoc["checkpoints"]} == statuses
        for step, status in statuses.items():
            vcode, vdoc = _cli("verify-checkpoint", ckpts / f"step-{step:08d}.pt", "--trace", trace, "--json", *mode)
            assert vdoc["certification"]["status"] == status, (step, vdoc["reasons"])
            assert vdoc["first_divergent_step"] == doc["first_divergent_step"]
            assert vcode == {"clean": 0, "unverified": 4}.get(status, 1)
        if "--trace-only" in mode:  # the trace alone never certifies a file it did not read
            assert all(s != "clean" for s in statuses.values())


def test_verify_checkpoint_with_trace_never_certifies_a_checkpoint_after_an_invisible_fault(demo_run):
    """A bit-20 flip of one local-gradient element: invisible to the trace. verify-checkpoint
    --trace used to print VERIFIED for the checkpoint after it (exit 0) while bisect found it."""
    out = demo_run(_spec("grad", MID, 0, 20), steps=STEPS, checkpoint_every=EVERY)
    later = CliRunner().invoke(
        cli, ["verify-checkpoint", str(out / "checkpoints" / f"step-{STEPS:08d}.pt"), "--trace", str(out / "trace")]
    )
    assert later.exit_code == 1 and "tainted" in later.output and "VERIFIED" not in later.output
    trace_only = CliRunner().invoke(
        cli,
        [
            "verify-checkpoint",
            str(out / "checkpoints" / f"step-{STEPS:08d}.pt"),
            "--trace",
            str(out / "trace"),
            "--trace-only",
        ],
    )
    assert trace_only.exit_code == 4 and "NOT CERTIFIED" in trace_only.output


@pytest.mark.parametrize(
    "spec", ["weights:step=4:rank=3:bit=27", "update:step=2:rank=1:bit=22", "allreduce:step=1:rank=3:bit=30"]
)
def test_one_fault_that_leaves_a_replica_different_is_one_event_not_recurring(demo_run, spec):
    out = demo_run(spec, steps=STEPS, checkpoint_every=EVERY, audit_every=1)
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", scan_recurrence=True))
    [suspect] = result.suspects
    assert not suspect.recurring, suspect.steps
    assert "one event" in suspect.recommendation and "drain" not in suspect.recommendation


def test_two_checkpoint_files_damaged_at_rest_point_at_storage_not_the_gpu(demo_run, tmp_path):
    out = demo_run("none", steps=STEPS, checkpoint_every=EVERY)
    ckpts = tmp_path / "copies"
    shutil.copytree(out / "checkpoints", ckpts)
    for step in (3, 6):
        path = ckpts / f"step-{step:08d}.pt"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=ckpts))
    assert result.verdict.value == "corruption" and result.first_divergent_step is None
    [suspect] = result.suspects
    assert suspect.location.value == "storage" and not suspect.recurring and suspect.gpu is None
    assert (
        "disk" in suspect.recommendation and "GPU" in suspect.recommendation and "drain" not in suspect.recommendation
    )
