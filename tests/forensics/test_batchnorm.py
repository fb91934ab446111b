"""A BatchNorm job (buffers broadcast by DDP from rank 0) is replayed exactly and certified (issue 21).

``sdc_forensics.demo.batchnorm:recipe``: the conv net with ``BatchNorm2d``, trained by 4 gloo ranks
with DDP's defaults (``broadcast_buffers=True``). The running statistics are in the state and the
checkpoints; the replay reproduces them by modelling DDP's broadcast (``replay/buffers.py``),
which the test checks against the digests the recorder noted for every saved tensor at save time,
and, with the broadcast left out, sees fail. Faults at every location are found at their exact step
and rank (heavy: a demo run each).
"""

from __future__ import annotations

import pytest

from sdc_forensics.exitcodes import ExitCode
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.forensics.certify import certify
from sdc_forensics.replay.buffers import BufferBroadcast
from sdc_forensics.replay.options import AnalysisOptions
from sdc_forensics.inject import parse_spec

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3
RECIPE = "sdc_forensics.demo.batchnorm:recipe"
SAME = "the replayed module buffers (e.g. BatchNorm running statistics) equal the saved ones bit for bit"


def _run(demo_run, injections=()):
    return demo_run(injections, steps=STEPS, checkpoint_every=EVERY, recipe=RECIPE)


def _options(out):
    return AnalysisOptions(checkpoints_dir=out / "checkpoints")


def test_a_clean_batchnorm_run_is_certified_with_its_buffers_replayed_bit_for_bit(demo_run):
    out = _run(demo_run)
    cert = certify(out / "trace", _options(out))
    assert cert.exit_code == ExitCode.CLEAN and cert.analysis.verdict.value == "clean"
    assert cert.analysis.replayed.comparison == "exact"
    assert {c.step: c.status.value for c in cert.checkpoints} == {0: "clean", 3: "clean", 6: "clean"}
    notes = cert.analysis.replayed.notes
    assert sorted(n for n in notes if SAME in n) == [f"checkpoint {n}: {SAME} (9 tensors)" for n in (3, 6)]


def test_without_the_broadcast_the_replayed_buffers_are_not_the_saved_ones(demo_run, monkeypatch):
    """Every rank's microbatches through one model's buffers, as the replay did before: the gradients
    stay exact (training-mode BatchNorm normalises with the batch's statistics), the buffers do not,
    and since the job recorded broadcast_buffers, an exact replay's buffers that differ are evidence; no
    checkpoint's buffers reproduced, so weak (the replay, not the job, is wrong here): inconclusive."""
    out = _run(demo_run)
    for method in ("before_rank", "after_rank", "end_step"):
        monkeypatch.setattr(BufferBroadcast, method, lambda self, *args: None)
    result = bisect(out / "trace", _options(out))
    assert result.replayed.comparison == "exact" and result.verdict.value == "inconclusive"
    buffers = [e for e in result.evidence if "module buffers" in e.detail]
    assert buffers and all(e.location.value == "state_at_rest" and e.strength.value == "weak" for e in buffers)
    assert not any(SAME in n for n in result.replayed.notes)


# every location of sdc_forensics.inject, mid-interval and on a checkpoint step, several bit classes
FAULTS = [
    "grad:step=4:rank=2:bit=30",
    "allreduce:step=3:rank=1:bit=31",
    "allreduce-all:step=4:rank=0:bit=22",
    "weights:step=3:rank=3:bit=22",
    "update:step=4:rank=0:bit=30",
    "input:step=4:rank=1:bit=30",
    "checkpoint-file:step=3:rank=0:bit=30",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_faults_at_every_location_are_found_at_their_exact_step_and_rank(demo_run, fault):
    spec = parse_spec(fault)
    out = _run(demo_run, fault)
    result = bisect(out / "trace", _options(out))
    assert result.verdict.value == "corruption", result.settle
    statuses = {c.step: c.status.value for c in result.checkpoints}
    [suspect] = result.suspects
    if spec.location == "checkpoint-file":
        assert result.first_divergent_step is None and statuses[spec.step] == "corrupt"
        assert all(s == "clean" for n, s in statuses.items() if n != spec.step)
        return
    assert result.first_divergent_step == spec.step and result.replayed.comparison == "exact"
    assert suspect.rank == (None if spec.location == "allreduce-all" else spec.rank)
    assert all(s == "clean" for n, s in statuses.items() if n <= spec.step)
    assert all(s in ("tainted", "corrupt") for n, s in statuses.items() if n > spec.step)


class _FlipsRankZerosBuffer:
    """The batchnorm job whose rank 0 running mean has a bit flipped in memory in step 4 (after its
    backward): DDP broadcasts it to every rank from step 5 on, and checkpoint 6 saves it; training's
    weights and gradients never use it (training-mode BatchNorm normalises with the batch's own)."""

    def __new__(cls):
        from sdc_forensics.demo.batchnorm import BatchNormRecipe

        class Flips(BatchNormRecipe):
            def before_step(self, model, optimizer, step):
                import torch
                import torch.distributed as dist

                if step == 4 and dist.is_initialized() and dist.get_rank() == 0:
                    buf = next(b for n, b in model.named_buffers() if n.endswith("running_mean"))
                    with torch.no_grad():
                        buf.view(torch.int32)[0] ^= 1 << 29
                return super().before_step(model, optimizer)

        return Flips()


flips = _FlipsRankZerosBuffer()


def test_a_buffer_changed_in_memory_is_evidence_not_a_note_and_its_checkpoint_is_not_certified(demo_run):
    """A trial user's conv net: rank 0's running mean flipped in memory was certified clean at every
    checkpoint, with a note that the buffers differ. DDP broadcasts rank 0's buffers (recorded as
    broadcast_buffers), so an exact replay's must equal what the checkpoint saved: the difference is
    corruption of rank 0's state, bounded by the interval (buffers are digested only at checkpoints)."""
    out = demo_run((), steps=STEPS, checkpoint_every=EVERY, recipe="tests.forensics.test_batchnorm:flips")
    result = bisect(out / "trace", AnalysisOptions(checkpoints_dir=out / "checkpoints", recipe=RECIPE))
    assert result.verdict.value == "corruption", result.settle
    [suspect] = result.suspects
    assert (suspect.rank, suspect.location.value) == (0, "state_at_rest")
    assert result.divergence_window == (3, 5) and result.first_divergent_step == 3
    assert {c.step: c.status.value for c in result.checkpoints} == {0: "clean", 3: "clean", 6: "tainted"}


class _BumpsABufferEveryStep:
    """The batchnorm job whose loop also moves a buffer itself every step (a counter, an EMA), which
    the replay recipe leaves out: every checkpoint's buffers differ from the replay's."""

    def __new__(cls):
        from sdc_forensics.demo.batchnorm import BatchNormRecipe

        class Bumps(BatchNormRecipe):
            def before_step(self, model, optimizer):
                import torch

                buf = next(b for n, b in model.named_buffers() if n.endswith("running_mean"))
                with torch.no_grad():
                    buf[0] += 1.0
                return super().before_step(model, optimizer)

        return Bumps()


bumps = _BumpsABufferEveryStep()


def test_buffers_no_checkpoint_reproduces_are_not_called_corruption_and_certify_nothing(demo_run):
    """Every checkpoint's buffers differ: as likely a recipe that does not update them as the job did
    as a fault, so weak evidence (inconclusive, nothing after checkpoint 0 certified), no suspect."""
    out = demo_run((), steps=STEPS, checkpoint_every=EVERY, recipe="tests.forensics.test_batchnorm:bumps")
    result = bisect(out / "trace", AnalysisOptions(checkpoints_dir=out / "checkpoints", recipe=RECIPE))
    assert result.verdict.value == "inconclusive" and result.suspects == (), result.settle
    assert {c.step: c.status.value for c in result.checkpoints} == {0: "clean", 3: "unverified", 6: "unverified"}
    assert any("make the recipe update every buffer the loop updates" in line for line in result.settle), result.settle
