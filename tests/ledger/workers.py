"""Processes that write a ledger, for the concurrency and kill tests (importable under ``spawn``)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import signal
import uuid

from sdc_forensics.ledger import IntervalRecord, append_record
from sdc_forensics.ledger.record import encode_record

#: Padding that makes a record longer than a pipe's atomic write (4 KiB): only the lock keeps it whole.
PAD = "x" * 6000


def numbered(template: IntervalRecord, writer: str, seq: int) -> IntervalRecord:
    """``template`` as record number ``seq`` of ``writer`` (a new id, the pair in its settings)."""
    return dataclasses.replace(
        template, record_id=uuid.uuid4().hex, settings={"writer": writer, "seq": seq, "pad": PAD}
    )


def append_many(path: str, template: IntervalRecord, writer: str, count: int, barrier) -> None:
    """Wait for every writer, then append ``count`` records as fast as possible."""
    barrier.wait()
    for seq in range(count):
        append_record(path, numbered(template, writer, seq))


def append_forever(path: str, template: IntervalRecord, ready) -> None:
    """Append records until killed; ``ready`` is set after the first one."""
    seq = 0
    while True:
        append_record(path, numbered(template, "looper", seq))
        seq += 1
        ready.set()


def die_mid_append(path: str, template: IntervalRecord) -> None:
    """What a writer killed inside its write leaves: holding the lock, half a record written, then SIGKILL."""
    line = encode_record(numbered(template, "killed", 0))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, line[: len(line) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
