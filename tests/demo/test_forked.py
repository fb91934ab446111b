"""``sdc_forensics.demo.forked``: ranks forked from a kept fork server see the environment of the
launch that started them, never a stale one."""

from __future__ import annotations

import json
import os
from pathlib import Path

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
