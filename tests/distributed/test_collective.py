"""Issue 21, item 4: ``--collective``, the replay all-reducing with its own process group (torchrun
with one process per recorded rank) instead of a model of the job's sum, checked against the
recorded reduced digest at every step.

On gloo the replay's own ring all-reduce is the job's: a clean run is certified exactly with
``reduction_order: collective`` and a fault gives the single-process answer. A job whose comm hook
sums in its own order (``demo.hooks.reversed_mean``, standing in for an NCCL order no model knows)
is not reproduced: the replay says so at the first step, names the hook as the setting most
likely at fault, and certifies nothing it could not reproduce. Another process count is refused
with one line, before any replay.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sdc_forensics.cli.main import cli
from tests.distributed.launch import start_torchrun, wait

pytestmark = pytest.mark.slow

STEPS, EVERY, WORLD = 6, 3, 4  # the demo runs of tests/forensics/test_bisect_demo.py (made once per session)
TIMEOUT_S = 400  # three 4-process launches side by side on a loaded 2-core machine
HOOK = "sdc_forensics.demo.hooks:reversed_mean"


def _bisect_collective(traces: dict[str, str]) -> dict[str, tuple]:
    launches = {
        name: start_torchrun(WORLD, ["-m", "sdc_forensics", "bisect", trace, "--collective", "--json"])
        for name, trace in traces.items()
    }
    return {name: wait(proc, TIMEOUT_S) for name, proc in launches.items()}


def test_the_replays_own_collective_certifies_gloo_jobs_and_names_an_unknown_order(demo_run):
    traces = {
        "clean": demo_run((), steps=STEPS, checkpoint_every=EVERY),
        "grad": demo_run("grad:step=4:rank=2:bit=31", steps=STEPS, checkpoint_every=EVERY),
        "hook": demo_run((), steps=STEPS, checkpoint_every=EVERY, comm_hook=HOOK),
    }
    done = _bisect_collective({name: str(out / "trace") for name, out in traces.items()})
    docs = {}
    for name, (code, out, err, _) in done.items():
        assert out, err[-3000:]
        docs[name] = json.loads(out)
        assert code == (0 if name == "clean" else 1), (name, err[-2000:])  # torchrun: 1 when a process exits non-zero

    clean = docs["clean"]
    assert clean["verdict"] == "clean" and clean["replayed"]["comparison"] == "exact"
    assert clean["replayed"]["reduction_order"] == "collective"
    assert clean["preflight"]["mechanism"] == "collective"
    assert [c["status"] for c in clean["checkpoints"]] == ["clean"] * 3

    single = json.loads(CliRunner().invoke(cli, ["bisect", str(traces["grad"] / "trace"), "--json"]).stdout)
    grad = docs["grad"]
    assert grad["replayed"]["reduction_order"] == "collective"
    for key in ("verdict", "first_divergent_step", "last_clean_checkpoint"):
        assert grad[key] == single[key], key
    assert [s["rank"] for s in grad["suspects"]] == [s["rank"] for s in single["suspects"]] == [2]
    assert [c["status"] for c in grad["checkpoints"]] == [c["status"] for c in single["checkpoints"]]

    hook = docs["hook"]
    assert hook["verdict"] == "inconclusive" and hook["replayed"]["comparison"] == "tolerant"
    assert [c["status"] for c in hook["checkpoints"]][1:] == [
        "unverified",
        "unverified",
    ]  # nothing certified past what reproduced
    said = [n for n in hook["replayed"]["notes"] if "the replay's own collective does not reproduce" in n]
    assert said and all("sdc_forensics.demo.hooks.reversed_mean" in n for n in said)


def test_collective_without_one_process_per_rank_is_refused_in_one_line(demo_run):
    trace = demo_run((), steps=STEPS, checkpoint_every=EVERY) / "trace"
    ran = CliRunner().invoke(cli, ["bisect", str(trace), "--collective"])
    assert ran.exit_code == 2, ran.output
    lines = [line for line in ran.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(lines) == 1
        and f"launch {WORLD} processes, one per recorded rank" in lines[0]
        and "not one process" in lines[0]
    )
