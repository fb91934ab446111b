"""What every format of the post-incident review says: the pieces the HTML, Markdown and JSON
renderers share, so the three never disagree.

* :func:`reproduce_commands`: from how the analysis was asked for (``forensics.review.ReportRequest``:
  absolute paths, the options given), commands that reproduce it and that work when rerun
  (``--force``, absolute paths, the recipe's import path);
* :func:`output_format`: the format from ``--format`` or ``-o``'s suffix;
* :func:`checked` / :func:`not_checked`: what the analysis examined and what it could not;
* :func:`report_document`: the ``report --format json`` document (the bisect document, plus the
  incident, the actions, the checks and the commands; ``docs/schemas/report.schema.json``);
* small formatters of times and durations.
"""

from __future__ import annotations

import datetime as _dt
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdc_forensics.decide.coverage import coverage_of
from sdc_forensics.decide.incident import Incident
from sdc_forensics.decide.verdict import BisectResult, Verdict
from sdc_forensics.forensics.review import ReportRequest
from sdc_forensics.present.bisect import bisect_document
from sdc_forensics.present.coverage import cost_text, online_rate_line
from sdc_forensics.trace.ends import STOPPED_EARLY

if TYPE_CHECKING:
    from sdc_forensics.present.actions import ActionBlock
    from sdc_forensics.trace.ends import RunEnd

FORMATS = ("html", "md", "json")
_SUFFIXES = {".html": "html", ".htm": "html", ".md": "md", ".markdown": "md", ".json": "json"}
PLOTS_HINT = "pip install 'sdc-forensics[report]' for plots"


def output_format(output: str, fmt: str | None) -> str:
    """``fmt`` when given; else from ``output``'s suffix (``.html``/``.htm``, ``.md``, ``.json``);
    else Markdown (stdout, or an unknown suffix)."""
    if fmt:
        return fmt
    if output == "-":
        return "md"
    return _SUFFIXES.get(Path(output).suffix.lower(), "md")


def utc(ns: int | None) -> str:
    """``2026-11-30T19:09:23.916Z`` (ISO 8601, UTC, milliseconds), or ``unknown``."""
    if not ns:
        return "unknown"
    moment = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def duration(seconds: float | None) -> str:
    """``3 h 12 min``, ``4 min 05 s``, ``0.83 s``; ``unknown``."""
    if seconds is None:
        return "unknown"
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days} d {hours} h {minutes:02d} min"
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def lost_sentence(incident: Incident) -> str:
    """Steps, wall-clock and GPU-hours lost, and how they were computed."""
    lost = incident.lost
    if lost is None:
        if incident.verdict is Verdict.INCONCLUSIVE:
            return "Not known until the evidence is settled: no divergent step was established, so no rollback is called for yet."
        return "Nothing lost: no rollback is needed."
    if lost.num_steps == 0:
        return f"No step lost: checkpoint {lost.from_step} holds the state after the last recorded step {lost.to_step}."
    start = (
        f"the resume checkpoint {lost.from_step}"
        if lost.basis == "resume_checkpoint"
        else f"the first recorded step {lost.from_step} (no checkpoint certified clean)"
    )
    hours = "unknown" if lost.gpu_hours is None else f"{lost.gpu_hours:.3g}"
    unit, per = (
        ("GPU-hours", "one GPU per rank") if incident.on_gpu else ("rank-hours", "a CPU job: one process per rank")
    )
    return (
        f"{lost.num_steps} step(s) ({lost.from_step}..{lost.to_step}) and {duration(lost.wall_clock_s)} of wall-clock, "
        f"{hours} {unit}: from {start} to the last recorded step {lost.to_step}; {unit} = wall-clock × "
        f"{lost.world_size} ranks ({per})."
    )


def none_found_sentence(result: BisectResult) -> str:
    """The report's "first divergent step" when the latest lineage has none: where an earlier attempt's
    suspect went wrong (steps a later attempt re-executed), or the scope of what was examined."""
    earlier = [s for s in result.suspects if s.attempt is not None and s.steps]
    if not earlier:
        return f"none found: {result.scope}"
    where = "; ".join(f"attempt {s.attempt}'s step {min(s.steps)}" for s in earlier)
    return (
        f"none in the steps the latest attempt ran; {where}, re-executed by a later attempt from a checkpoint "
        f"before it, is where the suspect went wrong ({result.scope})"
    )


def when_sentence(incident: Incident) -> str:
    """When the first divergent step ran, in UTC, for lining up with XID/DCGM logs."""
    if incident.first_divergent_step is None:
        return ""
    s = incident.first_divergent_step
    if incident.divergent_ended_ns is None:
        return f"Step {s}'s time is unknown (its records hold no time)."
    start = f"between {utc(incident.divergent_started_ns)} and " if incident.divergent_started_ns else "before "
    return f"Step {s} ran {start}{utc(incident.divergent_ended_ns)} UTC (the trace records of step {s - 1} and {s})."


def recipe_import_root(recipe: str | None) -> Path | None:
    """The directory to put on ``PYTHONPATH`` for ``recipe``'s module, when it was imported from
    outside the installed packages (None: installed, not imported, or unknown)."""
    if not recipe or ":" not in recipe:
        return None
    module = sys.modules.get(recipe.split(":", 1)[0])
    origin = getattr(module, "__file__", None)
    if not origin:
        return None
    path = Path(origin).resolve()
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return None
    # sdc_forensics itself (the demo recipes)
    if Path(__file__).resolve().parents[1] in path.parents:
        return None
    depth = recipe.split(":", 1)[0].count(".") + (2 if path.name == "__init__.py" else 1)
    return path.parents[depth - 1]


def reproduce_commands(request: ReportRequest, result: BisectResult) -> tuple[list[str], list[str]]:
    """``(notes, commands)``: shell commands that rerun this analysis as it was run, and what they need.

    The report command overwrites its own output (``--force``): rerunning it must not fail on the
    file it wrote. Paths are absolute, so the commands work from any directory.
    """
    chosen = request.options
    opts: list[str] = []
    if chosen.trace_only:
        opts.append("--trace-only")
    if chosen.checkpoints_dir is not None:
        opts += ["--checkpoints", str(chosen.checkpoints_dir)]
    if chosen.recipe:
        opts += ["--recipe", chosen.recipe]
    if chosen.device != "cpu":
        opts += ["--device", chosen.device]
    if chosen.num_threads is not None:
        opts += ["--threads", str(chosen.num_threads)]
    if chosen.force_tolerant:
        opts.append("--tolerant")
    if chosen.force_device:
        opts.append("--force-device")
    # under torchrun, one process per recorded rank
    if chosen.collective:
        opts.append("--collective")
    if chosen.ledger_path is not None and not (
        chosen.no_ledger or chosen.trace_only
        # a rerun without --no-ledger: same answer, less work
    ):
        opts += ["--ledger", str(chosen.ledger_path)]
    trace = str(request.trace_dir)
    report = ["sdc-forensics", "report", trace, *opts, "--format", request.fmt]
    report += ["-o", request.output, "--force"] if request.output != "-" else []
    notes = []
    prefix = ""
    recipe = chosen.recipe or request.manifest_recipe
    if result.mode == "replay" and (
        result.replayed.windows or (result.replayed.ledger and result.replayed.ledger.reused)
    ):
        root = recipe_import_root(recipe)
        if root is not None:
            prefix = f"PYTHONPATH={shlex.quote(str(root))}${{PYTHONPATH:+:$PYTHONPATH}} "
        notes.append(
            f"The replay imports the recipe {recipe}: its module must be importable (the job's code on PYTHONPATH, "
            "or run from the job's code directory)" + (f"; it was imported from {root}." if root else ".")
        )
    commands = [
        prefix + " ".join(shlex.quote(c) for c in ["sdc-forensics", "bisect", trace, *opts]),
        prefix + " ".join(shlex.quote(c) for c in report),
    ]
    return notes, commands


def checked(result: BisectResult) -> list[str]:
    """What the analysis examined, one sentence each."""
    out = [result.scope] if result.scope else []
    replay = result.replayed
    for w in replay.windows:
        if w.last < w.start:
            out.append(
                f"Nothing replayed from checkpoint {w.start}: its first step could not be replayed (see the notes)."
            )
            continue
        span = f"step {w.start}" if w.last == w.start else f"steps {w.start}..{w.last}"
        out.append(
            f"Replayed {span} from checkpoint {w.start} on {replay.device or '?'} "
            f"({w.comparison}"
            + (f" from step {w.tolerant_from}" if w.tolerant_from is not None else "")
            + f"): {w.reason}."
        )
    for w in sorted(replay.ledger.reused, key=lambda w: w.start) if replay.ledger is not None else ():
        span = f"step {w.start}" if w.last == w.start else f"steps {w.start}..{w.last}"
        out.append(
            f"Took {span} from the ledger {replay.ledger.path}: replayed exactly and found clean earlier "
            f"(record {', '.join(w.record_ids)}); not replayed again."
        )
    files = [c for c in result.checkpoints if c.report is not None or c.findings]
    if files:
        out.append("Checkpoint file(s) read and verified: " + ", ".join(str(c.step) for c in files) + ".")
    out += [f"Note: {n}" for n in (*result.replayed.notes, *result.notes)]
    return out


def not_checked(result: BisectResult, end: "RunEnd | None" = None, coverage=None) -> list[str]:
    """What could not be examined or settled, one sentence each. ``coverage``: the coverage of
    ``result``'s checkpoints with their online checks and replay cost (``decide.coverage.with_details``);
    None: the spans alone (``coverage_of``)."""
    out: list[str] = []
    if result.mode == "trace-only":
        out.append(
            "Nothing was replayed (--trace-only): faults the trace cannot see were not looked for, and no checkpoint file was read."
        )
    by_step = {c.step: c for c in (coverage if coverage is not None else coverage_of(result))}
    for c in result.checkpoints:
        if c.status.value == "unverified":
            cov = by_step.get(c.step)
            spans = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in (cov.lacking_replay if cov else ()))
            extra = ""
            if cov is not None and cov.online is not None:
                extra += f"; online checks on the steps not replayed: {cov.online.describe()}"
            if cov is not None and cov.cost is not None:
                extra += f"; {cost_text(cov.cost)}"
            out.append(
                f"Checkpoint {c.step} is unverified: "
                + ("; ".join(c.reasons[:2]) or "not every step before it was examined")
                + (f" (steps without an exact replay: {spans}{extra})" if spans else "")
                + "."
            )
    if any(c.status.value == "unverified" for c in result.checkpoints) and any(c.online_only for c in by_step.values()):
        line = online_rate_line()
        if line:
            out.append(f"For the steps the online checks alone examined: {line}.")
    if result.replayed.comparison == "tolerant":
        out.append(
            "Replay was compared within tolerance, not bit for bit: faults below the replay's drift are invisible to it."
        )
    if end is not None and end.stopped_early:
        out.append(end.describe()[0].upper() + end.describe()[1:] + ".")
    else:
        out += [f"Trace damage: {d}" for d in result.damage if d.startswith(STOPPED_EARLY)]
    # said just above
    out += [f"Trace damage: {d}" for d in result.damage if not d.startswith(STOPPED_EARLY)]
    out += [f"To settle: {line}" for line in result.settle]
    return out


def report_document(
    result: BisectResult,
    incident: Incident,
    actions: "tuple[ActionBlock, ...]",
    request: ReportRequest,
    end: "RunEnd | None",
    generated_ns: int,
    coverage=None,
) -> dict[str, Any]:
    """The ``report --format json`` document: the bisect document plus ``trace_end`` and ``report``
    (without ``schema_version``, which the emitter adds); ``coverage``: as for :func:`not_checked`."""
    notes, commands = reproduce_commands(request, result)
    lost = incident.lost
    return {
        **bisect_document(result),
        "trace_end": None if end is None else end.to_json(),
        "report": {
            "generated_utc": utc(generated_ns),
            "first_divergent_step": incident.first_divergent_step,
            "first_divergent_step_utc": None
            if incident.first_divergent_step is None
            else {"started": _iso(incident.divergent_started_ns), "ended": _iso(incident.divergent_ended_ns)},
            "run_started_utc": _iso(incident.run_started_ns),
            "last_step": incident.last_step,
            "last_step_utc": _iso(incident.last_step_ns),
            "resume": None
            if incident.resume_step is None
            else {
                "step": incident.resume_step,
                "path": incident.resume_path,
                "job_path": incident.resume_job_path,
                "saved_by_rank": incident.resume_saved_by,
                "host": incident.resume_host,
                "on_suspect_node": incident.resume_on_suspect_node,
            },
            "lost": None
            if lost is None
            else {
                "from_step": lost.from_step,
                "to_step": lost.to_step,
                "steps": lost.num_steps,
                "wall_clock_s": lost.wall_clock_s,
                "gpu_hours": lost.gpu_hours,
                "world_size": lost.world_size,
                "basis": lost.basis,
            },
            "nodes": [
                {
                    "rank": t.rank,
                    "node": t.node,
                    "node_source": t.node_source,
                    "host": t.host,
                    "gpu_uuid": t.gpu_uuid,
                    "pci_bus_id": t.pci_bus_id,
                    "local_rank": t.local_rank,
                    "location": t.location.value,
                    "implicates": t.implicates.value,
                    "recurring": t.recurring,
                    "steps": list(t.steps),
                    "dcgm_level": t.dcgm_level,
                }
                for t in incident.nodes
            ],
            "collective": incident.collective,
            "checkpoint_locality": incident.checkpoint_locality.value,
            "actions": [a.to_json() for a in actions],
            "checked": checked(result),
            "not_checked": not_checked(result, end, coverage),
            "reproduce": {"notes": notes, "commands": commands},
        },
    }


def _iso(ns: int | None) -> str | None:
    return None if not ns else utc(ns)


def headline(verdict: Verdict) -> str:
    return {
        Verdict.CORRUPTION: "Silent data corruption found",
        Verdict.CLEAN: "No corruption found in the window examined",
        Verdict.INCONCLUSIVE: "Inconclusive: evidence that could not be localised",
    }[verdict]
