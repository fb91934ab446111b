"""Step spans as people read them: ``0-3, 7, 9-12``.

Its own module, below ``trace/reader.py`` and ``trace/ends.py``, which both write such spans: the
reader builds a run's end (``trace/ends.py``) and the end names its ranks and steps this way, so
the helper lives under both rather than in one of them (no two-way import).
"""

from __future__ import annotations


def step_ranges(values, sep: str = "-") -> str:
    """``0-3, 7, 9-12`` for a set of steps (at most 10 ranges written out).

    Args:
        values: steps, each an int or a ``range`` of consecutive steps (a span of any length costs
            nothing: spans are merged, never enumerated).
        sep: between the first and last step of a range.
    """
    spans = sorted((v.start, v.stop) if isinstance(v, range) else (int(v), int(v) + 1) for v in values)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if hi <= lo:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out = [f"{lo}" if hi == lo + 1 else f"{lo}{sep}{hi - 1}" for lo, hi in merged]
    text = ", ".join(out[:10])
    return text + (f", … ({len(out) - 10} more ranges)" if len(out) > 10 else "")
