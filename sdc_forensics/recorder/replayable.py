"""``replayable()``: make a training job's steps reproducible bit for bit by a replay (issue 21).

A checkpoint is certified only by a bitwise-exact replay. On CPU with gloo that needs nothing:
the replay models gloo's ring and applies each step's thread count. On GPUs three things stand in
the way, and this helper removes them for the process that calls it:

* kernels chosen per run (``cudnn.benchmark`` autotuning) or non-deterministic (atomics):
  ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic, benchmark off, and the fixed
  cuBLAS workspace deterministic cuBLAS needs (``CUBLAS_WORKSPACE_CONFIG=:4096:8``);
* NCCL's summation order (ring, tree, NVLS; channels; topology): the recorder's ordered reduction
  (``RecorderOptions(reduction="ordered")``, ``sdc_forensics/reduction.py``), and
  ``NCCL_NVLS_ENABLE=0`` for the collectives the job runs besides it;
* what the replay cannot choose (the GPU model): replay on the model that trained
  (``bisect --device cuda`` on it; the preflight says so).

Call it first in ``main``, before ``init_process_group`` and before the first CUDA matmul (the two
environment variables are read once, at initialisation), and pass what it returns to the
Recorder. What it costs is measured in ``benchmarks/bench_reduction.py`` (docs/recorder.md).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from sdc_forensics.recorder.options import RecorderOptions
from sdc_forensics.reduction import ORDERED


def replayable(options: RecorderOptions | None = None) -> RecorderOptions:
    """Apply the replayable settings to this process; returns ``options`` with the ordered reduction.

    Args:
        options: the recorder options to extend (None: the defaults).
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return dataclasses.replace(options or RecorderOptions(), reduction=ORDERED)
