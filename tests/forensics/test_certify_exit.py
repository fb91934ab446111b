"""certify's exit rule (forensics/certify.certify_exit): it answers "is there a checkpoint to resume from?",
and exits 0 only when the analysis reached a verdict (issue 33: an inconclusive analysis is 4)."""

from __future__ import annotations

import pytest

from sdc_forensics.forensics.certify import certify_exit
from sdc_forensics.decide.decision import CheckpointStatus, Status, Verdict


def _statuses(*values: str) -> list[CheckpointStatus]:
    return [
        CheckpointStatus(step=10 * i, path=f"step-{10 * i}.pt", status=Status(v), reasons=("…",))
        for i, v in enumerate(values)
    ]


@pytest.mark.parametrize(
    "statuses, verdict, code",
    [
        (("clean", "tainted", "tainted"), Verdict.CORRUPTION, 0),  # resume from 0; later ones listed, not a failure
        (("clean", "corrupt", "clean"), Verdict.CORRUPTION, 0),  # a damaged file, but a clean checkpoint to resume from
        (
            ("clean", "unverified"),
            Verdict.INCONCLUSIVE,
            4,
        ),  # no verdict: no resume point named, even with checkpoint 0 clean
        (("clean", "clean", "unverified"), Verdict.INCONCLUSIVE, 4),
        (("clean", "tainted"), Verdict.INCONCLUSIVE, 4),  # a divergence nobody could be blamed for: still no verdict
        (("clean", "clean"), Verdict.CLEAN, 0),
        (("unverified", "tainted"), Verdict.CORRUPTION, 1),  # nothing clean, something tainted
        (("corrupt", "unverified"), Verdict.CLEAN, 1),  # nothing clean, a corrupt file
        (("unverified", "unverified"), Verdict.CORRUPTION, 1),  # nothing clean, corruption found
        (("unverified", "unverified"), Verdict.INCONCLUSIVE, 4),  # nothing clean, nothing wrong found
        (("unverified",), Verdict.CLEAN, 4),
        ((), Verdict.CORRUPTION, 1),  # no notes, corruption found
        ((), Verdict.CLEAN, 4),  # no notes: nothing to resume from, nothing wrong
        ((), Verdict.INCONCLUSIVE, 4),
    ],
)
def test_certify_exit(statuses, verdict, code):
    assert certify_exit(_statuses(*statuses), verdict) == code
