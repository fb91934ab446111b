"""Replay on single-process twins of demo runs (fixture ``sim``, ``tests.factories.simulate``): exactness,
tolerance, tie-breaks, devices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sdc_forensics.demo.recipe import DemoRecipe
from sdc_forensics.errors import UsageError
from sdc_forensics.replay import env as env
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.evidence import EvidenceKind, Location
from sdc_forensics.replay.options import BisectOptions
from sdc_forensics.replay.replayer import ReplayOptions, StartStateMismatch
from sdc_forensics.replay.window import replay_window
from sdc_forensics.triage.trace_only import triage_trace
from sdc_forensics.recipe import load_recipe
from sdc_forensics.trace.checkpoints import read_checkpoint_notes
from sdc_forensics.trace.reader import Trace
from tests.factories import SimFault, ddp_mean


def _replay(out, start, stop, recipe=None, **kw):
    trace = Trace.open(out / "trace")
    note = {n.step: n for n in read_checkpoint_notes(trace.path)}[start]
    options = ReplayOptions(
        start_step=start,
        stop_step=stop,
        checkpoint_path=out / f"checkpoints/step-{start:08d}.pt",
        expected_weights_digest=note.weights_digest,
        **kw,
    )
    return replay_window(trace, recipe or load_recipe(trace.manifest.recipe), options)


def test_clean_window_is_bitwise_exact(sim):
    result = _replay(sim(), 0, 7)
    assert (result.comparison, result.first_divergent_step, result.evidence) == ("exact", None, ())
    assert result.reduction_order == "gloo-ring" and result.last_step == 7
    assert result.settings["deterministic_algorithms"] and result.settings["tf32"] is False


@pytest.mark.parametrize(
    "where,location",
    [
        ("grad", Location.LOCAL_COMPUTE),
        ("allreduce", Location.COLLECTIVE),
        ("update", Location.OPTIMIZER_UPDATE),
        ("input", Location.INPUT_DATA),
    ],
)
def test_replay_localises_a_low_mantissa_flip(sim, where, location):
    out = sim(SimFault(where=where, step=5, rank=2, bit=10))
    result = _replay(out, 4, 7)
    assert result.first_divergent_step == 5 and result.last_step == 5  # stops at the divergence
    assert {e.location for e in result.evidence if e.ranks == (2,)} >= {location}
    assert all(e.ranks == (2,) for e in result.evidence)


@dataclasses.dataclass(kw_only=True)
class _NoisyKernel(DemoRecipe):
    """Another 'device': every loss off by a relative 2**-22, as a different kernel would be."""

    def loss(self, model, microbatch):
        return super().loss(model, microbatch) * (1.0 + 2.0**-22)


def test_other_kernel_switches_to_tolerant_and_still_finds_a_large_fault(sim):
    clean = _replay(sim(), 4, 7, recipe=_NoisyKernel())
    assert (clean.comparison, clean.tolerant_from, clean.first_divergent_step) == ("tolerant", 4, None)
    faulty = _replay(sim(SimFault(where="grad", step=6, rank=1, bit=30)), 4, 7, recipe=_NoisyKernel())
    assert faulty.comparison == "tolerant" and faulty.first_divergent_step == 6
    assert [e.ranks for e in faulty.evidence if e.kind is EvidenceKind.REPLAY_MISMATCH] == [(1,)]


@dataclasses.dataclass(kw_only=True)
class _FlakyOnce(DemoRecipe):
    """A replay device that gets one microbatch wrong, once."""

    bad_id: int = -1
    fired: bool = False

    def loss(self, model, microbatch):
        value = super().loss(model, microbatch)
        if not self.fired and int(microbatch[1][0]) >= 0 and getattr(self, "_current", None) == self.bad_id:
            self.fired = True
            return value * 1.5
        return value

    def fetch_microbatch(self, microbatch_id, device="cpu"):
        self._current = int(microbatch_id)
        return super().fetch_microbatch(microbatch_id, device)


def test_second_replay_breaks_the_tie_against_a_flaky_replay_device(sim):
    flaky = _FlakyOnce(bad_id=DemoRecipe().microbatch_ids(5, 3, 4)[0])
    result = _replay(sim(), 4, 7, recipe=flaky)
    assert flaky.fired
    assert result.first_divergent_step is None and result.comparison == "exact"
    assert any("second replay agrees with the record" in n for n in result.notes)


def test_checkpoint_not_holding_the_majority_is_refused(sim, tmp_path):
    out = sim()
    trace = Trace.open(out / "trace")
    with pytest.raises(StartStateMismatch):
        replay_window(
            trace,
            load_recipe(trace.manifest.recipe),
            ReplayOptions(
                start_step=4,
                stop_step=5,
                checkpoint_path=out / "checkpoints/step-00000000.pt",
                expected_weights_digest=read_checkpoint_notes(trace.path)[1].weights_digest,
            ),
        )


def test_suspect_gpu_is_refused_unless_forced(monkeypatch):
    monkeypatch.setattr(env, "gpu_uuid", lambda device: "GPU-bad")
    with pytest.raises(UsageError, match="suspect rank 3"):
        env.check_not_suspect(torch.device("cpu"), {"GPU-bad": 3}, force=False)
    env.check_not_suspect(torch.device("cpu"), {"GPU-bad": 3}, force=True)
    env.check_not_suspect(torch.device("cpu"), {"GPU-other": 3}, force=False)


def test_deterministic_settings_are_restored():
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    with env.deterministic(torch.device("cpu"), 1) as applied:
        assert torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == 1
    assert applied["num_threads"] == 1
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == before


def test_ring_reduction_segments():
    ranks = [[torch.randn(1001, generator=torch.Generator().manual_seed(r))] for r in range(3)]
    ring = env.reduce_buckets(ranks, "gloo-ring")[0]
    seq = env.reduce_buckets(ranks, "sequential")[0]
    assert torch.allclose(ring, seq, rtol=1e-6, atol=1e-7)
    # gloo: S = 6 segments of ceil(1001 / 6) = 167 elements, 2 per rank: chunk 0 is elements 0..333,
    # summed from rank 2 backwards: ((g2 + g1) + g0), each scaled by 1/3 first, as DDP does
    parts = [r[0] * (1.0 / 3) for r in ranks]
    assert torch.equal(ring[:334], (parts[2][:334] + parts[1][:334]) + parts[0][:334])
    assert torch.equal(ring[334:668], (parts[0][334:668] + parts[2][334:668]) + parts[1][334:668])


def _ring_vs_gloo_reference(world_size: int, numel: int) -> bool:
    """``reduce_buckets(..., "gloo-ring")`` bit for bit against ``tests.factories.ddp_mean``, a
    reference checked against DDP's scaling and a real gloo all_reduce (tests/test_factories.py)."""
    gen = torch.Generator().manual_seed(world_size * 1_000_003 + numel)
    ranks = [
        [torch.randn(numel, generator=gen) * 2.0 ** torch.randint(-6, 7, (numel,), generator=gen)]
        for _ in range(world_size)
    ]
    ring = env.reduce_buckets(ranks, "gloo-ring")[0]
    expected = ddp_mean([r[0].numpy() for r in ranks])
    return torch.equal(ring.view(torch.int32), torch.from_numpy(expected).view(torch.int32))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_reduction_is_gloos_on_the_demo_gradient(world_size):
    """The size the sim and demo runs reduce (one bucket of the demo MLP's 26 122 gradients)."""
    assert _ring_vs_gloo_reference(world_size, 26_122)


@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_reduction_is_gloos_at_every_size(world_size):
    assert all(_ring_vs_gloo_reference(world_size, n) for n in (1, 3, 5, 6, 14, 17, 1001, 4096, 2_500_001))


def test_bisect_skips_a_damaged_checkpoint_file(sim, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(sim(SimFault(where="grad", step=6, rank=1, bit=30)), out)
    path = out / "checkpoints/step-00000004.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    assert result.first_divergent_step == 6 and [s.rank for s in result.suspects] == [1]
    statuses = {c.step: c.status for c in result.checkpoints}
    assert statuses[4] == "corrupt" and result.last_clean_checkpoint.step == 0
    assert result.replayed.windows[0].start == 0  # never replayed from the damaged file
    assert any(e.kind is EvidenceKind.CHECKPOINT_MISMATCH and e.step == 4 for e in result.evidence)


def test_collective_fault_below_the_sketch_tolerance_is_found_once_the_order_is_known(sim):
    """allreduce-all with a low mantissa flip: the trace's sketch check cannot see it; the replay,
    which learned gloo's summation order on the later interval, sees the bits change."""
    out = sim(SimFault(where="allreduce-all", step=5, bit=9))
    assert triage_trace(Trace.open(out / "trace")).findings == ()
    result = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    assert (result.verdict.value, result.first_divergent_step) == ("corruption", 5)
    [suspect] = result.suspects
    assert (suspect.rank, suspect.location) == (None, Location.COLLECTIVE)
    assert result.replayed.comparison == "exact"


def test_scan_finds_the_earlier_incident_and_the_recurrence(sim):
    out = sim((SimFault(where="grad", step=2, rank=3, bit=11), SimFault(where="grad", step=6, rank=3, bit=11)))
    once = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints"))
    # widening backwards goes on past the latest interval's divergence (every step before a
    # checkpoint is examined before it is certified): the earlier incident is the first one, and
    # the two independent events on rank 3 make it recurring
    assert once.first_divergent_step == 2 and [(s.steps, s.recurring) for s in once.suspects] == [((2, 6), True)]
    assert sorted((w.start, w.last) for w in once.replayed.windows) == [(0, 2), (4, 6)]
    scanned = bisect(out / "trace", BisectOptions(checkpoints_dir=out / "checkpoints", scan_recurrence=True))
    [suspect] = scanned.suspects
    assert (scanned.first_divergent_step, suspect.rank, suspect.steps, suspect.recurring) == (2, 3, (2, 6), True)
    assert "drain" in suspect.recommendation


def test_other_kernel_with_a_fault_at_the_first_step_blames_only_the_faulty_rank(sim):
    faulty = _replay(sim(SimFault(where="grad", step=4, rank=2, bit=30)), 4, 7, recipe=_NoisyKernel())
    assert (faulty.comparison, faulty.tolerant_from, faulty.first_divergent_step) == ("tolerant", 4, 4)
    assert [e.ranks for e in faulty.evidence] == [(2,)]


@dataclasses.dataclass(kw_only=True)
class _CountingLoads(DemoRecipe):
    """The demo recipe, counting the checkpoints it was handed to ``torch.load``."""

    loads: list = dataclasses.field(default_factory=list)

    def load_checkpoint(self, path, model, optimizer, scheduler):
        self.loads.append(path)
        super().load_checkpoint(path, model, optimizer, scheduler)


@dataclasses.dataclass
class _Pickled:
    """A class outside torch's weights-only allow-list: loading it would run its constructor."""

    note: str = "not loaded"


def _copy_with_checkpoint(out, tmp_path, payload=None):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    if payload is not None:
        path = copy / "checkpoints/step-00000004.pt"
        state = torch.load(path, weights_only=True)
        torch.save({**state, **payload}, path)
    return copy


def test_the_checkpoint_is_read_by_the_package_before_the_recipe_loads_it(sim, tmp_path):
    """The recipe loads the checkpoint with its own ``torch.load``: the replay first opens the file
    with the package's readers (pickle allow-list, structure) and under the read limits, and hands
    the recipe nothing they refuse."""
    from sdc_forensics.checkpoint.limits import ReadLimits, using_limits
    from sdc_forensics.checkpoint.torch_reader import PickleRefused
    from sdc_forensics.errors import CheckpointError

    recipe = _CountingLoads()
    out = _copy_with_checkpoint(sim(), tmp_path, {"extra": _Pickled()})
    with pytest.raises(PickleRefused, match="_Pickled"):
        _replay(out, 4, 5, recipe=recipe)
    assert recipe.loads == []
    clean = sim()
    with using_limits(ReadLimits(max_tensors=1)), pytest.raises(CheckpointError, match="raise --max-tensors"):
        _replay(clean, 4, 5, recipe=recipe)
    assert recipe.loads == []
    assert _replay(clean, 4, 5, recipe=recipe).first_divergent_step is None and len(recipe.loads) == 1


def test_replay_command_refuses_a_hostile_checkpoint_with_exit_3(sim, tmp_path):
    from click.testing import CliRunner

    from sdc_forensics.cli.main import cli
    from tests.factories import tree_sha256

    out = _copy_with_checkpoint(sim(), tmp_path, {"extra": _Pickled()})
    before = tree_sha256(out)
    result = CliRunner().invoke(
        cli, ["replay", str(out / "trace"), "--from", "4", "--to", "5", "--checkpoints", str(out / "checkpoints")]
    )
    assert result.exit_code == 3 and result.stdout == "" and "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "step-00000004.pt" in errors[0] and "_Pickled" in errors[0], result.stderr
    assert tree_sha256(out) == before
