"""One rule for one question on synthetic traces: every command names the same first divergent step.

Issue #8 item 4: with a weights fault at step 9 and replica weights compared every 4 steps,
``bisect --trace-only`` said 12 while ``certify --trace-only`` and ``verify-checkpoint --trace``
(``triage.first_suspect_step``) said 9. The divergence happened in 9..12; the first step it can
have happened at is the conservative answer for certification, and now every path gives it.
The demo-run agreement over every command and checkpoint is ``test_bisect_demo.assert_commands_agree``.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.decide import decision
from sdc_forensics.triage.trace_only import triage_trace
from sdc_forensics.trace.reader import Trace
from tests.factories import Fault


def _json(*args) -> dict:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code in (0, 1, 4), result.output
    return json.loads(result.stdout)


def test_sparse_weight_checks_give_one_first_divergent_step_everywhere(make_trace):
    path = make_trace(fault=Fault(kind="weights", step=9, rank=1), weights_every=4)
    tri = triage_trace(Trace.open(path))
    bisected = _json("bisect", path, "--trace-only", "--json")
    certified = _json("certify", path, "--trace-only", "--json")
    assert tri.first_suspect_step == decision.first_divergent_step(tri.evidence) == 9
    assert bisected["first_divergent_step"] == certified["first_divergent_step"] == 9
    assert bisected["divergence_window"] == [9, 12]
    assert [s["rank"] for s in bisected["suspects"]] == [1]
    [ev] = [e for e in bisected["evidence"] if e["kind"] == "weight_divergence"]
    assert (ev["step"], ev["earliest_step"]) == (12, 9)
