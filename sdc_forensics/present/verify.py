"""Renderers of a :class:`~sdc_forensics.forensics.verify_run.VerifyOutcome`: the tensor table,
findings and verdict for people, the ``verify-checkpoint --json`` document for programs."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from sdc_forensics.checkpoint.serialize import finding_to_json, report_to_json
from sdc_forensics.exitcodes import ExitCode
from sdc_forensics.forensics.verify_run import VerifyOutcome
from sdc_forensics.present.text import count_text, new_table, rate_text

_MAX_ROWS = 40


def verify_document(outcome: VerifyOutcome) -> dict[str, Any]:
    """The ``verify-checkpoint --json`` document (docs/json.md; ``schema_version`` is added by the emitter)."""
    result, request = outcome.analysis, outcome.request
    return {
        "command": "verify-checkpoint",
        "verdict": outcome.verdict,
        "exit_code": outcome.exit_code,
        "reasons": list(outcome.reasons),
        "report": report_to_json(outcome.report),
        "certification": outcome.status.to_json() if outcome.status is not None else None,
        "first_divergent_step": result.first_divergent_step if result else None,
        "analysis": None
        if result is None
        else {
            "verdict": result.verdict.value,
            "mode": result.mode,
            "scope": result.scope,
            "settle": list(result.settle),
        },
        "certificate": None
        if outcome.certificate_status is None
        else {
            "path": str(request.certificate_path),
            "status": outcome.certificate_status.value,
            "findings": [finding_to_json(f) for f in outcome.certificate_findings],
        },
    }


def render_verify(outcome: VerifyOutcome, console) -> None:
    """Print the tensors (problems first), the findings, the certification and the verdict line."""
    report, status, result = outcome.report, outcome.status, outcome.analysis
    console.print(_tensor_table(report, console))
    _print_findings(console, report.findings, "")
    _print_findings(console, outcome.certificate_findings, "certificate: ")
    # no training state in them (docs/checkpoints.md): said, not held against the folder
    if report.ignored:
        console.print(f"[dim]not read (no training state): {escape(', '.join(report.ignored))}[/]")
    if status is not None:
        console.print(f"certification: [bold]{status.status.value}[/] — {escape('; '.join(status.reasons))}")
    if result is not None:
        console.print(
            f"first divergent step: {'none found' if result.first_divergent_step is None else result.first_divergent_step}"
            f" ({result.verdict.value}; {escape(result.scope)})"
        )
        for line in result.settle:
            console.print(f"[yellow]to settle:[/] {escape(line)}")
    path, reasons = escape(str(outcome.request.path)), outcome.reasons
    with_trace = outcome.request.trace_dir is not None
    if outcome.exit_code == ExitCode.CLEAN:
        what = "CERTIFIED CLEAN" if with_trace else "VERIFIED"
        size = f"{count_text(report.total_bytes, 'byte')} in {report.elapsed_s:.3f} s, {rate_text(report.total_bytes, report.elapsed_s)}"
        if outcome.certificate_status is not None:
            against = (
                f"; every file matches {escape(str(outcome.request.certificate_path))}, "
                f"which certified it {outcome.certificate_status.value}"
            )
        elif with_trace:
            against = ""
        else:
            against = ": structure and content only; pass --trace to certify it as part of its run"
        console.print(f"[bold green]{what}[/] {path} ({size}){against}")
        return
    if outcome.exit_code == ExitCode.UNVERIFIED:
        what = "NOT CERTIFIED" if with_trace else "NOT VERIFIED"
        console.print(f"[bold yellow]{what}[/] {path}: nothing wrong found, but {escape(reasons[0])}")
    else:
        console.print(f"[bold red]NOT CERTIFIABLE[/] {path}: {escape(reasons[0])}")
    # every reason, each on its line: a certificate's is never hidden behind "+1 more"
    for reason in reasons[1:]:
        console.print(f"  also: {escape(reason)}")


def _tensor_table(report, console):
    # problems first, stable
    rows = sorted(report.tensors, key=lambda t: t.status == "ok")
    table = new_table(
        console,
        f"{escape(report.path)} ({report.format}, {len(report.tensors)} tensor{'' if len(report.tensors) == 1 else 's'})",
        ("tensor", "dtype", "shape", "digest", "noted", "NaN/Inf", "status"),
    )
    for t in rows[:_MAX_ROWS]:
        style = "green" if t.status == "ok" else "bold red"
        table.add_row(
            escape(t.key),
            t.dtype,
            "×".join(map(str, t.shape)) or "scalar",
            t.digest,
            t.expected_digest or "-",
            str(t.nonfinite),
            f"[{style}]{t.status}[/]",
        )
    if len(rows) > _MAX_ROWS:
        table.caption = (
            f"{len(rows) - _MAX_ROWS} more tensor(s) not shown, all ok"
            if rows[_MAX_ROWS].status == "ok"
            else f"{len(rows) - _MAX_ROWS} more not shown; use --json"
        )
    return table


def _print_findings(console, findings, title: str) -> None:
    for f in findings:
        extra = f" (expected {f.expected}, found {f.found})" if f.expected or f.found else ""
        console.print(f"[red]✗[/] {title}{f.kind.value} {escape(f.subject)}: {escape(f.detail)}{extra}")
