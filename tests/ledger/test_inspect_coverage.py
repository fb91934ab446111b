"""``inspect``'s coverage per checkpoint, from the ledger alone: records that still apply count as
exact (or tolerant) replay, the rest had the online checks only, and the cost of replaying the
rest is the records' measured seconds per rank-step (``ledger_run``: 2 ranks, steps 0..39,
checkpoints 0, 10, 20, 30; each record replayed 10 steps in 1.25 s: 0.0625 s per rank-step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sdc_forensics
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from sdc_forensics.ledger import Comparison, EvidenceEntry, append_record
from tests.schema_check import assert_valid

pytestmark = pytest.mark.ledger


def _inspect(run, *args):
    result = CliRunner().invoke(cli, ["inspect", str(run.trace), "--json", *args])
    assert result.exit_code == 0, result.output
    return assert_valid(json.loads(result.stdout), "inspect")


def test_inspect_shows_what_the_ledger_replayed_and_what_the_rest_costs(ledger_run):
    for record in (
        ledger_run.record(0, 10),
        ledger_run.record(10, 20),
        ledger_run.record(20, 30, comparison=Comparison.TOLERANT),
    ):
        append_record(ledger_run.ledger, record)
    doc = _inspect(ledger_run)
    by_step = {c["step"]: c for c in doc["coverage"]}
    assert (
        by_step[20]["exact_ledger"] == [[0, 19]]
        and by_step[20]["lacking_replay"] == []
        and by_step[20]["replay_cost"] is None
    )
    c30 = by_step[30]
    assert (c30["exact_ledger"], c30["tolerant"], c30["online_only"], c30["lacking_replay"]) == (
        [[0, 19]],
        [[20, 29]],
        [],
        [[20, 29]],
    )
    assert c30["replay_cost"] == {
        "rank_steps": 20,
        "seconds_per_rank_step": 0.0625,
        "seconds": 1.25,
        "ledger_records": 3,
    }
    assert doc["ledger"]["strong_evidence"] == [] and doc["ledger"]["notes"] == []
    text = CliRunner().invoke(cli, ["inspect", str(ledger_run.trace)]).stderr
    assert (
        "checkpoint 30: exact from the ledger 0..19; tolerant 20..29 — lacks exact replay: steps 20..29; replaying them costs about"
        " 1.25 s (20 rank-steps x 0.0625 s measured per rank-step over 3 ledger record(s))" in " ".join(text.split())
    )


def test_without_a_ledger_every_recorded_step_had_the_online_checks_only(ledger_run):
    doc = _inspect(ledger_run)
    c30 = {c["step"]: c for c in doc["coverage"]}[30]
    assert c30["online_only"] == [[0, 29]] and c30["replay_cost"] is None
    assert c30["online_checks"]["steps"] == 30 and c30["online_checks"]["gradients"] == 30
    assert _inspect(ledger_run, "--no-ledger")["ledger"] is None
    # the measured rate of the online checks alone, quoted once, from the campaign's figures shipped in the package
    rates = json.loads((Path(sdc_forensics.__file__).parent / "measured" / "trace_only_rates.json").read_text())
    training = rates["training_faults"]
    text = " ".join(CliRunner().invoke(cli, ["inspect", str(ledger_run.trace)]).stderr.split())
    assert text.count("online checks only: in the fault campaign") == 1
    assert f"caught {training['trace_only_detected']} of {training['effective']} effective training faults" in text


def test_strong_evidence_in_the_ledger_is_said_and_covers_nothing(ledger_run):
    entry = EvidenceEntry(
        kind="replay_mismatch", step=14, ranks=(1,), strength="strong", detail="local gradient differs"
    )
    record = ledger_run.record(10, 20, evidence=(entry,), last=14)
    append_record(ledger_run.ledger, ledger_run.record(0, 10))
    append_record(ledger_run.ledger, record)
    doc = _inspect(ledger_run)
    assert doc["ledger"]["strong_evidence"] == [{"step": 14, "record": record.record_id}]
    assert {c["step"]: c for c in doc["coverage"]}[20]["lacking_replay"] == [[10, 19]]
