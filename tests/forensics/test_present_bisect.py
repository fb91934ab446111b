"""Renderers print what a trace says verbatim: a host name or path with rich markup is text, not markup."""

from __future__ import annotations

import io

from rich.console import Console

from sdc_forensics.decide.decision import Examined, decide
from sdc_forensics.evidence import Evidence, EvidenceKind, Location
from sdc_forensics.present.bisect import render_bisect
from sdc_forensics.decide.verdict import BisectResult, ReplaySummary


class _Ident:
    host, gpu = "[/]node[bold", "GPU-[red]x"


def test_markup_in_host_gpu_and_evidence_is_printed_as_text():
    ev = Evidence(
        kind=EvidenceKind.NONFINITE, step=3, ranks=(1,), location=Location.LOCAL_COMPUTE, expected="0", found="[/] 2"
    )
    decided = decide(
        [ev],
        world_size=4,
        identity=lambda r: _Ident(),
        notes=(),
        files={},
        majority={},
        examined=Examined(trace_only=True),
    )
    result = BisectResult(
        verdict=decided.verdict,
        first_divergent_step=decided.first_divergent_step,
        suspects=decided.suspects,
        last_clean_checkpoint=None,
        checkpoints=(),
        replayed=ReplaySummary(),
        evidence=decided.evidence,
        mode="trace-only",
        scope="trace checks over [/]steps",
        settle=("[/]",),
    )
    out = io.StringIO()
    render_bisect(result, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "[/]node[bold" in text and "GPU-[red]x" in text and "[/] 2" in text and "over [/]steps" in text
