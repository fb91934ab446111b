"""A handful of hostile inputs of every kind through the real CLI (``click.testing.CliRunner`` on
``sdc_forensics.cli.main.cli``), drawn from the same strategies as the in-process properties.

Each input is first read in-process (``tests/fuzz/readers.py``); the CLI must then give exactly
the exit code ``cli/main.py`` and the command document for that outcome: a documented error
(``SdcError``, whose ``exit_code`` is 3 for every reader error) is one ``error:`` line on stderr,
nothing on stdout, that exit code; a result is the command's own code (``verify-checkpoint``: 0
when the report has no finding, else 1; ``inspect``: 0; ``bisect``: 0 clean, 1 corruption, 4
inconclusive; ``--certificate``: 2 when it has no entry for the file, 1 when a file changed or it
was not certified clean). Never a traceback; the input unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from hypothesis import given, settings

from sdc_forensics.cli.main import cli
from sdc_forensics.errors import SdcError
from sdc_forensics.exitcodes import ExitCode
from tests.factories import tree_sha256
from tests.fuzz import test_fuzz_certificate, test_fuzz_dcp, test_fuzz_pt, test_fuzz_safetensors, test_fuzz_trace
from tests.fuzz.conftest import CLI_EXAMPLES
from tests.fuzz.readers import read_certificate_for, read_trace, verify

EXIT_BY_VERDICT = {
    "clean": 0,
    "corruption": 1,
    "inconclusive": 4,
}  # exitcodes.EXIT_BY_VERDICT, written out: the contract


def _expect(call) -> tuple[int | None, object]:
    """``(exit code of the documented error, None)`` or ``(None, result)`` of the in-process call."""
    try:
        return None, call()
    except SdcError as exc:
        return exc.exit_code, None


def run_cli(args: list[str], watch: Path, expected_code: int, refused: bool) -> None:
    """The CLI on a hostile input: ``expected_code``, one ``error:`` line when ``refused``, no traceback."""
    before = tree_sha256(watch)
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert result.exit_code == expected_code, (result.exit_code, expected_code, result.stderr[-800:])
    if refused:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-800:]
        assert result.stdout == ""
    assert tree_sha256(watch) == before


def _checkpoint(folder: Path, path: Path) -> None:
    from sdc_forensics.decide.decision import UNVERIFIABLE_FINDINGS

    code, report = _expect(lambda: verify(path))
    if code is None:
        # damage or NaN/Inf 1; only files it could not verify 4 (nothing wrong found); none 0
        damaged = any(f.kind not in UNVERIFIABLE_FINDINGS for f in report.findings)
        code = 1 if damaged else 4 if report.findings else 0
        run_cli(["verify-checkpoint", path], folder, code, False)
        return
    run_cli(["verify-checkpoint", path], folder, code, True)


@settings(max_examples=CLI_EXAMPLES)
@given(case=test_fuzz_pt.mutated_files())
def test_cli_verify_checkpoint_pt(scratch, case):
    with scratch() as folder:
        (folder / case[0]).write_bytes(case[1])
        _checkpoint(folder, folder / case[0])


@settings(max_examples=CLI_EXAMPLES)
@given(case=test_fuzz_pt.crafted_archives())
def test_cli_verify_checkpoint_crafted_pt(scratch, case):
    with scratch() as folder:
        (folder / "x.pt").write_bytes(test_fuzz_pt._archive(*case))
        _checkpoint(folder, folder / "x.pt")


@settings(max_examples=CLI_EXAMPLES)
@given(raw=test_fuzz_safetensors.consistent_files())
def test_cli_verify_checkpoint_safetensors(scratch, raw):
    with scratch() as folder:
        (folder / "x.safetensors").write_bytes(raw)
        _checkpoint(folder, folder / "x.safetensors")


@settings(max_examples=CLI_EXAMPLES)
@given(files=test_fuzz_dcp.mutated_file(test_fuzz_dcp.DATA))
def test_cli_verify_checkpoint_dcp(scratch, files):
    with scratch() as folder:
        _checkpoint(folder, test_fuzz_dcp._write(folder, files))


@settings(max_examples=CLI_EXAMPLES)
@given(files=test_fuzz_trace.mutated_rank_file())
def test_cli_inspect_and_bisect_trace(scratch, files):
    with scratch() as folder:
        trace = folder / "trace"
        trace.mkdir()
        for name, raw in files.items():
            (trace / name).parent.mkdir(parents=True, exist_ok=True)
            (trace / name).write_bytes(raw)
        code, result = _expect(lambda: read_trace(trace))
        run_cli(["inspect", trace], folder, code if code is not None else 0, code is not None)
        # --trace-only: the verdict's code, but a clean verdict of the trace alone is 4 (nothing replayed)
        expected = code if code is not None else (4 if result[1] == "clean" else EXIT_BY_VERDICT[result[1]])
        run_cli(["bisect", trace, "--trace-only"], folder, expected, code is not None)


@settings(max_examples=CLI_EXAMPLES)
@given(edits=test_fuzz_certificate.json_edits(3, values=test_fuzz_certificate._VALUES))
def test_cli_verify_checkpoint_certificate(scratch, edits):
    from sdc_forensics.decide.certificate import read_certificate

    with scratch() as folder:
        checkpoint = folder / test_fuzz_certificate.CHECKPOINT
        checkpoint.write_bytes(test_fuzz_certificate.checkpoint_bytes())
        cert = folder / "cert.json"
        cert.write_text(json.dumps(test_fuzz_certificate.edit_json(test_fuzz_certificate.certificate(folder), edits)))
        code, findings = _expect(lambda: read_certificate_for(cert, checkpoint))
        if code is None:
            entry = read_certificate(cert).entry_for(checkpoint)
            code = (
                ExitCode.USAGE
                if entry is None
                else (1 if findings or not entry.status.clean or not verify(checkpoint).ok else 0)
            )
            refused = entry is None
        else:
            refused = True
        run_cli(["verify-checkpoint", checkpoint, "--certificate", cert], folder, code, refused)
