"""Coverage: what examined the steps before each checkpoint, and what replaying the rest costs.

A checkpoint ``N`` is certified clean only when every step before it was replayed bit for bit
(``decide.decision``); this module says, per checkpoint, how far short of that a run is, in
plain steps. Each step before ``N`` counts once, under the strongest examination it had:

1. exact replay now (this analysis) or earlier (a ledger record reused, ``ledger/reuse.py``):
   every digest of the step reproduced, its update included;
2. replayed, but not reproduced: a digest of the step differs from the replay's (its update on
   every rank while its gradients matched, ``decide/common_mode.py`` rule 5; every rank's local
   gradient alike; or a fault's): certifies nothing;
3. tolerant replay (within the tolerance model: certifies nothing);
4. the online checks alone (recorded in the trace, never replayed): which checks ran on those
   steps is ``trace.online.OnlineChecks``;
5. nothing (no trace record of the step).

Steps without an exact replay are what keeps ``N`` from being certified; their replay costs
``steps x ranks x seconds per rank-step``, the seconds measured by the ledger's own records
(:func:`seconds_per_rank_step`), so an ``unverified`` checkpoint says what settling it costs.

``certify``, ``report`` and ``certify --follow`` build it from an analysis (:func:`coverage_of`);
``inspect`` builds it from the ledger alone (:func:`coverage`), replaying nothing. The flows read
the ledger (``forensics/intervals.py``, ``forensics/ledger_coverage.py``) and hand its records in;
this module returns data, and ``present/coverage.py`` writes the sentences.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

# (first, last) steps, inclusive
Span = tuple[int, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayCost:
    """What an exact replay of some steps would cost, from measured replays.

    Attributes:
        rank_steps: steps x ranks to replay.
        seconds_per_rank_step: the median over the ledger's records of ``wall_s / (steps x ranks)``.
        records: how many records that median is over.
    """

    rank_steps: int
    seconds_per_rank_step: float
    records: int

    @property
    def seconds(self) -> float:
        return self.rank_steps * self.seconds_per_rank_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class Coverage:
    """What examined the steps before checkpoint ``step`` (``first_step .. step - 1``), as step spans.

    Attributes:
        step: ``N``.
        exact_now: replayed bit for bit by this analysis.
        exact_ledger: replayed bit for bit earlier, taken from the ledger (``record_ids``).
        tolerant: replayed and compared within tolerance only.
        unreproduced: replayed, but the replay did not reproduce a digest of the step (not exact).
        online_only: recorded in the trace (online checks ran) but not replayed.
        nothing: not recorded in the trace at all.
        record_ids: the ledger records behind ``exact_ledger``.
        online: which online checks ran on the ``online_only`` steps (None: not looked up).
        cost: what an exact replay of :attr:`lacking_replay` costs (None: nothing lacks replay,
            or nothing measured yet).
    """

    step: int
    exact_now: tuple[Span, ...] = ()
    exact_ledger: tuple[Span, ...] = ()
    tolerant: tuple[Span, ...] = ()
    unreproduced: tuple[Span, ...] = ()
    online_only: tuple[Span, ...] = ()
    nothing: tuple[Span, ...] = ()
    record_ids: tuple[str, ...] = ()
    # trace.online.OnlineChecks
    online: Any = None
    cost: ReplayCost | None = None

    @property
    def lacking_replay(self) -> tuple[Span, ...]:
        """Steps before ``N`` without an exact replay: what keeps it from being certified."""
        return _merge([*self.unreproduced, *self.tolerant, *self.online_only, *self.nothing])


def coverage(
    checkpoint_steps: Iterable[int],
    *,
    step_range: Span | None,
    exact_now: Iterable[Span] = (),
    exact_ledger: Iterable[tuple[int, int, Sequence[str]]] = (),
    tolerant: Iterable[Span] = (),
    unreproduced: Iterable[Span] = (),
) -> tuple[Coverage, ...]:
    """:class:`Coverage` of each checkpoint step from what examined which steps.

    Args:
        checkpoint_steps: the checkpoints to answer for.
        step_range: the trace's recorded steps (first, last), or None.
        exact_now: spans this analysis replayed bit for bit.
        exact_ledger: ``(first, last, record_ids)`` spans taken from the ledger.
        tolerant: spans replayed within tolerance only.
        unreproduced: spans replayed whose update the replay did not reproduce (taken out of ``exact_now``).
    """
    first = step_range[0] if step_range else 0
    traced = [step_range] if step_range else []
    unreproduced = _merge(unreproduced)
    exact_now, tolerant = _minus(_merge(exact_now), unreproduced), _merge(tolerant)
    reused = list(exact_ledger)
    out = []
    for n in sorted(set(checkpoint_steps)):
        before = [(first, n - 1)] if n > first else []
        now = _clip(exact_now, before)
        ledger = _minus(_clip([(a, b) for a, b, _ in reused], before), now)
        exact = _merge([*now, *ledger])
        off = _minus(_clip(unreproduced, before), exact)
        tol = _minus(_minus(_clip(tolerant, before), exact), off)
        online = _minus(_minus(_minus(_clip(traced, before), exact), tol), off)
        nothing = _minus(_minus(_minus(_minus(before, exact), tol), online), off)
        ids = tuple(dict.fromkeys(i for a, b, rec in reused if a < n for i in rec))
        out.append(
            Coverage(
                step=n,
                exact_now=now,
                exact_ledger=ledger,
                tolerant=tol,
                unreproduced=off,
                online_only=online,
                nothing=nothing,
                record_ids=ids,
            )
        )
    return tuple(out)


def coverage_of(result) -> tuple[Coverage, ...]:
    """:class:`Coverage` of every checkpoint of ``result`` (a ``BisectResult``: its windows and the ledger windows it reused)."""
    now_exact, now_tolerant = [], []
    for w in result.replayed.windows:
        if w.last < w.start:
            continue
        cut = w.last + 1 if w.tolerant_from is None else max(w.start, w.tolerant_from)
        if cut > w.start:
            now_exact.append((w.start, cut - 1))
        if cut <= w.last:
            now_tolerant.append((cut, w.last))
    ledger = result.replayed.ledger
    reused = [(w.start, w.last, w.record_ids) for w in ledger.reused] if ledger is not None else []
    from sdc_forensics.evidence import EvidenceKind

    # a step whose replay did not reproduce some digest (its update, every rank's local gradient, or a
    # fault's) is replayed, not exact: a wrong accumulation count was listed "exact now 0" while every
    # rank's local gradient of step 0 differed
    # (a tolerant step stays tolerant: each step counts once)
    off = [
        (e.step, e.step)
        for e in result.evidence
        if e.source == "replay"
        and e.kind is EvidenceKind.REPLAY_MISMATCH
        and not any(a <= e.step <= b for a, b in now_tolerant)
    ]
    return coverage(
        [c.step for c in result.checkpoints],
        step_range=result.step_range,
        exact_now=now_exact,
        exact_ledger=reused,
        tolerant=now_tolerant,
        unreproduced=off,
    )


def with_details(coverages: Sequence[Coverage], trace, records: Sequence[Any] = ()) -> tuple[Coverage, ...]:
    """``coverages`` with the online checks of their ``online_only`` steps (read from ``trace``)
    and the cost of replaying what lacks replay (measured by the ledger ``records``)."""
    from sdc_forensics.trace.online import online_checks

    per_step = seconds_per_rank_step(records, trace.world_size)
    out = []
    for c in coverages:
        online = online_checks(trace, c.online_only) if c.online_only else None
        lacking = sum(b - a + 1 for a, b in c.lacking_replay)
        cost = None
        if lacking and per_step is not None:
            cost = ReplayCost(
                rank_steps=lacking * trace.world_size, seconds_per_rank_step=per_step[0], records=per_step[1]
            )
        out.append(dataclasses.replace(c, online=online, cost=cost))
    return tuple(out)


def seconds_per_rank_step(records: Sequence[Any], world_size: int) -> tuple[float, int] | None:
    """The median seconds one rank-step took to replay over the ledger ``records`` (``IntervalRecord``)
    that replayed steps, and how many records that is; None when none did.

    The median, not the mean: a follower's first replay also builds the recipe's model and warms
    torch up (seconds, where a later interval takes a tenth of one).
    """
    rates = [
        r.wall_s / ((r.last_step - r.start_step + 1) * max(1, world_size))
        for r in records
        if r.last_step >= r.start_step and r.wall_s > 0
    ]
    return (statistics.median(rates), len(rates)) if rates else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CampaignRates:
    """What the online checks alone caught in the fault campaign (``benchmarks/campaign.py --rates``,
    shipped in ``sdc_forensics/measured/``): quoted by a coverage with steps that had the online checks only.

    Attributes:
        detected: effective training faults the online checks alone detected.
        effective: effective training faults (ones that changed the training).
        all_exact: every one detected was named at its exact step and rank.
        local_detected: of the effective faults in a local gradient or an input, those detected.
        local_effective: effective faults in a local gradient or an input (only a replay sees the rest).
    """

    detected: int
    effective: int
    all_exact: bool
    local_detected: int
    local_effective: int


def campaign_rates() -> CampaignRates | None:
    """The measured :class:`CampaignRates` shipped with the package; None when they cannot be read."""
    import json
    from importlib import resources

    try:
        doc = json.loads(
            resources.files("sdc_forensics").joinpath("measured/trace_only_rates.json").read_text(encoding="utf-8")
        )
        training, where = doc["training_faults"], doc["by_location"]
        local = [where[k] for k in ("grad", "input") if k in where]
        return CampaignRates(
            detected=int(training["trace_only_detected"]),
            effective=int(training["effective"]),
            all_exact=training["trace_only_exact"] == training["trace_only_detected"],
            local_detected=sum(int(g["trace_only_detected"]) for g in local),
            local_effective=sum(int(g["effective"]) for g in local),
        )
    except (OSError, ValueError, KeyError, TypeError, ModuleNotFoundError):
        return None


def _merge(spans) -> tuple[Span, ...]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def _clip(spans, within) -> tuple[Span, ...]:
    return _merge((max(a, lo), min(b, hi)) for a, b in spans for lo, hi in within if max(a, lo) <= min(b, hi))


def _minus(spans, taken) -> tuple[Span, ...]:
    out = []
    for a, b in _merge(spans):
        for lo, hi in _merge(taken):
            if hi < a or lo > b:
                continue
            if lo > a:
                out.append((a, lo - 1))
            a = max(a, hi + 1)
            if a > b:
                break
        if a <= b:
            out.append((a, b))
    return tuple(out)
