"""The ledger file: round trip, damage of every kind ignored with one line, locked appends, kills."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import signal

import pytest

from sdc_forensics.errors import LedgerWriteError
from sdc_forensics.ledger import EvidenceEntry, append_record, read_ledger
from sdc_forensics.ledger.store import MAX_RECORD_BYTES
from tests.factories import flip_byte
from tests.ledger import workers


def _lines(path):
    return path.read_bytes().splitlines(keepends=True)


def test_round_trip_is_canonical_json_with_an_independent_sha256(ledger_run):
    evidence = (
        EvidenceEntry(kind="replay_mismatch", step=13, ranks=(2,), strength="strong", detail="local digest differs"),
    )
    written = [
        ledger_run.record(0, 10),
        ledger_run.record(10, 20, evidence=evidence, last=13),
        ledger_run.record(20, 30),
    ]
    written[2] = dataclasses.replace(written[2], stop=None)  # a window that ends between checkpoints
    for record in written:
        append_record(ledger_run.ledger, record)
    got = read_ledger(ledger_run.ledger)
    assert got.records == tuple(written) and got.notes == ()
    for raw in _lines(ledger_run.ledger):
        doc = json.loads(raw)
        body = json.dumps(
            {k: v for k, v in doc.items() if k != "sha256"}, sort_keys=True, separators=(",", ":")
        ).encode()
        assert doc["sha256"] == hashlib.sha256(body).hexdigest()
        assert doc["ledger_version"] == 1 and raw.endswith(b"\n") and raw.isascii()
    assert json.loads(_lines(ledger_run.ledger)[1])["evidence"] == [
        {"kind": "replay_mismatch", "step": 13, "ranks": [2], "strength": "strong", "detail": "local digest differs"}
    ]


def test_a_missing_ledger_is_empty_and_says_nothing(tmp_path):
    got = read_ledger(tmp_path / "ledger.jsonl")
    assert got.records == () and got.notes == ()


def test_a_flipped_byte_anywhere_in_a_record_ignores_that_record_with_one_line(ledger_run):
    records = [ledger_run.record(s, s + 10) for s in (0, 10, 20)]
    for record in records:
        append_record(ledger_run.ledger, record)
    pristine = ledger_run.ledger.read_bytes()
    first, second = _lines(ledger_run.ledger)[:2]
    for offset in range(len(first), len(first) + len(second) - 1):  # every byte of line 2 but its end of line
        flip_byte(ledger_run.ledger, offset)
        got = read_ledger(ledger_run.ledger)
        assert got.records == (records[0], records[2]), offset
        assert len(got.notes) == 1 and f"{ledger_run.ledger}:2: ledger record ignored" in got.notes[0], (
            offset,
            got.notes,
        )
        ledger_run.ledger.write_bytes(pristine)


def test_a_truncated_tail_is_ignored_with_one_line_and_the_next_append_is_whole(ledger_run):
    records = [ledger_run.record(s, s + 10) for s in (0, 10)]
    for record in records:
        append_record(ledger_run.ledger, record)
    pristine = ledger_run.ledger.read_bytes()
    first = len(_lines(ledger_run.ledger)[0])
    for cut in range(first + 1, len(pristine)):
        ledger_run.ledger.write_bytes(pristine[:cut])
        got = read_ledger(ledger_run.ledger)
        assert got.records == (records[0],), cut
        assert got.notes == (
            f"{ledger_run.ledger}:2: ledger record ignored: a torn record at the end of the file ({cut - first} bytes "
            "without an end of line: a write was cut short)",
        )
    ledger_run.ledger.write_bytes(pristine[: first + 100])
    later = ledger_run.record(20, 30)
    append_record(ledger_run.ledger, later)
    got = read_ledger(ledger_run.ledger)
    assert got.records == (records[0], later)
    assert len(got.notes) == 1 and ":2: ledger record ignored: not valid JSON" in got.notes[0]


def _rewrite_line(path, number, edit, *, reseal):
    lines = _lines(path)
    doc = json.loads(lines[number - 1])
    edit(doc)
    if reseal:  # what someone who knows the format would do: the checksum matches again
        body = {k: v for k, v in doc.items() if k != "sha256"}
        doc["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    lines[number - 1] = (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()
    path.write_bytes(b"".join(lines))


def _acquit(doc):
    doc.update(outcome="clean", evidence=[], last_step=doc["stop_step"] - 1)


def test_an_edited_verdict_is_ignored_and_nothing_is_certified_on_its_strength(ledger_run):
    from sdc_forensics.ledger import exact_coverage, reusable_records

    evidence = (EvidenceEntry(kind="replay_mismatch", step=4, ranks=(1,)),)
    append_record(ledger_run.ledger, ledger_run.record(0, 10, evidence=evidence, last=4))
    _rewrite_line(ledger_run.ledger, 1, _acquit, reseal=False)
    got = read_ledger(ledger_run.ledger)
    assert got.records == ()
    assert got.notes == (
        f"{ledger_run.ledger}:1: ledger record ignored: checksum mismatch (the record was damaged or edited); "
        "the record is ignored (it was damaged, edited, or not written by sdc-forensics)",
    )
    reuse = reusable_records(got.records, list(ledger_run.notes().values()), trace_dir=ledger_run.trace)
    assert [c.exact for c in exact_coverage(reuse.records, (0, 10))] == [True, False]


def test_a_resealed_record_that_contradicts_itself_is_ignored(ledger_run):
    evidence = (EvidenceEntry(kind="replay_mismatch", step=4, ranks=(1,)),)
    append_record(ledger_run.ledger, ledger_run.record(0, 10, evidence=evidence, last=4))
    _rewrite_line(
        ledger_run.ledger, 1, lambda doc: doc.update(outcome="clean"), reseal=True
    )  # clean, with its evidence still there
    got = read_ledger(ledger_run.ledger)
    assert got.records == () and len(got.notes) == 1 and "a clean outcome lists evidence" in got.notes[0]


def test_an_unknown_version_is_ignored_with_one_line(ledger_run):
    append_record(ledger_run.ledger, ledger_run.record(0, 10))
    append_record(ledger_run.ledger, ledger_run.record(10, 20))
    _rewrite_line(ledger_run.ledger, 1, lambda doc: doc.update(ledger_version=2), reseal=True)
    got = read_ledger(ledger_run.ledger)
    assert [r.start_step for r in got.records] == [10]
    assert got.notes == (
        f"{ledger_run.ledger}:1: ledger record ignored: ledger record version 2, this sdc-forensics reads version 1; "
        "the record is ignored (upgrade sdc-forensics to reuse it)",
    )


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b"[1, 2]\n",
        b"{}\n",
        b'{"ledger_version": true}\n',
        b"[" * 100_000 + b"\n",
        b'{"a": 1e999999}\n',
        b'{"ledger_version": 1, "sha256": 5}\n',
        b"\xff\xfe\n",
        b"9" * 5000 + b"\n",
        b"x" * (MAX_RECORD_BYTES + 10) + b"\n",
    ],
)
def test_hostile_lines_are_each_one_line_and_never_raise(ledger_run, line):
    append_record(ledger_run.ledger, ledger_run.record(0, 10))
    with open(ledger_run.ledger, "ab") as handle:
        handle.write(line + b"\n")  # a blank line after it says nothing
    append_record(ledger_run.ledger, ledger_run.record(10, 20))
    got = read_ledger(ledger_run.ledger)
    assert [r.start_step for r in got.records] == [0, 10]
    assert len(got.notes) == 1 and got.notes[0].startswith(f"{ledger_run.ledger}:2: ledger record ignored: ")


def test_a_record_with_a_field_out_of_range_is_ignored(ledger_run):
    append_record(ledger_run.ledger, ledger_run.record(0, 10))
    _rewrite_line(ledger_run.ledger, 1, lambda doc: doc["start"].update(weights_digest="not hex"), reseal=True)
    got = read_ledger(ledger_run.ledger)
    assert got.records == () and '"weights_digest" must be 16 lowercase hex digits' in got.notes[0]


def test_an_unwritable_place_raises_one_error_naming_the_fix(ledger_run, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(LedgerWriteError, match=r"cannot append to the ledger .*pass --ledger PATH"):
        append_record(blocker / "ledger.jsonl", ledger_run.record(0, 10))
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("")
    link = tmp_path / "ledger.jsonl"
    link.symlink_to(target)
    with pytest.raises(LedgerWriteError):  # never written through a link planted in its place
        append_record(link, ledger_run.record(0, 10))
    assert target.read_text() == ""
    assert (
        read_ledger(blocker / "ledger.jsonl")
        .notes[0]
        .endswith("the ledger cannot be read (Not a directory); nothing is reused from it")
    )


def _spawn():
    return multiprocessing.get_context("spawn")


def test_two_writers_appending_200_records_each_lose_and_tear_none(ledger_run):
    ctx, template = _spawn(), ledger_run.record(0, 10)
    barrier = ctx.Barrier(2)
    procs = [
        ctx.Process(target=workers.append_many, args=(str(ledger_run.ledger), template, name, 200, barrier))
        for name in "ab"
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    assert [p.exitcode for p in procs] == [0, 0]
    got = read_ledger(ledger_run.ledger)
    assert got.notes == () and len(_lines(ledger_run.ledger)) == 400
    for name in "ab":
        assert [r.settings["seq"] for r in got.records if r.settings["writer"] == name] == list(range(200))
    assert len({r.record_id for r in got.records}) == 400


def test_a_writer_killed_mid_record_leaves_a_torn_tail_that_is_skipped_and_the_next_append_works(ledger_run):
    before = ledger_run.record(0, 10)
    append_record(ledger_run.ledger, before)
    proc = _spawn().Process(target=workers.die_mid_append, args=(str(ledger_run.ledger), ledger_run.record(10, 20)))
    proc.start()
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    got = read_ledger(ledger_run.ledger)  # the kernel released the killed writer's lock: this does not wait
    assert got.records == (before,) and len(got.notes) == 1 and "a torn record at the end of the file" in got.notes[0]
    after = ledger_run.record(20, 30)
    append_record(ledger_run.ledger, after)
    got = read_ledger(ledger_run.ledger)
    assert got.records == (before, after)
    assert len(got.notes) == 1 and ":2: ledger record ignored: not valid JSON" in got.notes[0]


def test_a_writer_killed_at_a_random_moment_loses_no_complete_record(ledger_run):
    ctx = _spawn()
    ready = ctx.Event()
    proc = ctx.Process(target=workers.append_forever, args=(str(ledger_run.ledger), ledger_run.record(0, 10), ready))
    proc.start()
    ready.wait()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    whole = [line for line in _lines(ledger_run.ledger) if line.endswith(b"\n")]
    got = read_ledger(ledger_run.ledger)
    assert [r.settings["seq"] for r in got.records] == list(range(len(whole)))
    assert len(got.notes) <= 1 and all("a torn record at the end of the file" in n for n in got.notes)
    last = ledger_run.record(10, 20)
    append_record(ledger_run.ledger, last)
    assert read_ledger(ledger_run.ledger).records[-1] == last


def test_stamps_never_block_on_a_fifo_and_refuse_it(tmp_path):
    from sdc_forensics.ledger import stamp_checkpoint

    fifo = tmp_path / "step-00000010.pt"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        stamp_checkpoint(fifo)
    assert read_ledger(fifo).notes == (f"{fifo}: the ledger is not a regular file; nothing is reused from it",)
