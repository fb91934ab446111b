"""Issue 36: when a pipeline trace is replayed at the job's layout, one stage per process
(``replay/pp_exact.wanted``), on a trace's manifest alone: the process count, the recipe's hooks and
one stage per rank (an interleaved schedule's "loop" placement is replayed otherwise)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sdc_forensics.demo.pp import PpRecipe
from sdc_forensics.replay import distributed, pp_exact

from tests.factories import grid_mesh

# parameters 0-2 on stage 0, 3-5 on stage 1 (one stage per rank); 0, 1, 0, 1 (two per rank: interleaved)
ONE_STAGE, LOOPED = (0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 0, 0, 1, 1)


def _trace(stages: tuple[int, ...], tp: int = 1) -> SimpleNamespace:
    """A PP 2 x DP 2 (x TP) trace's manifest, rank = (pp * 2 + dp) * tp + t."""
    if tp > 1:
        mesh = grid_mesh(
            "pp", ("pp", "dp", "tp"), (2, 2, tp), shard_dim=1, pp_dim=0, tp_dim=2,
            stages=stages, tp_shards=(-1,) * len(stages),
        )  # fmt: skip
    else:
        mesh = grid_mesh("pp", ("pp", "dp"), (2, 2), shard_dim=1, pp_dim=0, stages=stages)
    return SimpleNamespace(manifest=SimpleNamespace(parallel=mesh))


@pytest.fixture
def processes(monkeypatch):
    """A replay group of ``n`` processes as torchrun starts it (none is started)."""

    def launched(n: int) -> None:
        group = distributed.ReplayGroup(rank=0, size=n, backend="gloo", timeout_s=60.0)
        monkeypatch.setattr(distributed, "_group", group)

    return launched


class _NoStages(PpRecipe):
    pipeline_stage = None


def test_one_process_per_stage_is_chosen_with_pp_x_tp_processes_and_the_recipes_hooks(processes):
    assert not pp_exact.wanted(_trace(ONE_STAGE), PpRecipe())  # no torchrun: the whole model on one process
    processes(2)
    assert pp_exact.wanted(_trace(ONE_STAGE), PpRecipe())
    assert not pp_exact.wanted(_trace(ONE_STAGE), _NoStages())  # without the hook: the whole model
    assert not pp_exact.wanted(_trace(ONE_STAGE, tp=2), PpRecipe())  # 3-D with 2: TP's replay
    processes(4)
    assert pp_exact.wanted(_trace(ONE_STAGE, tp=2), PpRecipe())
    assert pp_exact.processes(_trace(ONE_STAGE, tp=2)) == 4


def test_several_stages_per_rank_are_not_replayed_one_stage_per_process(processes):
    processes(2)
    assert pp_exact.one_stage_per_rank(_trace(ONE_STAGE).manifest.parallel)
    assert not pp_exact.one_stage_per_rank(_trace(LOOPED).manifest.parallel)
    assert not pp_exact.wanted(_trace(LOOPED), PpRecipe())
