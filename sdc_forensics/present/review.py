"""The post-incident review in the format asked for: the one entry the ``report`` command calls.

:func:`render_review` opens the trace once, builds the incident (``decide/incident.py``) and
the actions (``present/actions.py``), and renders HTML (with the plots of ``present/plots.py``
when matplotlib is installed), Markdown or the JSON document. It returns the text, the JSON
document and the notes people must see on stderr (e.g. that plots were left out).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from sdc_forensics.decide.incident import build_incident
from sdc_forensics.decide.verdict import BisectResult
from sdc_forensics.present.actions import build_actions
from sdc_forensics.present.report import PLOTS_HINT, ReportRequest, report_document
from sdc_forensics.trace.reader import Trace


@dataclasses.dataclass(frozen=True, kw_only=True)
class Review:
    """A rendered review: ``text`` in ``request.fmt``, the JSON ``document`` (without
    ``schema_version``), and one-line ``notes`` for stderr."""

    text: str
    document: dict[str, Any]
    notes: tuple[str, ...] = ()


def render_review(result: BisectResult, request: ReportRequest, schema_version: int, trace: Trace | None = None) -> Review:
    """Render ``result`` as ``request.fmt`` (``html``, ``md`` or ``json``).

    Args:
        result: what the analysis concluded about ``request.trace_dir``.
        request: the invocation (format, paths and options, for the reproduce commands).
        schema_version: stamped into the JSON text (``--format json`` to a file).
        trace: the trace the analysis read (the command opens it once); None: opened here.
    """
    trace = Trace.of(trace if trace is not None else request.trace_dir)
    request = dataclasses.replace(request, manifest_recipe=trace.manifest.recipe)
    end = trace.run_end()
    incident = build_incident(result, trace)
    job_nodes = tuple(dict.fromkeys(i.slurm_node or i.k8s_node or i.host for a in trace.manifest.attempts for i in a.ranks if i.host))
    actions = build_actions(result, incident, job_nodes)
    coverage = _coverage(result, trace, request)
    document = report_document(result, incident, actions, request, end, time.time_ns(), coverage)
    if request.fmt == "json":
        return Review(text=json.dumps({"schema_version": schema_version, **document}, indent=2, sort_keys=True) + "\n", document=document)
    if request.fmt == "md":
        from sdc_forensics.present.markdown import render_markdown

        return Review(text=render_markdown(result, trace.manifest, incident, actions, request, end=end, coverage=coverage), document=document)
    from sdc_forensics.present.series import incident_series, plot_window
    from sdc_forensics.present.html import render_html
    from sdc_forensics.present.plots import matplotlib_available, render_svg

    svg, note, notes = None, "", ()
    window = plot_window(trace.step_range(), result.first_divergent_step)
    if not matplotlib_available():
        note = f"No plots: matplotlib is not installed ({PLOTS_HINT})."
        notes = (note,)
    elif window is not None:
        svg = render_svg(incident_series(trace, window), result)
    else:
        note = "No plots: the trace holds no step."
    html = render_html(result, trace.manifest, incident, actions, request, plot_svg=svg, plot_note=note, end=end, coverage=coverage)
    return Review(text=html, document=document, notes=notes)


def _coverage(result: BisectResult, trace: Trace, request) -> tuple:
    """The coverage of ``result``'s checkpoints with the online checks and the replay cost (the ledger's records measure it)."""
    from sdc_forensics.decide.coverage import coverage_of, ledger_records, with_details

    options = request.options
    return with_details(coverage_of(result), trace, ledger_records(trace.path, options.ledger_path, options.no_ledger))
