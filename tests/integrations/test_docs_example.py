"""The Hugging Face example of docs/integrations.md is a whole training script a user copies:
read out of the page (so page and test cannot drift), run as a 2-process gloo job, one
``python`` per rank as a launcher starts them, and certified with the installed command as the
page says. Its model (GPT-2 from a config, forward with ``**kwargs``) takes the Trainer's
item-normalised loss path, so this also checks that the step header carries the item count.
Every adapter's example shows ``exit_on_alarm`` around training (checked without running them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli.installed import run_installed
from tests.integrations.launch import assert_ok, run_script

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def page_example(heading: str) -> str:
    """The first ``python`` block after ``heading`` in docs/integrations.md."""
    text = PAGE.read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)


#: each adapter's example: its section of the page, and the call that training runs in
EXAMPLES = {
    "## Hugging Face `Trainer`": "main()",
    "## Accelerate": "main()",
    "## PyTorch Lightning (`DDPStrategy`)": "main()",
    "## torchtitan": "trainer.train()",
}


@pytest.mark.parametrize("heading", list(EXAMPLES))
def test_every_adapters_example_runs_training_inside_exit_on_alarm(heading):
    """Issue 40: each example imports exit_on_alarm and runs training inside ``with exit_on_alarm():``
    (an alarm: one line and exit 18, after the adapter closed the trace); each is valid Python."""
    import ast

    code = page_example(heading)
    tree = ast.parse(code)
    assert any(
        isinstance(node, ast.ImportFrom)
        and node.module == "sdc_forensics.recorder"
        and "exit_on_alarm" in [a.name for a in node.names]
        for node in ast.walk(tree)
    ), heading
    blocks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        and any(ast.unparse(item.context_expr) == "exit_on_alarm()" for item in node.items)
    ]
    assert blocks and any(
        ast.unparse(inner) == EXAMPLES[heading]
        for block in blocks
        for inner in ast.walk(block)
        if isinstance(inner, ast.Call)
    ), heading


@pytest.mark.slow
@pytest.mark.heavy
def test_the_trainer_example_runs_as_written_and_certifies(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
    (tmp_path / "mytrain.py").write_text(page_example("## Hugging Face `Trainer`"), encoding="utf-8")
    assert_ok(run_script(tmp_path, "mytrain.py"))
    exported = run_installed(["export", "runs/job42/trace", "-o", "-"], tmp_path, cwd=tmp_path).stdout.splitlines()
    header = int(exported[1].split(",")[exported[0].split(",").index("microbatch_first")])
    assert header >> 60 == 0b011  # META | ITEMS: the loss was normalised by num_items_in_batch
    certified = run_installed(
        ["certify", "runs/job42/trace", "--allow-numpy", "--json"],
        tmp_path,
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert certified.returncode == 0, certified.stderr
    doc = json.loads(certified.stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {0: "clean", 5: "clean", 10: "clean"}
    assert doc["resume_step"] == 10
