"""The post-incident review's flow (``sdc-forensics report``): from the analysis to the facts its review states.

``report`` runs the analysis (``bisect``) on the trace it opened once, then :func:`review` gathers,
from the same open trace and the ledger, what the review says about it: the incident
(``decide/incident.py``: times, losses, nodes to act on), the job's nodes, how the run ended, what
examined the steps before each checkpoint (``decide/coverage.py``, with the replay cost measured on
the ledger's records: ``intervals.ledger_records``) and, for HTML, the per-step series its plots
draw (``triage/series.py``). ``present/review.py`` renders the result as HTML, Markdown or JSON and
reads nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sdc_forensics.decide.coverage import Coverage, coverage_of, with_details
from sdc_forensics.decide.incident import Incident, build_incident
from sdc_forensics.decide.verdict import BisectResult
from sdc_forensics.forensics.intervals import ledger_records
from sdc_forensics.replay.options import AnalysisOptions
from sdc_forensics.trace.ends import RunEnd
from sdc_forensics.trace.manifest import Manifest
from sdc_forensics.trace.reader import Trace
from sdc_forensics.triage.series import Series, incident_series, plot_window

__all__ = ["IncidentReview", "ReportRequest", "review"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportRequest:
    """The ``report`` invocation, as given (paths absolute).

    Attributes:
        trace_dir: the trace analysed.
        output: the review's file, or ``-``.
        fmt: ``html``, ``md`` or ``json``.
        options: the analysis options the user chose (``checkpoints_dir`` absolute).
        manifest_recipe: the recipe the trace names.
    """

    trace_dir: Path
    output: str = "-"
    fmt: str = "md"
    options: AnalysisOptions = AnalysisOptions()
    # the recipe the trace names (used when --recipe is not given)
    manifest_recipe: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class IncidentReview:
    """What a post-incident review states, gathered from the analysis, the trace and the ledger.

    Attributes:
        result: the analysis (``bisect``).
        request: the invocation, with the recipe the trace names (``manifest_recipe``).
        manifest: the trace's manifest (the run, its ranks and versions).
        incident: :func:`~sdc_forensics.decide.incident.build_incident` of ``result``.
        job_nodes: every node the job ran on, in the order the manifest names them.
        end: how the run ended (``trace.ends.RunEnd``), or None.
        coverage: per checkpoint, what examined the steps before it, with the online checks and the replay cost.
        series: the per-step values the HTML plots draw (None: not HTML, or the trace holds no step).
    """

    result: BisectResult
    request: ReportRequest
    manifest: Manifest
    incident: Incident
    job_nodes: tuple[str, ...]
    end: RunEnd | None
    coverage: tuple[Coverage, ...]
    series: Series | None = None


def review(result: BisectResult, request: ReportRequest, trace: Trace | None = None) -> IncidentReview:
    """Gather what the review of ``result`` states.

    Args:
        result: what the analysis concluded about ``request.trace_dir``.
        request: the invocation (format, paths and options, for the reproduce commands).
        trace: the trace the analysis read (the command opens it once); None: opened here.
    """
    trace = Trace.of(trace if trace is not None else request.trace_dir)
    request = dataclasses.replace(request, manifest_recipe=trace.manifest.recipe)
    end = trace.run_end()
    incident = build_incident(result, trace)
    job_nodes = tuple(
        dict.fromkeys(i.slurm_node or i.k8s_node or i.host for a in trace.manifest.attempts for i in a.ranks if i.host)
    )
    options = request.options
    coverage = with_details(
        coverage_of(result), trace, ledger_records(trace.path, options.ledger_path, options.no_ledger)
    )
    series = None
    # only the HTML review has plots
    if request.fmt == "html":
        window = plot_window(trace.step_range(), result.first_divergent_step)
        series = incident_series(trace, window) if window is not None else None
    return IncidentReview(
        result=result,
        request=request,
        manifest=trace.manifest,
        incident=incident,
        job_nodes=job_nodes,
        end=end,
        coverage=coverage,
        series=series,
    )
