"""Issue 36: when the exact tensor-parallel replay runs (``replay/tp_exact.wanted``) and what it
refuses in one line (``replay/tp_exact.refusal``), on a trace's manifest alone: no processes."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from sdc_forensics.demo.tp import TpRecipe
from sdc_forensics.replay import tp_exact
from sdc_forensics.trace.mesh import ShardMesh


def _trace(dp: int, reduction: str) -> SimpleNamespace:
    """A TP 2 trace's manifest: a (dp, tp) mesh, rank = dp * 2 + tp (init_device_mesh's order)."""
    mesh = ShardMesh(
        kind="tp",
        shape=(dp, 2),
        dim_names=("dp", "tp"),
        shard_dim=0,
        coords=tuple(itertools.product(range(dp), range(2))),
        tp_dim=1,
        tp_shards=(0, -1),
    )
    attempt = SimpleNamespace(determinism={"reduction": reduction})
    return SimpleNamespace(manifest=SimpleNamespace(parallel=mesh, attempts=[attempt]))


class _Clipping(TpRecipe):
    def before_step(self, model, optimizer):
        pass


def test_the_demo_job_and_clipping_replay_exactly_and_an_unknown_order_is_refused_in_one_line():
    # two DP ranks in gloo's own order: a two-term sum, order-free
    assert tp_exact.refusal(_trace(2, "native"), TpRecipe()) == ""
    assert tp_exact.refusal(_trace(4, "ordered"), TpRecipe()) == ""
    native = tp_exact.refusal(_trace(4, "native"), TpRecipe())
    assert "over 4 DP ranks" in native and "reduction='ordered'" in native, native
    # clipping's total norm is reproduced as the job's (dp, tp) shards computed it (replay/clipping.tp_total_norm)
    assert tp_exact.refusal(_trace(2, "ordered"), _Clipping()) == ""
    assert "\n" not in native


def test_without_torchrun_the_tolerant_one_process_replay_is_chosen():
    # no replay process group here: the exact replay needs TP processes
    assert not tp_exact.wanted(_trace(2, "native"), TpRecipe())
