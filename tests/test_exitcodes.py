"""The one exit-code table: it covers every verdict and status, and every command's code comes from it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from sdc_forensics.exitcodes import EXIT_BY_STATUS, EXIT_BY_VERDICT, ExitCode, analysis_exit, status_exit, verdict_exit
from sdc_forensics.decide.decision import Status, Verdict

PACKAGE = Path(__file__).resolve().parents[1] / "sdc_forensics"


def test_codes_are_the_documented_ones():
    # docs/bisect.md, "Verdicts and exit codes", written out by hand
    assert [(c.name, int(c)) for c in ExitCode] == [
        ("CLEAN", 0),
        ("CORRUPTION", 1),
        ("USAGE", 2),
        ("BAD_INPUT", 3),
        ("INCONCLUSIVE", 4),
    ]
    assert {v.value: int(verdict_exit(v)) for v in Verdict} == {"clean": 0, "corruption": 1, "inconclusive": 4}
    assert {s.value: int(status_exit(s)) for s in Status} == {"clean": 0, "unverified": 4, "tainted": 1, "corrupt": 1}
    assert set(EXIT_BY_VERDICT) == {v.value for v in Verdict} and set(EXIT_BY_STATUS) == {s.value for s in Status}


def test_a_clean_answer_of_the_trace_alone_is_4():
    # issue 33: `bisect --trace-only` replays nothing, so "clean" must not read as 0 in a script
    assert {v.value: int(analysis_exit(v, "trace-only")) for v in Verdict} == {
        "clean": 4,
        "corruption": 1,
        "inconclusive": 4,
    }
    assert {v.value: int(analysis_exit(v, "replay")) for v in Verdict} == {
        "clean": 0,
        "corruption": 1,
        "inconclusive": 4,
    }


def test_no_exit_code_is_written_outside_the_table():
    """No module but exitcodes.py spells a code as a literal: ``exit_code = 4``, ``ctx.exit(1)``,
    ``sys.exit(0)``, or an ``EXIT_*`` constant of its own."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "exitcodes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    name = (
                        target.id
                        if isinstance(target, ast.Name)
                        else target.attr
                        if isinstance(target, ast.Attribute)
                        else ""
                    )
                    if (name == "exit_code" or name.startswith("EXIT_")) and isinstance(node.value, ast.Constant):
                        offenders.append(f"{path.name}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "exit"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, int)
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_the_table_imports_nothing():
    code = "import sys, sdc_forensics.exitcodes; print(sorted(m for m in sys.modules if m.startswith(('sdc_forensics.', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['sdc_forensics.exitcodes']"
