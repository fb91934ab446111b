"""The bisect JSON document is built in present/, from the result's fields, written out here by hand."""

from __future__ import annotations

from sdc_forensics.decide.verdict import BisectResult, ReplayedWindow, ReplaySummary, Verdict
from sdc_forensics.present.bisect import bisect_document


def test_the_result_is_data_and_present_builds_its_document():
    assert not any(hasattr(cls, "to_json") for cls in (BisectResult, ReplaySummary, ReplayedWindow))
    window = ReplayedWindow(
        start=4, stop=7, last=6, comparison="tolerant", tolerant_from=5, reason="confirm", max_residual_ratio=0.5
    )
    result = BisectResult(
        verdict=Verdict.INCONCLUSIVE,
        first_divergent_step=None,
        suspects=(),
        last_clean_checkpoint=None,
        checkpoints=(),
        evidence=(),
        mode="replay",
        scope="steps 4..6",
        settle=("replay 6",),
        replayed=ReplaySummary(windows=(window,), device="cpu", settings={"threads": 1}, notes=("n",)),
        trace_path="/t",
        world_size=4,
        step_range=(0, 9),
        damage=("d",),
        notes=("m",),
        divergence_window=(5, 6),
    )
    assert bisect_document(result) == {
        "verdict": "inconclusive",
        "exit_code": 4,
        "first_divergent_step": None,
        "divergence_window": [5, 6],
        "suspects": [],
        "last_clean_checkpoint": None,
        "checkpoints": [],
        "evidence": [],
        "hints": [],
        "mode": "replay",
        "scope": "steps 4..6",
        "settle": ["replay 6"],
        "notes": ["m"],
        "preflight": None,
        "replayed": {
            "windows": [
                {
                    "from": 4,
                    "to": 7,
                    "last_replayed": 6,
                    "comparison": "tolerant",
                    "tolerant_from": 5,
                    "reason": "confirm",
                    "max_residual_ratio": 0.5,
                }
            ],
            "device": "cpu",
            "comparison": "tolerant",
            "steps_replayed": 3,
            "reduction_order": None,
            "settings": {"threads": 1},
            "notes": ["n"],
        },
        "trace": {"path": "/t", "world_size": 4, "steps": [0, 9], "damage": ["d"]},
    }
