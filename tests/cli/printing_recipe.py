"""A recipe that prints, as real training code does (nanoGPT prints its parameter count in build).

The demo's recipe, with lines written to stdout three ways in ``build``, ``fetch_microbatch`` and
``load_checkpoint``: Python's ``print``, a raw write to file descriptor 1 (as a C extension
writes), and, in ``build``, a subprocess that inherits descriptor 1. ``tests/cli/test_stdout_document.py``
checks that under ``--json`` none of it reaches stdout. Every line starts with :data:`MARK`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from sdc_forensics.demo.recipe import DemoRecipe

MARK = "printing-recipe:"


def _say(text: str) -> None:
    print(f"{MARK} {text} (print)")
    os.write(1, f"{MARK} {text} (fd 1)\n".encode())


@dataclasses.dataclass(kw_only=True)
class PrintingRecipe(DemoRecipe):
    """:class:`DemoRecipe` that talks on stdout."""

    def build(self, device="cpu"):
        _say("number of parameters: 26.1K")
        subprocess.run([sys.executable, "-c", f"print('{MARK} build (subprocess)')"], check=True)
        return super().build(device)

    def fetch_microbatch(self, microbatch_id: int, device="cpu"):
        _say(f"fetch {microbatch_id}")
        return super().fetch_microbatch(microbatch_id, device)

    def load_checkpoint(self, path, model, optimizer, scheduler) -> None:
        _say(f"load {path}")
        super().load_checkpoint(path, model, optimizer, scheduler)


recipe = PrintingRecipe()
