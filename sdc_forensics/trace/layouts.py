"""DDP gradient bucket layouts of a trace attempt: ``buckets.attempt-AAA.json``, written and read here.

Layout of the file (docs/trace-format.md, "Bucket layouts")::

    {"layouts": [{"from_step": s, "buckets": [[param_index, ...], ...]}, ...]}

For each DDP bucket, in bucket index order, the indices into ``list(model.parameters())`` of the
parameters whose gradients it holds, in buffer order, valid from step ``from_step`` on. Rank 0's
recorder writes it atomically whenever the layout changes (``recorder/records.py``); replay reads
it to concatenate gradients as the recorded fingerprints did (``replay/env.py``). The
file is untrusted input like every file of a trace: decoded by ``untrusted.load_json`` and
checked field by field, anything malformed is a :class:`~sdc_forensics.errors.TraceError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from sdc_forensics.errors import TraceError, reader
from sdc_forensics.newfile import write_atomic
from sdc_forensics.trace.format import MAX_STEP
from sdc_forensics.untrusted import Fields, describe, is_int, load_json

#: Largest parameter index a layout may name (far above any model's parameter count).
MAX_PARAM_INDEX = (1 << 31) - 1
_HINT = "restore it from the run, or remove it to replay with DDP's default layout (compared within tolerance)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketLayout:
    """Parameter indices per DDP bucket, in bucket order, valid from ``from_step`` on."""

    from_step: int
    buckets: tuple[tuple[int, ...], ...]


def layouts_path(trace_dir: str | os.PathLike, attempt: int) -> Path:
    """Where the bucket layouts of ``attempt`` live: ``TRACE_DIR/buckets.attempt-AAA.json``."""
    return Path(trace_dir) / f"buckets.attempt-{attempt:03d}.json"


def write_bucket_layouts(trace_dir: str | os.PathLike, attempt: int, layouts: list[dict]) -> Path:
    """Write ``{"layouts": layouts}`` (dicts of ``from_step`` and ``buckets``) atomically."""
    return write_atomic(
        layouts_path(trace_dir, attempt), json.dumps({"layouts": layouts}, indent=1, sort_keys=True) + "\n"
    )


@reader
def read_bucket_layouts(trace_dir: str | os.PathLike, attempt: int) -> tuple[BucketLayout, ...]:
    """The bucket layouts recorded in ``attempt``, sorted by ``from_step`` (empty when the file is absent).

    Raises:
        TraceError: the file is not valid JSON, or a field has the wrong type or range.
    """
    path = layouts_path(trace_dir, attempt)
    if not path.is_file():
        return ()
    try:
        doc = load_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path} is not a valid bucket layout file ({exc}); {_HINT}") from None
    items = Fields(doc, str(path), TraceError, _HINT).list("layouts")
    layouts = tuple(_layout(item, f"{path}, layout entry {i}") for i, item in enumerate(items))
    return tuple(sorted(layouts, key=lambda layout: layout.from_step))


def _layout(doc, where: str) -> BucketLayout:
    f = Fields(doc, where, TraceError, _HINT)
    from_step = f.int("from_step", lo=0, hi=MAX_STEP)
    buckets = []
    for i, bucket in enumerate(f.list("buckets")):
        if not isinstance(bucket, list):
            raise TraceError(
                f"{where}: bucket {i} must be a list of parameter indices, found {describe(bucket)}; {_HINT}"
            )
        bad = [v for v in bucket if not is_int(v) or not 0 <= v <= MAX_PARAM_INDEX]
        if bad:
            raise TraceError(
                f"{where}: bucket {i} must hold parameter indices in 0..{MAX_PARAM_INDEX}, found {describe(bad[0])}; {_HINT}"
            )
        buckets.append(tuple(bucket))
    return BucketLayout(from_step=from_step, buckets=tuple(buckets))
