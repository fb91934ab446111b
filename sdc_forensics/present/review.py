"""The post-incident review in the format asked for: the one renderer the ``report`` command calls.

:func:`render_review` turns what the report's flow gathered (``forensics/review.py``: the incident,
the coverage, the plotted series) into the actions (``present/actions.py``) and HTML (with the plots
of ``present/plots.py`` when matplotlib is installed), Markdown or the JSON document. It reads no
file: it returns the text, the JSON document and the notes people must see on stderr (e.g. that
plots were left out).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from sdc_forensics.forensics.review import IncidentReview
from sdc_forensics.present.actions import build_actions
from sdc_forensics.present.report import PLOTS_HINT, report_document


@dataclasses.dataclass(frozen=True, kw_only=True)
class Review:
    """A rendered review: ``text`` in ``request.fmt``, the JSON ``document`` (without
    ``schema_version``), and one-line ``notes`` for stderr."""

    text: str
    document: dict[str, Any]
    notes: tuple[str, ...] = ()


def render_review(review: IncidentReview, schema_version: int) -> Review:
    """Render ``review`` as ``review.request.fmt`` (``html``, ``md`` or ``json``).

    Args:
        review: what the report's flow gathered (``forensics.review.review``).
        schema_version: stamped into the JSON text (``--format json`` to a file).
    """
    result, request, incident, end, coverage = (
        review.result,
        review.request,
        review.incident,
        review.end,
        review.coverage,
    )
    actions = build_actions(result, incident, review.job_nodes)
    document = report_document(result, incident, actions, request, end, time.time_ns(), coverage)
    if request.fmt == "json":
        return Review(
            text=json.dumps({"schema_version": schema_version, **document}, indent=2, sort_keys=True) + "\n",
            document=document,
        )
    if request.fmt == "md":
        from sdc_forensics.present.markdown import render_markdown

        return Review(
            text=render_markdown(result, review.manifest, incident, actions, request, end=end, coverage=coverage),
            document=document,
        )
    from sdc_forensics.present.html import render_html
    from sdc_forensics.present.plots import matplotlib_available, render_svg

    svg, note, notes = None, "", ()
    if not matplotlib_available():
        note = f"No plots: matplotlib is not installed ({PLOTS_HINT})."
        notes = (note,)
    elif review.series is not None:
        svg = render_svg(review.series, result)
    else:
        note = "No plots: the trace holds no step."
    html = render_html(
        result, review.manifest, incident, actions, request, plot_svg=svg, plot_note=note, end=end, coverage=coverage
    )
    return Review(text=html, document=document, notes=notes)
