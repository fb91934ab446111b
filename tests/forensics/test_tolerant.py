"""Tolerant replay on real demo runs: graded evidence, weak never a firm verdict, never stopping the search.

``--tolerant`` forces the sketch comparison even where the replay is bitwise (the way a replay on
another device or thread count is compared); the residual of a fault is then its own effect on
the sketch, and the grading decides. An exponent flip is far above anything a clean replay
produces (strong: corruption); a bit-20 flip of one element is ~10x the tolerance, inside the
range clean replays of a conv net reach (weak: inconclusive, and checkpoints after it are not
certified). The conv-net campaign with real thread-count drift is benchmarks/tolerant_campaign.py.
"""

from __future__ import annotations

import pytest

from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.evidence import Strength
from sdc_forensics.replay.options import BisectOptions

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 3


def _bisect(out, **options):
    return bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", **options))


def test_clean_run_replayed_tolerantly_is_inconclusive_and_certifies_nothing_after_its_first_step(demo_run):
    """Nothing stands above tolerance, but a tolerant comparison cannot see a fault below the
    replay's drift: never a false alarm, and never a certificate (issue #8: 0 false-clean)."""
    out = demo_run("none", steps=STEPS, checkpoint_every=EVERY)
    result = _bisect(out, force_tolerant=True, num_threads=2)
    assert result.verdict.value == "inconclusive" and result.first_divergent_step is None and result.suspects == ()
    assert result.replayed.comparison == "tolerant"
    assert [c.status.value for c in result.checkpoints] == ["clean", "unverified", "unverified"]  # 0: no step before it
    assert "within tolerance only" in result.checkpoints[-1].reasons[-1]
    assert any("replay exactly" in line for line in result.settle)


def test_exponent_flip_is_strong_evidence_in_a_tolerant_replay(demo_run):
    out = demo_run("grad:step=4:rank=2:bit=30", steps=STEPS, checkpoint_every=EVERY)
    result = _bisect(out, force_tolerant=True)
    assert (result.verdict.value, result.first_divergent_step) == ("corruption", 4)
    [suspect] = result.suspects
    assert suspect.rank == 2
    assert all(e.strength is Strength.STRONG for e in suspect.evidence)
    statuses = [c.status.value for c in result.checkpoints]
    assert (
        statuses[0] == "clean" and statuses[1] == "unverified" and statuses[2] in ("tainted", "corrupt")
    )  # x2^128 may leave Inf


def test_weak_residual_is_inconclusive_names_its_candidate_and_certifies_nothing_after_it(demo_run):
    out = demo_run("grad:step=4:rank=2:bit=20", steps=STEPS, checkpoint_every=EVERY)
    exact = _bisect(out)
    assert (exact.verdict.value, exact.first_divergent_step, [s.rank for s in exact.suspects]) == ("corruption", 4, [2])
    result = _bisect(out, force_tolerant=True)
    assert result.verdict.value == "inconclusive" and result.first_divergent_step is None and result.suspects == ()
    [weak] = [e for e in result.evidence if e.is_weak]
    assert (weak.step, weak.ranks) == (4, (2,))
    assert "replay exactly" in result.settle[0] and "step 4" in result.settle[0]
    statuses = {c.step: c.status.value for c in result.checkpoints}
    assert statuses == {
        0: "clean",
        3: "unverified",
        6: "unverified",
    }  # compared within tolerance only; weak evidence before 6
    assert any("second replay" in n and "reproduced" in n for n in result.replayed.notes)


def test_weak_evidence_never_stops_the_backwards_search(demo_run):
    """A weak residual in the last interval and a strong fault in the one before: the search goes on
    past the weak one and the strong one is the first divergent step (issue #8, item 2)."""
    out = demo_run(("grad:step=1:rank=3:bit=30", "grad:step=4:rank=2:bit=20"), steps=STEPS, checkpoint_every=EVERY)
    result = _bisect(out, force_tolerant=True)
    assert (result.verdict.value, result.first_divergent_step) == ("corruption", 1)
    assert [s.rank for s in result.suspects] == [3]
    statuses = [c.status.value for c in result.checkpoints]
    assert statuses[0] == "clean" and set(statuses[1:]) <= {"tainted", "corrupt"}


def test_without_the_recorded_bucket_layout_a_clean_run_is_never_corruption(demo_run, tmp_path):
    """The sketch depends on the DDP bucket layout: with the layout file gone, the replay compares
    norms, and such a comparison is never more than weak evidence."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(demo_run("none", steps=STEPS, checkpoint_every=EVERY), out)
    for layout in (out / "trace").glob("buckets.attempt-*.json"):
        layout.unlink()
    result = _bisect(out)
    assert result.verdict.value != "corruption" and result.first_divergent_step is None
    assert not {c.status.value for c in result.checkpoints} & {"tainted", "corrupt"}
