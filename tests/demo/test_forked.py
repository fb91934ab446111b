"""``sdc_forensics.demo.forked``: ranks forked from a kept fork server see the environment of the
launch that started them, never a stale one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sdc_forensics.demo import forked

VARIABLE = "SDC_FORENSICS_TEST_FORKED"


def _rank(rank: int, out: str) -> None:
    import sys

    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "value": os.environ.get(VARIABLE),
                "server": os.getppid(),
                "preloaded": all(
                    m in sys.modules for m in ("torch._dynamo", "sdc_forensics.fingerprint._numba_fingerprint")
                ),
            }
        )
    )


def _launch(out: Path) -> list[dict]:
    out.mkdir()
    forked.start(_rank, (str(out),), 2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_kept_server_is_reused_and_a_changed_environment_starts_a_new_one(tmp_path, monkeypatch):
    monkeypatch.setenv(VARIABLE, "first")
    first = _launch(tmp_path / "a")
    again = _launch(tmp_path / "b")
    monkeypatch.setenv(VARIABLE, "second")
    changed = _launch(tmp_path / "c")
    forked.stop_server()
    assert [r["value"] for r in first + again] == ["first"] * 4 and [r["value"] for r in changed] == ["second"] * 2
    assert all(r["preloaded"] for r in first + again + changed)  # torch._dynamo and the kernels came with the fork
    assert {r["server"] for r in first} == {r["server"] for r in again}  # the same server forked both launches
    assert {r["server"] for r in changed}.isdisjoint({r["server"] for r in first})  # a new one for the new environment


def _stuck_rank(rank: int, out: str) -> None:
    import time

    Path(out, f"rank{rank}.started").write_text("")
    if rank == 1:
        time.sleep(120)  # a rank that never returns, as one stuck in a torn-down process group


@pytest.mark.heavy  # waits out its deadline
def test_a_rank_past_the_deadline_is_killed_with_its_stack_and_the_caller_is_told(tmp_path, capfd):
    import time

    # the ranks write to the fork server's stderr: a server started now has this test's (capfd's)
    forked.stop_server()
    started = time.monotonic()
    try:
        # rank 0 returns at once; on a loaded machine it may still be starting at the deadline
        with pytest.raises(TimeoutError, match=r"rank\(s\) (0, )?1 still running 20 s after the start"):
            forked.start(_stuck_rank, (str(tmp_path),), 2, deadline_s=20.0)
        assert time.monotonic() - started < 100  # not the rank's 120 s: it was killed
        if (tmp_path / "rank1.started").exists():  # it reached its sleep: faulthandler printed where
            assert "_stuck_rank" in capfd.readouterr().err
    finally:
        forked.stop_server()  # not kept with this test's stderr for the next launches
