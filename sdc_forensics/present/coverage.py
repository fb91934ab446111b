"""Coverage for people and programs: what examined the steps before each checkpoint, as the
``certify``, ``inspect`` and ``report`` outputs say it.

``decide/coverage.py`` computes the coverage (step spans, the online checks of the steps no
replay examined, the replay cost measured on the ledger) and the fault campaign's measured rates
as data; this module writes them: a JSON part (:func:`coverage_document`), one line per
checkpoint (:func:`coverage_text`), the replay cost (:func:`cost_text`) and the campaign's rate
(:func:`online_rate_line`).
"""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from sdc_forensics.decide.coverage import ReplayCost, campaign_rates


def coverage_document(c) -> dict[str, Any]:
    """One checkpoint's coverage (``decide.coverage.Coverage``): step spans ``[first, last]`` by what examined them,
    the online checks of the steps no replay examined and what replaying what lacks replay costs."""

    def spans(values):
        return [list(v) for v in values]

    online = (
        None
        if c.online is None
        else {
            "steps": c.online.steps,
            "complete": c.online.complete,
            "gradients": c.online.gradients,
            "weights": c.online.weights,
            "audited": list(c.online.audited),
            "world_size": c.online.world_size,
            "text": c.online.describe(),
        }
    )
    cost = (
        None
        if c.cost is None
        else {
            "rank_steps": c.cost.rank_steps,
            "seconds_per_rank_step": c.cost.seconds_per_rank_step,
            "seconds": c.cost.seconds,
            "ledger_records": c.cost.records,
        }
    )
    return {
        "step": c.step,
        "exact_now": spans(c.exact_now),
        "exact_ledger": spans(c.exact_ledger),
        "tolerant": spans(c.tolerant),
        "unreproduced": spans(c.unreproduced),
        "online_only": spans(c.online_only),
        "nothing": spans(c.nothing),
        "lacking_replay": spans(c.lacking_replay),
        "ledger_records": list(c.record_ids),
        "online_checks": online,
        "replay_cost": cost,
    }


def coverage_text(c) -> str:
    """One line: what examined the steps before checkpoint ``c.step``."""

    def spans(values) -> str:
        return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in values)

    online = f"online checks only {spans(c.online_only)}" + (
        f" ({c.online.describe()})" if c.online is not None else ""
    )
    parts = [
        text
        for text, v in (
            (f"exact now {spans(c.exact_now)}", c.exact_now),
            (f"exact from the ledger {spans(c.exact_ledger)}", c.exact_ledger),
            (f"replayed, not reproduced {spans(c.unreproduced)}", c.unreproduced),
            (f"tolerant {spans(c.tolerant)}", c.tolerant),
            (online, c.online_only),
            (f"nothing {spans(c.nothing)}", c.nothing),
        )
        if v
    ]
    text = f"checkpoint {c.step}: " + ("; ".join(parts) if parts else "no step before it")
    if c.lacking_replay:
        text += f" — lacks exact replay: steps {spans(c.lacking_replay)}"
        if c.cost is not None:
            text += f"; {cost_text(c.cost)}"
    return text


def render_coverage(console, coverage) -> None:
    """One line per checkpoint (:func:`coverage_text`), then, when some steps had the online checks
    only, what those checks alone caught in the fault campaign (measured: :func:`online_rate_line`)."""
    for c in coverage:
        console.print(f"[dim]coverage:[/] {escape(coverage_text(c))}")
    if any(c.online_only for c in coverage):
        line = online_rate_line()
        if line:
            console.print(f"[dim]coverage:[/] online checks only: {escape(line)}")


def cost_text(cost: ReplayCost) -> str:
    """What an exact replay of the steps lacking one costs, and what measured it."""
    return (
        f"replaying them costs about {_duration(cost.seconds)} ({cost.rank_steps} rank-steps x "
        f"{cost.seconds_per_rank_step:.3g} s measured per rank-step over {cost.records} ledger record(s))"
    )


def online_rate_line() -> str:
    """One line quoting what the online checks alone caught in the fault campaign (the measured
    rates ``benchmarks/campaign.py --rates`` wrote into ``sdc_forensics/measured/``), for a
    coverage with steps that had the online checks only; "" when the figures cannot be read."""
    rates = campaign_rates()
    if rates is None:
        return ""
    line = (
        f"in the fault campaign (docs/benchmarks.md) the online checks alone caught {rates.detected} "
        f"of {rates.effective} effective training faults"
    )
    if rates.all_exact:
        line += ", each at its exact step and rank"
    if rates.local_effective:
        line += f", {rates.local_detected} of the {rates.local_effective} in a local gradient or an input: only a replay sees those"
    return line


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"
