"""The post-incident review as one self-contained HTML file.

Everything is inline: the CSS (with print rules), the plots (an inline SVG from
``present/plots.py``); nothing is loaded from the network and no script runs. Every string that
comes from the trace, the manifest or a checkpoint (host names, paths, evidence text) goes
through :func:`html.escape`: trace contents are hostile input. The sections follow the Markdown
review (``present/markdown.py``) and read from the same pieces (``present/report.py``).
"""

from __future__ import annotations

import datetime as _dt
import html
from typing import TYPE_CHECKING

from sdc_forensics.present.text import evidence_rows
from sdc_forensics import __version__
from sdc_forensics.decide.incident import Incident
from sdc_forensics.decide.verdict import BisectResult, Verdict
from sdc_forensics.present import report as R
from sdc_forensics.present.plots import STATUS_COLOURS
from sdc_forensics.trace.manifest import Manifest

if TYPE_CHECKING:
    from sdc_forensics.present.actions import ActionBlock
    from sdc_forensics.trace.ends import RunEnd

_VERDICT_CLASS = {Verdict.CORRUPTION: "bad", Verdict.CLEAN: "good", Verdict.INCONCLUSIVE: "warn"}

_CSS = """
:root { --fg:#1c1c1c; --muted:#5f6368; --line:#dadce0; --bad:#b71c1c; --good:#2e7d32; --warn:#a15c00; --code:#f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--fg); font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1080px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 1.6em; margin: 0 0 4px; }
h2 { font-size: 1.2em; margin: 28px 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
h3 { font-size: 1em; margin: 16px 0 4px; }
.meta, .muted { color: var(--muted); font-size: .9em; }
.verdict { display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff; font-weight: 600; letter-spacing: .02em; }
.verdict.bad { background: var(--bad); } .verdict.good { background: var(--good); } .verdict.warn { background: var(--warn); }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 18px; margin: 8px 0; }
dl.facts dt { color: var(--muted); } dl.facts dd { margin: 0; font-weight: 500; }
code, pre, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace; font-size: .86em; }
code { background: var(--code); padding: 0 3px; border-radius: 3px; overflow-wrap: anywhere; }
pre { background: var(--code); border: 1px solid var(--line); border-radius: 4px; padding: 8px 10px; white-space: pre-wrap;
      overflow-wrap: anywhere; margin: 6px 0 10px; }
table { border-collapse: collapse; width: 100%; margin: 6px 0 12px; font-size: .88em; }
th, td { border: 1px solid var(--line); padding: 3px 6px; text-align: left; vertical-align: top; overflow-wrap: break-word; }
td code { overflow-wrap: anywhere; }
td:first-child, .status { white-space: nowrap; }
th { background: #f1f3f4; }
.status { font-weight: 600; }
.note { border-left: 4px solid var(--warn); background: #fff8e1; padding: 6px 10px; }
svg.plot { width: 100%; height: auto; display: block; }
.action { border: 1px solid var(--line); border-radius: 6px; padding: 4px 12px 2px; margin: 8px 0; break-inside: avoid; }
ul { margin: 4px 0 8px; padding-left: 22px; }
@media print {
  body { font-size: 10pt; } main { max-width: none; padding: 0; }
  h2 { break-after: avoid; } section, table, pre, .action, figure { break-inside: avoid; }
  pre { white-space: pre-wrap; } a { color: inherit; text-decoration: none; }
  @page { margin: 14mm; }
}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _table(header: tuple[str, ...], rows: list[tuple], raw_columns: frozenset[int] = frozenset()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if i in raw_columns else _e(c)}</td>" for i, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{_e(i)}</li>" for i in items) + "</ul>" if items else ""


def _summary(result: BisectResult, incident: Incident, manifest: Manifest | None) -> str:
    facts: list[tuple[str, str]] = [
        ("Verdict", f'<span class="verdict {_VERDICT_CLASS[result.verdict]}">{_e(result.verdict.value.upper())}</span>')
    ]
    s = result.first_divergent_step
    if s is not None:
        facts.append(
            (
                "First divergent step",
                f'<strong>{s}</strong> <span class="muted">(θ_{s} is still clean, θ_{s + 1} is not: only '
                f"checkpoints N ≤ {s} can be clean)</span>",
            )
        )
        facts.append(("When (UTC)", _e(R.when_sentence(incident))))
    else:
        facts.append(("First divergent step", _e(R.none_found_sentence(result))))
    for suspect in result.suspects:
        if suspect.rank is None:
            facts.append(
                ("Suspect", "the collective: every rank received the same wrong all-reduce result (no single rank)")
            )
        else:
            ident = manifest.identity(suspect.rank) if manifest is not None else None
            parts = [f"<strong>rank {suspect.rank}</strong>", f"host <code>{_e(suspect.host or '?')}</code>"]
            # a sharded job: which shard and replica
            if suspect.mesh:
                parts.append(f"mesh <code>{_e(suspect.mesh)}</code>")
            if ident is not None:
                parts.append(f"GPU UUID <code>{_e(ident.gpu_uuid or '-')}</code>")
                parts.append(f"PCI bus <code>{_e(ident.pci_bus_id or '-')}</code>")
                if ident.slurm_node or ident.k8s_node:
                    parts.append(f"node <code>{_e(ident.slurm_node or ident.k8s_node)}</code>")
                parts.append(f"device <code>{_e(ident.device)}</code>")
            facts.append(("Suspect", ", ".join(parts)))
        facts.append(("Location", f"<code>{_e(suspect.location.value)}</code>"))
        facts.append(
            (
                "Transient or recurring",
                ("recurring" if suspect.recurring else "transient (one event)")
                + f", step(s) {_e(', '.join(map(str, suspect.steps)))}",
            )
        )
    last = result.last_clean_checkpoint
    facts.append(
        (
            "Resume from",
            f"<strong>checkpoint {last.step}</strong> <code>{_e(last.path)}</code> ({_e(last.status.value)})"
            if last
            else "<strong>no checkpoint could be certified clean</strong>",
        )
    )
    facts.append(("Lost", _e(R.lost_sentence(incident))))
    weak = [e for e in result.evidence if e.is_weak]
    if weak and s is None:
        facts.append(
            (
                "Weak evidence",
                _e(
                    f"step {weak[0].step}, rank(s) {', '.join(map(str, weak[0].ranks)) or 'all'}: "
                    f"{weak[0].found} (not a verdict; see what would settle it)"
                ),
            )
        )
    return '<dl class="facts">' + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"


def _actions(actions: "tuple[ActionBlock, ...]") -> str:
    out = []
    for block in actions:
        out.append(
            '<div class="action">'
            f"<h3>{_e(block.title)}</h3>"
            + "".join(f"<p>{_e(w)}</p>" for w in block.why)
            + (f"<pre><code>{_e(chr(10).join(block.commands))}</code></pre>" if block.commands else "")
            + "</div>"
        )
    return "".join(out)


def _status_cell(status) -> str:
    return f'<span class="status" style="color:{STATUS_COLOURS[status]}">{_e(status.value)}</span>'


def render_html(
    result: BisectResult,
    manifest: Manifest | None,
    incident: Incident,
    actions: "tuple[ActionBlock, ...]",
    request: R.ReportRequest,
    *,
    plot_svg: str | None,
    plot_note: str = "",
    end: "RunEnd | None" = None,
    now: _dt.datetime | None = None,
    coverage=None,
) -> str:
    """The review as one HTML document.

    Args:
        result, manifest, incident, actions: the analysis and what the report adds to it.
        request: the invocation (for the commands that reproduce it).
        plot_svg: the inline ``<svg>`` of ``present/plots.py`` (trusted: numbers and fixed words),
            None when there are no plots; ``plot_note`` then says why.
        end: how the trace's latest attempt ended.
        now: the time to stamp (default: now, UTC).
        coverage: per checkpoint, what examined the steps before it (``decide.coverage.with_details``), or None.
    """
    now = now or _dt.datetime.now(_dt.timezone.utc)
    title = f"Post-incident review: {R.headline(result.verdict)}"
    steps = "-" if result.step_range is None else f"{result.step_range[0]}..{result.step_range[1]}"
    parts = [
        f'<header><h1>{_e(title)}</h1><p class="meta">Trace <code>{_e(result.trace_path)}</code> ({result.world_size} ranks, '
        f"steps {_e(steps)}); analysed {_e(f'{now:%Y-%m-%d %H:%M}')} UTC by sdc-forensics {_e(__version__)}, mode "
        f"<code>{_e(result.mode)}</code>.</p></header>"
    ]
    if end is not None and end.stopped_early:
        parts.append(
            f'<p class="note"><strong>The run stopped early</strong> at step {_e(end.stop_step)}: {_e(end.describe())}.</p>'
        )
    parts.append('<section id="summary"><h2>Summary</h2>' + _summary(result, incident, manifest) + "</section>")

    parts.append('<section id="plots"><h2>Around the incident</h2>')
    if plot_svg:
        parts.append(f"<figure>{plot_svg}</figure>")
    else:
        parts.append(f'<p class="note">{_e(plot_note or R.PLOTS_HINT)}</p>')
    parts.append("</section>")

    parts.append('<section id="actions"><h2>Actions ready to paste</h2>' + _actions(actions) + "</section>")

    real = [e for e in result.evidence if not e.is_hint]
    parts.append('<section id="evidence"><h2>Evidence</h2>')
    replay = result.replayed
    if replay.windows:
        parts.append(
            f"<p>Replay confirmation on <code>{_e(replay.device or '?')}</code>, comparison <strong>{_e(replay.comparison)}</strong>"
            + (
                f", all-reduce summation order <code>{_e(replay.reduction_order)}</code>"
                if replay.reduction_order
                else ""
            )
            + f"; {replay.steps_replayed} step(s) replayed.</p>"
        )
    else:
        parts.append(
            "<p>Nothing was replayed ("
            + ("trace-only analysis" if result.mode == "trace-only" else "no window needed")
            + ").</p>"
        )
    parts.append(
        _table(
            ("step", "kind", "ranks", "location", "source", "strength", "expected", "found", "detail"),
            evidence_rows(real),
        )
        if real
        else "<p>No evidence of corruption.</p>"
    )
    hints = [e for e in result.evidence if e.is_hint]
    if hints:
        parts.append(
            "<h3>Statistical hints (not a verdict)</h3>"
            + _table(
                ("step", "kind", "ranks", "location", "source", "strength", "expected", "found", "detail"),
                evidence_rows(hints[:20]),
            )
        )
    if replay.windows:
        parts.append(
            "<h3>Replayed windows</h3>"
            + _table(
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
        )
    parts.append("</section>")

    if result.checkpoints:
        parts.append(
            '<section id="checkpoints"><h2>Checkpoints</h2>'
            + _table(
                ("step", "status", "path", "reasons"),
                [
                    (c.step, _status_cell(c.status), f"<code>{_e(c.path or '-')}</code>", _e("; ".join(c.reasons)))
                    for c in result.checkpoints
                ],
                raw_columns=frozenset({1, 2, 3}),
            )
            + "</section>"
        )

    parts.append(
        '<section id="checked"><h2>What was checked</h2>'
        + _list(R.checked(result))
        + "<h3>What could not be checked</h3>"
        + (_list(R.not_checked(result, end, coverage)) or "<p>Nothing left unexamined.</p>")
        + "</section>"
    )

    if manifest is not None:
        att = max(manifest.attempts, key=lambda a: a.attempt) if manifest.attempts else None
        env = [
            f"World size {manifest.world_size}, recipe {manifest.recipe or '-'}, gradients in {manifest.fingerprint.grad_dtype}, "
            f"sketch k={manifest.fingerprint.sketch_k}."
        ]
        if att is not None:
            det = ", ".join(f"{k}={v}" for k, v in sorted(att.determinism.items())) or "-"
            env.append(
                f"Latest attempt {att.attempt} (from step {att.start_step}): torch {att.torch_version or '?'}, "
                f"CUDA {att.cuda_version or '-'}, determinism: {det}."
            )
        ranks = sorted({s.rank for s in result.suspects if s.rank is not None})
        rows = []
        for rank in ranks:
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
        parts.append(
            '<section id="environment"><h2>Job environment</h2>'
            + _list(env)
            + (
                _table(("rank", "host", "node", "local rank", "GPU UUID", "PCI bus", "Slurm job", "node name"), rows)
                if rows
                else ""
            )
            + "</section>"
        )

    notes, commands = R.reproduce_commands(request, result)
    parts.append(
        '<section id="reproduce"><h2>Reproduce this analysis</h2>'
        + "".join(f"<p>{_e(n)}</p>" for n in notes)
        + f"<pre><code>{_e(chr(10).join(commands))}</code></pre></section>"
    )
    parts.append(
        f'<footer class="muted"><p>sdc-forensics {_e(__version__)}: docs/report.md says how every figure is computed.</p></footer>'
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>"
        + "\n".join(parts)
        + "</main></body></html>\n"
    )
