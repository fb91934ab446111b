"""JSON-ready dicts of verification and certification results (for ``--json`` and reports).

Enums become their string values; tensors' shapes become lists. Keys are stable; the CLI adds
``schema_version`` when it emits the document.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sdc_forensics.checkpoint.verify import Finding, TensorResult, VerificationReport


def finding_to_json(finding: Finding) -> dict[str, Any]:
    """One finding."""
    return finding.to_json()


def tensor_to_json(result: TensorResult) -> dict[str, Any]:
    """One tensor's measurements."""
    return {
        "key": result.key,
        "dtype": result.dtype,
        "shape": list(result.shape),
        "file": result.file,
        "digest": result.digest,
        "expected_digest": result.expected_digest,
        "nonfinite": result.nonfinite,
        "status": result.status,
    }


def report_to_json(report: VerificationReport) -> dict[str, Any]:
    """A whole verification report."""
    return {
        "path": report.path,
        "format": report.format,
        "step": report.step,
        "ok": report.ok,
        "noted": report.noted,
        "seed": report.seed,
        "weights_digest": report.weights_digest,
        "total_bytes": report.total_bytes,
        "elapsed_s": round(report.elapsed_s, 6),
        "files": [dataclasses.asdict(f) for f in report.files],
        "tensors": [tensor_to_json(t) for t in report.tensors],
        "findings": [finding_to_json(f) for f in report.findings],
        "unverifiable": list(report.unverifiable),
        "ignored": list(report.ignored),
    }
