"""The post-incident review: a :class:`BisectResult` rendered as a Markdown document.

It reads like the review an on-call engineer would write by hand, with the evidence attached:
what happened (verdict, first divergent step and when it ran in UTC, suspects with host and GPU,
what was lost), the actions ready to paste (``present/actions.py``), the evidence chain, every
checkpoint's status, what was replayed and how it was compared, what was checked and what could
not be, the job's environment, and commands that reproduce the analysis when rerun. The HTML
review (``present/html.py``) has the same sections plus plots; both read ``present/report.py``.
Like the other renderers it only reads the result (numpy-free, torch-free).
"""

from __future__ import annotations

import re

import datetime as _dt
from typing import TYPE_CHECKING

from sdc_forensics.present.text import evidence_rows
from sdc_forensics import __version__
from sdc_forensics.decide.incident import Incident
from sdc_forensics.decide.verdict import BisectResult
from sdc_forensics.present import report as R
from sdc_forensics.trace.manifest import Manifest

if TYPE_CHECKING:
    from sdc_forensics.present.actions import ActionBlock
    from sdc_forensics.trace.ends import RunEnd


def _cell(text: object) -> str:
    return _prose(text).replace("|", "\\|")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _prose(text: object) -> str:
    """A trace-derived string as one line of Markdown text: control characters (a newline that
    would start a fake section) become spaces and ``<``/``>`` cannot open raw HTML."""
    return _CONTROL.sub(" ", str(text)).replace("<", "&lt;").replace(">", "&gt;")


def _code(text: object) -> str:
    """A trace-derived string as an inline code span that nothing in it can end or escape."""
    value = _CONTROL.sub(" ", str(text))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", value)), default=0) + 1)
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{value}{pad}{fence}"


def _fenced(commands) -> list[str]:
    """Commands in a bash fence that no command line can close (control characters and backtick
    runs neutralised; the names in them were checked in ``present/actions.py``)."""
    return ["```bash", *(_CONTROL.sub("?", c).replace("`", "?") for c in commands), "```"]


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _stopped_early(end: "RunEnd") -> list[str]:
    """The section that says the run stopped early, where, and what the analysis could read."""
    out = ["## The run stopped early", ""]
    stopped = [r for r in end.ranks if r.rank in end.stopped_ranks]
    who = (
        "every rank"
        if len(stopped) == len(end.ranks)
        else ", ".join(f"rank {r.rank} (host {_code(r.host or '?')})" for r in stopped)
    )
    after = stopped[0].last_step if stopped else None
    out.append(
        f"- **Where:** {who} stopped "
        + (f"after step {after}" if after is not None else "before recording any step")
        + (f" (attempt {end.attempt})" if end.attempt else "")
        + f"; the run stopped at step {end.stop_step}."
    )
    if end.last_complete_step is None:
        out.append("- **Last complete step:** none: no step was recorded by every rank.")
    else:
        out.append(
            f"- **Last complete step: {end.last_complete_step}** (recorded by every rank). Every rank is read up to it; "
            "a replay stops there, and the steps after it hold some ranks' records only."
        )
    if end.finalised is None:
        out.append("- **Trace finalised:** unknown (the trace predates END records, format 1.0).")
    else:
        out.append(
            f"- **Trace finalised:** {'yes' if end.finalised else 'no'}: "
            + f"{sum(1 for r in end.ranks if r.closed)} of {len(end.ranks)} ranks closed their trace file."
        )
    out += [f"- {end.describe()[0].upper()}{end.describe()[1:]}.", ""]
    rows = [
        (
            r.rank,
            r.host or "-",
            "no file" if not r.has_file else "-" if r.last_step is None else r.last_step,
            "-" if r.closed is None else ("on an exception" if r.closed_on_error else "yes") if r.closed else "**no**",
            r.torn_bytes or "-",
        )
        for r in end.ranks
    ]
    return out + _table(("rank", "host", "last step recorded", "closed its trace", "torn bytes at the tail"), rows)


def render_markdown(
    result: BisectResult,
    manifest: Manifest | None,
    incident: Incident,
    actions: "tuple[ActionBlock, ...]",
    request: R.ReportRequest,
    *,
    now: _dt.datetime | None = None,
    end: "RunEnd | None" = None,
    coverage=None,
) -> str:
    """The review as Markdown.

    Args:
        result: what ``bisect`` concluded.
        manifest: the trace's manifest (environment and identities), or None.
        incident: ``decide.incident.build_incident`` of ``result`` (times, losses, nodes).
        actions: ``present.actions.build_actions`` of it.
        request: the invocation, for the commands that reproduce the analysis.
        now: the time to stamp (default: now, UTC).
        end: how the trace's latest attempt ended (``Trace.run_end()``); when the run stopped
            early the review says so first, and where.
        coverage: per checkpoint, what examined the steps before it (``decide.coverage.with_details``), or None.
    """
    now = now or _dt.datetime.now(_dt.timezone.utc)
    out = [f"# Post-incident review: {R.headline(result.verdict)}", ""]
    out += [
        f"Trace {_code(result.trace_path)} ({result.world_size} ranks, steps "
        f"{'-' if result.step_range is None else f'{result.step_range[0]}..{result.step_range[1]}'}); "
        f"analysed {now:%Y-%m-%d %H:%M} UTC by sdc-forensics {__version__}, mode `{result.mode}`.",
        "",
    ]

    stopped = end is not None and end.stopped_early
    if stopped:
        out += [
            f"**The run stopped early** at step {end.stop_step}: the last step every rank recorded is "
            f"{'none' if end.last_complete_step is None else end.last_complete_step}; this review covers what was recorded.",
            "",
        ]

    out += ["## Summary", ""]
    if result.first_divergent_step is not None:
        s = result.first_divergent_step
        out.append(
            f"- **First divergent step: {s}.** θ_{s} is still clean, θ_{s + 1} is not: only checkpoints N <= {s} can be clean."
        )
        out.append(f"- **When:** {R.when_sentence(incident)}")
    else:
        out.append(f"- First divergent step: {R.none_found_sentence(result)}")
    weak = [e for e in result.evidence if e.is_weak]
    if weak and result.first_divergent_step is None:
        out.append(
            f"- **Weak evidence, not a verdict:** step {weak[0].step}, rank(s) {', '.join(map(str, weak[0].ranks)) or 'all'} "
            f'({_cell(weak[0].found)}); see "To settle" below.'
        )
    for suspect in result.suspects:
        if suspect.rank is None:
            who = "the collective (every rank received the same wrong result; no single rank)"
        else:
            who = f"rank {suspect.rank} on host {_code(suspect.host or '?')}, GPU {_code(suspect.gpu or '?')}"
            if manifest is not None:
                ident = manifest.identity(suspect.rank)
                who += f" (UUID {_code(ident.gpu_uuid or '-')}, PCI bus {_code(ident.pci_bus_id or '-')})"
            # a sharded job: which shard and replica
            if suspect.mesh:
                who += f", mesh {_code(suspect.mesh)}"
        out.append(
            f"- **Suspect: {who}**; location `{suspect.location.value}`; "
            f"{'recurring' if suspect.recurring else 'transient, one event'} (steps {', '.join(map(str, suspect.steps))})."
        )
    last = result.last_clean_checkpoint
    out.append(
        f"- **Resume from:** {_code(last.path)} (checkpoint {last.step}, {last.status.value})."
        if last
        else "- **Resume from:** no checkpoint could be certified clean."
    )
    out.append(f"- **Lost:** {R.lost_sentence(incident)}")
    out.append("")
    if stopped:
        out += _stopped_early(end)

    out += ["## Actions ready to paste", ""]
    for block in actions:
        out += [f"### {_prose(block.title)}", ""] + [f"- {_prose(line)}" for line in block.why] + [""]
        if block.commands:
            out += [*_fenced(block.commands), ""]

    real = [e for e in result.evidence if not e.is_hint]
    if real:
        out += ["## Evidence chain", ""]
        out += _table(
            ("step", "kind", "ranks", "location", "source", "strength", "expected", "found", "detail"),
            evidence_rows(real),
        )
    hints = [e for e in result.evidence if e.is_hint]
    if hints:
        out += ["## Statistical hints (not a verdict)", ""]
        out += _table(
            ("step", "kind", "ranks", "location", "source", "strength", "expected", "found", "detail"),
            evidence_rows(hints[:20]),
        )

    if result.checkpoints:
        out += ["## Checkpoints", ""]
        out += _table(
            ("step", "status", "path", "reasons"),
            [(c.step, c.status.value, _code(c.path), "; ".join(c.reasons)) for c in result.checkpoints],
        )

    replay = result.replayed
    out += ["## What was replayed", ""]
    if replay.windows:
        out.append(
            f"On {_code(replay.device)}, comparison **{replay.comparison}**"
            + (f", all-reduce summation order {_code(replay.reduction_order)}" if replay.reduction_order else "")
            + f"; {replay.steps_replayed} step(s) replayed."
        )
        out.append("")
        out += _table(
            ("from checkpoint", "to step", "last replayed", "comparison", "why"),
            [
                (
                    w.start,
                    w.stop,
                    w.last,
                    w.comparison + (f" from step {w.tolerant_from}" if w.tolerant_from is not None else ""),
                    w.reason,
                )
                for w in replay.windows
            ],
        )
        if replay.settings:
            out += [
                "Deterministic settings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(replay.settings.items())),
                "",
            ]
    else:
        out += [
            "Nothing was replayed ("
            + ("trace-only analysis" if result.mode == "trace-only" else "no window needed")
            + ").",
            "",
        ]

    out += ["## What was checked", ""] + [f"- {_cell(line)}" for line in R.checked(result)] + [""]
    missing = R.not_checked(result, end, coverage)
    out += (
        ["## What could not be checked", ""]
        + ([f"- {_cell(line)}" for line in missing] or ["Nothing left unexamined."])
        + [""]
    )

    if manifest is not None:
        out += ["## Job environment", ""]
        att = max(manifest.attempts, key=lambda a: a.attempt) if manifest.attempts else None
        out.append(
            f"- World size {manifest.world_size}, recipe {_code(manifest.recipe or '-')}, gradients in "
            f"{_code(manifest.fingerprint.grad_dtype)}, sketch k={manifest.fingerprint.sketch_k}."
        )
        if att is not None:
            det = ", ".join(f"{k}={v}" for k, v in sorted(att.determinism.items())) or "-"
            out.append(
                f"- Latest attempt {att.attempt} (from step {att.start_step}): torch {_code(att.torch_version or '?')}, "
                f"CUDA {_code(att.cuda_version or '-')}, determinism: {det}."
            )
        suspects = [s.rank for s in result.suspects if s.rank is not None]
        if suspects:
            rows = []
            for rank in suspects:
                ident = manifest.identity(rank)
                rows.append(
                    (
                        rank,
                        ident.host or "?",
                        ident.node_rank,
                        ident.local_rank,
                        ident.gpu_uuid or "-",
                        ident.pci_bus_id or "-",
                        ident.slurm_job_id or "-",
                        ident.slurm_node or ident.k8s_node or "-",
                    )
                )
            out.append("")
            out += _table(("rank", "host", "node", "local rank", "GPU UUID", "PCI bus", "Slurm job", "node name"), rows)
        else:
            out.append("")
    notes, commands = R.reproduce_commands(request, result)
    out += ["## Reproduce this analysis", ""] + [_prose(n) for n in notes] + ([""] if notes else [])
    out += [*_fenced(commands), ""]
    return "\n".join(out)
