"""``sdc-forensics verify-checkpoint`` and ``sdc-forensics certify``.

verify-checkpoint PATH [--trace TRACE_DIR [--trace-only] [replay options]] [--certificate FILE] [--json] [read limits]
    Without --trace: the file's structure and content (readable, every file of a folder read or
    listed, no NaN/Inf): exit 0 VERIFIED, 1 not, 3 unreadable. This says nothing about the run.
    With --trace: the same analysis as ``certify`` (replay included; ``--trace-only`` for the
    trace's evidence alone), with PATH standing for its checkpoint, and the checkpoint's status
    from ``forensics.decision``: exit 0 only when it is certified clean, 1 corrupt or tainted,
    4 unverified (nothing wrong found, but not every step before it examined).
    With --certificate: its files are still what was certified, and it was certified clean.

certify TRACE_DIR [--checkpoints DIR] [--json] [--certificate-out FILE] [replay options] [read limits]
    Every noted checkpoint gets a status; the last clean one is the resume point.
    Exit 0 when every checkpoint is clean, 1 when any is corrupt or tainted, 4 when none is but
    some stay unverified.

Read limits (``cli/limits.py``, also on ``bisect``): ``--max-inflate-bytes``, ``--max-tensors``,
``--allow-root DIR``, ``--allow-numpy``; a file beyond them is refused with exit 3 and a line
naming the option that raises the limit.

People read stderr (rich tables); ``--json`` writes one document on stdout.
"""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from sdc_forensics.cli.common import analysis_options, run_analysis
from sdc_forensics.cli.limits import read_limit_options
from sdc_forensics.cli.output import emit_json, err

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


def status_exit(result) -> int:
    """0 every checkpoint clean, 1 any corrupt or tainted (or, with none noted, corruption found),
    4 otherwise (some unverified, none bad; or nothing to certify)."""
    from sdc_forensics.forensics.decision import Status, Verdict

    statuses = result.checkpoints
    if any(s.status in (Status.CORRUPT, Status.TAINTED) for s in statuses) or (not statuses and result.verdict is Verdict.CORRUPTION):
        return 1
    return 0 if statuses and all(s.clean for s in statuses) else 4


@click.command("verify-checkpoint")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--trace", "trace_dir", type=click.Path(path_type=Path), help="Trace directory: certify it as part of that run (runs the analysis of certify).")
@click.option("--step", type=click.IntRange(min=0), help="Checkpoint step N (default: from the note whose path matches, or the payload's 'step').")
@click.option("--trace-only", is_flag=True, help="With --trace: the trace's evidence alone, no replay (a clean answer is then 'unverified').")
@click.option("--certificate", "certificate_path", type=click.Path(path_type=Path), help="Certificate to confirm the file against.")
@click.option("--json", "as_json", is_flag=True, help="Write one JSON document on stdout.")
@analysis_options
@read_limit_options
@click.pass_context
def verify_cmd(ctx: click.Context, path: Path, trace_dir: Path | None, step: int | None, trace_only: bool, certificate_path: Path | None,
               as_json: bool, **replay) -> None:
    """Verify a checkpoint's structure and content; with --trace, certify it as part of its run."""
    from sdc_forensics.checkpoint import VerifyOptions, open_checkpoint, verify_checkpoint
    from sdc_forensics.checkpoint.serialize import finding_to_json, report_to_json
    from sdc_forensics.errors import UsageError
    from sdc_forensics.forensics.certificate import check_against_certificate, read_certificate
    from sdc_forensics.forensics.decision import UNVERIFIABLE_FINDINGS, Status
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes
    from sdc_forensics.trace.manifest import read_manifest

    if (step is not None or trace_only) and trace_dir is None:
        raise UsageError("--step and --trace-only need --trace (they select the run to certify against)")
    cert = read_certificate(certificate_path) if certificate_path is not None else None
    seed = cert.seed if cert else VerifyOptions().seed
    if trace_dir is not None:
        trace_seed = int(read_manifest(trace_dir).fingerprint.seed)
        if cert and trace_seed != cert.seed:
            raise UsageError(f"the trace's fingerprint seed {trace_seed} differs from the certificate's {cert.seed}; check one at a time")
        seed = trace_seed
    entry = None
    if cert is not None:
        entry = cert.entry_for(path)
        if entry is None:
            raise UsageError(f"{certificate_path} has no entry for {path}; pass the certificate written when this checkpoint was certified")

    notes = read_checkpoint_notes(trace_dir) if trace_dir is not None else []
    with open_checkpoint(path) as reader:
        wanted = step
        if trace_dir is not None and wanted is None:
            named = [n for n in notes if Path(n.path).name == Path(path).name]
            wanted = named[0].step if len(named) == 1 else reader.step()
        noted = wanted is not None and any(n.step == wanted for n in notes)
        # with a note and files read, the analysis verifies the file against its note: read it once
        report = None if noted and not trace_only else verify_checkpoint(reader, options=VerifyOptions(seed=seed))

    status, result, missing = None, None, ""
    if trace_dir is not None:
        if wanted is None:
            raise UsageError(f"cannot tell which step {path} holds (no note names this file, no 'step' in it): pass --step N")
        if not noted:
            missing = f"no checkpoint note for step {wanted} in {trace_dir}"
        else:
            result = run_analysis(trace_dir, trace_only=trace_only, checkpoint_paths={wanted: path}, **replay)
            status = next(c for c in result.checkpoints if c.step == wanted)
            if status.report is not None:
                report = status.report  # read against its note (tensor digests as saved)
    if report is None:  # the analysis could not read it (its status says why): the file's own findings
        report = verify_checkpoint(path, options=VerifyOptions(seed=seed))
    cert_findings = check_against_certificate(report, entry) if entry is not None else []
    reasons = [f"{f.kind.value} {f.subject}: {f.detail}" for f in report.findings]
    if status is not None and not status.clean:
        reasons += [f"{status.status.value}: {r}" for r in status.reasons if r not in reasons]
    if missing:
        reasons.append(f"not certified against the trace: {missing}")
    reasons += [f"certificate: {f.kind.value} {f.subject}: {f.detail}" for f in cert_findings]
    if entry is not None and not entry.status.clean:
        reasons.append(f"certificate: it was certified {entry.status.value}, not clean")
    damaged = [f for f in report.findings if f.kind.value not in UNVERIFIABLE_FINDINGS]
    if cert_findings or (entry is not None and not entry.status.clean):
        code = 1
    elif status is not None:  # the one decision: clean 0, unverified 4, tainted or corrupt 1
        code = {Status.CLEAN: 0, Status.UNVERIFIED: 4}.get(status.status, 1)
    elif missing:
        code = 1 if damaged else 4
    else:
        code = 1 if report.findings else 0

    err.print(_tensor_table(report))
    _print_findings(report.findings, "")
    _print_findings(cert_findings, "certificate: ")
    if status is not None:
        err.print(f"certification: [bold]{status.status.value}[/] — {escape('; '.join(status.reasons))}")
    if result is not None:
        err.print(f"first divergent step: {'none found' if result.first_divergent_step is None else result.first_divergent_step}"
                  f" ({result.verdict.value}; {escape(result.scope)})")
        for line in result.settle:
            err.print(f"[yellow]to settle:[/] {escape(line)}")
    gbps = report.total_bytes / report.elapsed_s / 1e9 if report.elapsed_s > 0 else 0.0
    verdict = {0: "verified" if trace_dir is None else "certified-clean", 1: "not-certifiable", 4: "unverified"}[code]
    if code == 0:
        what = "VERIFIED" if trace_dir is None else "CERTIFIED CLEAN"
        err.print(f"[bold green]{what}[/] {escape(str(path))} ({report.total_bytes} bytes in {report.elapsed_s:.3f} s, {gbps:.2f} GB/s)"
                  + ("" if trace_dir is not None or entry is not None else ": structure and content only; pass --trace to certify it as part of its run"))
    elif code == 4:
        err.print(f"[bold yellow]NOT CERTIFIED[/] {escape(str(path))}: nothing wrong found, but {escape(reasons[0])}"
                  + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""))
    else:
        err.print(f"[bold red]NOT CERTIFIABLE[/] {escape(str(path))}: {escape(reasons[0])}" + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""))
    if as_json:
        emit_json(
            {
                "command": "verify-checkpoint",
                "verdict": verdict,
                "exit_code": code,
                "reasons": reasons,
                "report": report_to_json(report),
                "certification": status.to_json() if status is not None else None,
                "first_divergent_step": result.first_divergent_step if result else None,
                "analysis": None if result is None else {"verdict": result.verdict.value, "mode": result.mode, "scope": result.scope,
                                                         "settle": list(result.settle)},
                "certificate": None if entry is None else {
                    "path": str(certificate_path), "status": entry.status.value, "findings": [finding_to_json(f) for f in cert_findings],
                },
            }
        )
    ctx.exit(code)


@click.command("certify")
@click.argument("trace_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Write one JSON document on stdout.")
@click.option("--certificate-out", type=click.Path(path_type=Path, dir_okay=False), help="Write a certificate (JSON) to this file.")
@click.option("--trace-only", is_flag=True, help="The trace's evidence alone: no replay, no files read (no checkpoint is then certified clean).")
@click.option("--max-replay-steps", type=click.IntRange(min=1), help="Replay at most this many steps (checkpoints before stay unverified).")
@analysis_options
@read_limit_options
@click.pass_context
def certify_cmd(ctx: click.Context, trace_dir: Path, as_json: bool, certificate_out: Path | None, trace_only: bool, **replay) -> None:
    """Certify every checkpoint of a run and name the last clean one (the resume point).

    The same analysis as ``bisect``: trace evidence, then a replay of every step before each
    checkpoint, so a fault the trace alone cannot see still taints the checkpoints after it. A
    checkpoint is clean only when its file is as saved, holds the replicas' majority weights and
    no NaN/Inf, and every step before it was examined and found clean.
    """
    from sdc_forensics.checkpoint.locate import unnoted_checkpoints
    from sdc_forensics.errors import UsageError
    from sdc_forensics.forensics.certificate import build_certificate, write_certificate
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes

    checkpoints_dir = replay.get("checkpoints_dir")
    if checkpoints_dir is not None and not checkpoints_dir.is_dir():
        raise UsageError(f"--checkpoints {checkpoints_dir} is not a directory")
    result = run_analysis(trace_dir, trace_only=trace_only, **replay)
    statuses = list(result.checkpoints)
    resume = result.last_clean_checkpoint
    notes = read_checkpoint_notes(trace_dir)
    folders = {checkpoints_dir} if checkpoints_dir is not None else {Path(s.path).parent for s in statuses if s.path}
    unnoted = [p for folder in sorted(folders) if folder.is_dir() for p in unnoted_checkpoints(notes, folder)]
    table = Table(title=f"checkpoints of {escape(str(trace_dir))}", title_justify="left")
    for column in ("step", "status", "path", "reasons"):
        table.add_column(column)
    for s in statuses:
        style = {"clean": "green", "unverified": "yellow"}.get(s.status.value, "bold red")
        table.add_row(str(s.step), f"[{style}]{s.status.value}[/]", escape(Path(s.path).name if s.path else "(not read)"), escape("; ".join(s.reasons)))
    err.print(table)
    for line in result.damage:
        err.print(f"[yellow]trace damage:[/] {escape(line)}")
    for path in unnoted:
        err.print(f"[yellow]unverified:[/] {escape(str(path))} has no checkpoint note in the trace; nothing can be certified about it")
    err.print(f"analysis: {result.verdict.value}; first divergent step: "
              f"{'none found' if result.first_divergent_step is None else result.first_divergent_step}; {escape(result.scope)}")
    for line in result.settle:
        err.print(f"[yellow]to settle:[/] {escape(line)}")
    if not statuses:
        err.print("[bold red]no checkpoint notes[/] in this trace: nothing to certify")
    elif resume is None:
        err.print("[bold red]no checkpoint certified clean[/]: none can be resumed from safely")
    else:
        err.print(f"[bold green]resume from step {resume.step}[/]: {escape(resume.path)} ({resume.status.value})")
    if certificate_out is not None:
        cert = build_certificate(statuses, trace_dir=trace_dir, first_divergent_step=result.first_divergent_step, seed=result.seed)
        write_certificate(certificate_out, cert)
        err.print(f"certificate written to {escape(str(certificate_out))}")
    code = status_exit(result)
    if as_json:
        emit_json(
            {
                "command": "certify",
                "trace_dir": str(trace_dir),
                "verdict": result.verdict.value,
                "first_divergent_step": result.first_divergent_step,
                "mode": result.mode,
                "scope": result.scope,
                "settle": list(result.settle),
                "trace_damage": list(result.damage),
                "checkpoints": [s.to_json() for s in statuses],
                "unnoted": [str(p) for p in unnoted],
                "resume_step": resume.step if resume else None,
                "resume_path": resume.path if resume else None,
                "certificate": str(certificate_out) if certificate_out else None,
                "exit_code": code,
            }
        )
    ctx.exit(code)
