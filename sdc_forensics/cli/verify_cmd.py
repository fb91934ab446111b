"""``sdc-forensics verify-checkpoint`` and ``sdc-forensics certify``.

verify-checkpoint PATH [--trace TRACE_DIR] [--step N] [--certificate FILE] [--json]
    Exit 0: the checkpoint verifies (structure, no NaN/Inf; with --trace: digests as noted at
    save time, the replicas' majority content, not after the first divergence; with
    --certificate: its files are still what was certified, and it was certified clean).
    Exit 1: readable but not certifiable. Exit 3: unreadable or malformed. Exit 2: usage.

certify TRACE_DIR [--checkpoints DIR] [--json] [--certificate-out FILE]
    Every noted checkpoint gets a status; the last clean one is the resume point.
    Exit 0 when every checkpoint is clean, 1 when any is not (the resume point is still named).

People read stderr (rich tables); ``--json`` writes one document on stdout.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from sdc_forensics.cli.output import emit_json, err
from sdc_forensics.trace.manifest import read_manifest

_MAX_ROWS = 40


def _tensor_table(report) -> Table:
    rows = sorted(report.tensors, key=lambda t: t.status == "ok")  # problems first, stable
    table = Table(title=f"{escape(report.path)} ({report.format}, {len(report.tensors)} tensors)", title_justify="left")
    for column in ("tensor", "dtype", "shape", "digest", "noted", "NaN/Inf", "status"):
        table.add_column(column)
    for t in rows[:_MAX_ROWS]:
        style = "green" if t.status == "ok" else "bold red"
        table.add_row(
            escape(t.key), t.dtype, "×".join(map(str, t.shape)) or "scalar", t.digest, t.expected_digest or "-",
            str(t.nonfinite), f"[{style}]{t.status}[/]",
        )
    if len(rows) > _MAX_ROWS:
        table.caption = f"{len(rows) - _MAX_ROWS} more tensor(s) not shown, all ok" if rows[_MAX_ROWS].status == "ok" else f"{len(rows) - _MAX_ROWS} more not shown; use --json"
    return table


def _print_findings(findings, title: str) -> None:
    for f in findings:
        extra = f" (expected {f.expected}, found {f.found})" if f.expected or f.found else ""
        err.print(f"[red]✗[/] {title}{f.kind.value} {escape(f.subject)}: {escape(f.detail)}{extra}")


@click.command("verify-checkpoint")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--trace", "trace_dir", type=click.Path(path_type=Path), help="Trace directory: compare with its checkpoint note and majority digests.")
@click.option("--step", type=click.IntRange(min=0), help="Checkpoint step N (default: from the note whose path matches, or the payload's 'step').")
@click.option("--certificate", "certificate_path", type=click.Path(path_type=Path), help="Certificate to confirm the file against.")
@click.option("--json", "as_json", is_flag=True, help="Write one JSON document on stdout.")
@click.pass_context
def verify_cmd(ctx: click.Context, path: Path, trace_dir: Path | None, step: int | None, certificate_path: Path | None, as_json: bool) -> None:
    """Verify a checkpoint's structure and content (and against a trace or a certificate)."""
    from sdc_forensics.checkpoint import VerifyOptions, open_checkpoint, verify_checkpoint
    from sdc_forensics.checkpoint.certificate import check_against_certificate, read_certificate
    from sdc_forensics.checkpoint.certify import decide
    from sdc_forensics.checkpoint.serialize import finding_to_json, report_to_json, status_to_json
    from sdc_forensics.checkpoint.trace_context import load_trace_context
    from sdc_forensics.errors import UsageError

    if step is not None and trace_dir is None:
        raise UsageError("--step needs --trace (it selects the checkpoint note to compare with)")
    trace = load_trace_context(trace_dir) if trace_dir is not None else None
    cert = read_certificate(certificate_path) if certificate_path is not None else None
    seed = trace.seed if trace else cert.seed if cert else VerifyOptions().seed
    if trace and cert and trace.seed != cert.seed:
        raise UsageError(f"the trace's fingerprint seed {trace.seed} differs from the certificate's {cert.seed}; check one at a time")
    entry = None
    if cert is not None:
        entry = cert.entry_for(path)
        if entry is None:
            raise UsageError(f"{certificate_path} has no entry for {path}; pass the certificate written when this checkpoint was certified")

    with open_checkpoint(path) as reader:
        note, missing_note = None, ""
        if trace is not None:
            wanted = step
            if wanted is None:
                named = [n for n in trace.notes if Path(n.path).name == Path(path).name]
                wanted = named[0].step if len(named) == 1 else reader.step()
            note = next((n for n in trace.notes if n.step == wanted), None)
            if note is None:
                missing_note = (
                    f"no checkpoint note for step {wanted} in {trace_dir}" if wanted is not None
                    else f"cannot tell which step {path} holds; pass --step N"
                )
        report = verify_checkpoint(reader, note=note, options=VerifyOptions(seed=seed))

    status = None
    if note is not None:
        status = decide(
            note, report=report, path=str(path), first_divergent_step=trace.first_divergent_step,
            trace_consistent=trace.consistent, majority_digest=trace.majority_digests.get(note.step),
        )
    cert_findings = check_against_certificate(report, entry) if entry is not None else []
    reasons = [f"{f.kind.value} {f.subject}: {f.detail}" for f in report.findings]
    if status is not None and not status.clean:
        reasons += [f"{status.status.value}: {r}" for r in status.reasons if r not in reasons]
    if missing_note:
        reasons.append(f"unverified against the trace: {missing_note}")
    reasons += [f"certificate: {f.kind.value} {f.subject}: {f.detail}" for f in cert_findings]
    if entry is not None and not entry.status.clean:
        reasons.append(f"certificate: it was certified {entry.status.value}, not clean")
    verified = not reasons

    err.print(_tensor_table(report))
    _print_findings(report.findings, "")
    _print_findings(cert_findings, "certificate: ")
    if report.weights_digest and note is not None:
        same = "=" if report.weights_digest == note.weights_digest else "≠"
        err.print(f"parameters' combined digest {report.weights_digest} {same} replicas' majority {note.weights_digest or '(none recorded)'}")
    if status is not None:
        err.print(f"certification: [bold]{status.status.value}[/] — {escape('; '.join(status.reasons))}")
    if trace is not None and trace.first_divergent_step is not None:
        err.print(f"first divergent step {trace.first_divergent_step} (from {trace.divergence_source})")
    gbps = report.total_bytes / report.elapsed_s / 1e9 if report.elapsed_s > 0 else 0.0
    if verified:
        err.print(f"[bold green]VERIFIED[/] {escape(str(path))} ({report.total_bytes} bytes in {report.elapsed_s:.3f} s, {gbps:.2f} GB/s)")
    else:
        err.print(f"[bold red]NOT CERTIFIABLE[/] {escape(str(path))}: {escape(reasons[0])}" + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""))
    if as_json:
        emit_json(
            {
                "command": "verify-checkpoint",
                "verdict": "verified" if verified else "not-certifiable",
                "exit_code": 0 if verified else 1,
                "reasons": reasons,
                "report": report_to_json(report),
                "certification": status_to_json(status) if status is not None else None,
                "first_divergent_step": trace.first_divergent_step if trace else None,
                "certificate": None if entry is None else {
                    "path": str(certificate_path), "status": entry.status.value, "findings": [finding_to_json(f) for f in cert_findings],
                },
            }
        )
    ctx.exit(0 if verified else 1)


@click.command("certify")
@click.argument("trace_dir", type=click.Path(path_type=Path))
@click.option("--checkpoints", "checkpoints_dir", type=click.Path(path_type=Path, file_okay=False), help="Directory holding the checkpoint files (default: the paths the job wrote).")
@click.option("--json", "as_json", is_flag=True, help="Write one JSON document on stdout.")
@click.option("--certificate-out", type=click.Path(path_type=Path, dir_okay=False), help="Write a certificate (JSON) to this file.")
@click.option("--trace-only", is_flag=True, help="Trust the trace's own evidence for the first divergent step: no replay (weaker: a fault "
              "the trace cannot see leaves later checkpoints 'clean-trace-consistent').")
@click.option("--recipe", metavar="MOD:ATTR", help="Replay recipe (default: the one the trace's manifest names).")
@click.option("--device", default="cpu", show_default=True, help="Replay device: cpu, cuda or cuda:N.")
@click.pass_context
def certify_cmd(ctx: click.Context, trace_dir: Path, checkpoints_dir: Path | None, as_json: bool, certificate_out: Path | None,
                trace_only: bool, recipe: str | None, device: str) -> None:
    """Certify every checkpoint of a run and name the last clean one (the resume point).

    The first divergent step comes from the same analysis as ``bisect`` (trace evidence, then a
    replay of the smallest confirming window), so a fault the trace alone cannot see still taints
    the checkpoints after it. With --trace-only, or when the trace names no recipe, the trace's
    own evidence is used and the output says so.
    """
    from sdc_forensics.checkpoint import VerifyOptions
    from sdc_forensics.checkpoint.certificate import build_certificate, write_certificate
    from sdc_forensics.checkpoint.certify import certify_checkpoints, last_clean, unnoted_checkpoints
    from sdc_forensics.checkpoint.serialize import status_to_json
    from sdc_forensics.checkpoint.trace_context import load_trace_context
    from sdc_forensics.errors import UsageError

    if checkpoints_dir is not None and not checkpoints_dir.is_dir():
        raise UsageError(f"--checkpoints {checkpoints_dir} is not a directory")
    statuses = None
    if trace_only or not (recipe or read_manifest(trace_dir).recipe):
        if not trace_only:
            err.print("[yellow]the trace names no replay recipe[/]: certifying from the trace's evidence alone (pass --recipe to replay)")
        trace = load_trace_context(trace_dir)
    else:
        from sdc_forensics.forensics.bisect import BisectOptions, bisect

        from sdc_forensics.cli.bisect_cmd import _Bars

        with _Bars(enabled=err.is_terminal) as bars:
            result = bisect(trace_dir, BisectOptions(checkpoints_dir=checkpoints_dir, recipe=recipe, device=device), progress=bars)
        first = result.first_divergent_step
        by_replay = any(e.step == first and e.source == "replay" for e in result.evidence)
        source = "none" if first is None else "replay" if by_replay else "triage"
        trace = load_trace_context(trace_dir, divergence=(result.first_divergent_step, source))
        if result.certification:  # bisect verified every noted file already: do not read them twice
            statuses = list(result.certification)
    if statuses is None:
        statuses = certify_checkpoints(
            trace.notes,
            checkpoints=checkpoints_dir,
            first_divergent_step=trace.first_divergent_step,
            trace_consistent=trace.consistent,
            majority_digests=trace.majority_digests,
            base_dir=trace_dir.parent,
            options=VerifyOptions(seed=trace.seed),
        )
    resume = last_clean(statuses)
    folders = {checkpoints_dir} if checkpoints_dir is not None else {Path(s.path).parent for s in statuses if s.path}
    unnoted = [path for folder in sorted(folders) for path in unnoted_checkpoints(trace.notes, folder)]
    table = Table(title=f"checkpoints of {escape(str(trace_dir))}", title_justify="left")
    for column in ("step", "status", "path", "reasons"):
        table.add_column(column)
    for s in statuses:
        style = "green" if s.clean else "yellow" if s.status.value in ("tainted", "unverified") else "bold red"
        table.add_row(str(s.step), f"[{style}]{s.status.value}[/]", escape(Path(s.path).name if s.path else "(not found)"), escape("; ".join(s.reasons)))
    err.print(table)
    for line in trace.damage:
        err.print(f"[yellow]trace damage:[/] {escape(line)}")
    for path in unnoted:
        err.print(f"[yellow]unverified:[/] {escape(str(path))} has no checkpoint note in the trace; nothing can be certified about it")
    divergence = "none found" if trace.first_divergent_step is None else f"{trace.first_divergent_step} (from {trace.divergence_source})"
    err.print(f"first divergent step: {divergence}")
    if not statuses:
        err.print("[bold red]no checkpoint notes[/] in this trace: nothing to certify")
    elif resume is None:
        err.print("[bold red]no clean checkpoint[/]: none can be resumed from safely")
    else:
        err.print(f"[bold green]resume from step {resume.step}[/]: {escape(resume.path)} ({resume.status.value})")
    if certificate_out is not None:
        cert = build_certificate(statuses, trace_dir=trace_dir, first_divergent_step=trace.first_divergent_step, seed=trace.seed)
        write_certificate(certificate_out, cert)
        err.print(f"certificate written to {escape(str(certificate_out))}")
    all_clean = bool(statuses) and all(s.clean for s in statuses)
    if as_json:
        emit_json(
            {
                "command": "certify",
                "trace_dir": str(trace_dir),
                "first_divergent_step": trace.first_divergent_step,
                "divergence_source": trace.divergence_source,
                "trace_consistent": trace.consistent,
                "trace_damage": list(trace.damage),
                "checkpoints": [status_to_json(s) for s in statuses],
                "unnoted": [str(p) for p in unnoted],
                "resume_step": resume.step if resume else None,
                "resume_path": resume.path if resume else None,
                "certificate": str(certificate_out) if certificate_out else None,
                "exit_code": 0 if all_clean else 1,
            }
        )
    ctx.exit(0 if all_clean else 1)
