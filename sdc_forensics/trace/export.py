"""Export STEP records to CSV (one row per rank-step), for pandas, spreadsheets and other tools.

Digests are written as 16-digit hex, sketches as one column per projection. The latest attempt
of each step is exported, with its ``attempt`` column, the same rule analysis uses.
"""

from __future__ import annotations

import csv
from typing import TextIO

import numpy as np

from sdc_forensics.trace.reader import Trace

_SCALARS = (
    "step",
    "rank",
    "attempt",
    "time_ns",
    "loss",
    "flags",
    "microbatch_first",
    "microbatch_count",
    "nonfinite_local",
    "nonfinite_reduced",
    "nonfinite_weights",
    "local_norm",
    "reduced_norm",
    "local_max_abs",
    "reduced_max_abs",
    "weights_norm",
)
_DIGESTS = ("input_digest", "microbatch_digest", "local_digest", "reduced_digest", "weights_digest")


def export_csv(trace: Trace, handle: TextIO, window: int = 4096) -> int:
    """Write the CSV to ``handle``; return the number of rows."""
    k = trace.sketch_k
    header = list(_SCALARS) + list(_DIGESTS)
    header += [f"local_sketch_{m}" for m in range(k)] + [f"reduced_sketch_{m}" for m in range(k)]
    writer = csv.writer(handle)
    writer.writerow(header)
    rows = 0
    for win in trace.step_windows(window=window):
        # (N,) in step-major, rank-minor order
        recs = win.records[win.present]
        if not len(recs):
            continue
        columns = [recs[name].astype(object) if name != "loss" else recs[name] for name in _SCALARS]
        columns += [np.char.mod("%016x", recs[name].astype(np.uint64)) for name in _DIGESTS]
        columns += [recs["local_sketch"][:, m] for m in range(k)] + [recs["reduced_sketch"][:, m] for m in range(k)]
        for row in zip(*columns):
            writer.writerow([repr(float(v)) if isinstance(v, (float, np.floating)) else v for v in row])
        rows += len(recs)
    return rows
