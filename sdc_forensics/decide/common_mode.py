"""Common-mode evidence: what every rank shows at one step is one event about the shared state.

DDP keeps the replicas equal: the weights, the optimizer state and the schedule that enter step
``t`` are the same on every rank, made by step ``t - 1`` (its reduced gradient and its update).
A replay that departs from the recorded state, for instance a tolerant replay that carried on
from its own reduced gradient, which lacks a fault the record holds, sees every rank's local
gradient differ from the record at the next step. That is one observation about the state
entering ``t``, never ``W`` independent faults (design brief, "Common-mode evidence"). The rules,
applied by :func:`~sdc_forensics.decide.decision.decide` before anything else (torch-free):

1. **Grouping.** Rank-local evidence (location ``local_compute`` or ``input_data``, weak or
   strong) at step ``t`` whose ranks together are every rank (``W >= 2``) becomes one
   common-mode event at ``t``, naming no rank.
2. **Pointing back.** The event points back to step ``t - 1``, the step that made that state,
   and to what that step's evidence names (a rank, or the collective): the *candidate*.
3. **Confirmation.** A weak candidate (a tolerant residual) followed by a common-mode jump in
   which every rank stands far beyond the drift allowance (each observation strong: more than
   ``STRONG_MARGIN * CLEAN_ARTEFACT_MAX`` times the tolerance, ``replay.compare``) is confirmed:
   the fault changed training beyond what drift explains. The candidate becomes strong (its step
   and rank are the verdict) and the event is recorded as its consequence. A strong candidate
   keeps its verdict and the event is its consequence. Otherwise the event is weak: the answer is
   ``inconclusive``, naming the candidate (if any) and what settles it.
4. **Consequences.** Once a replay's state may differ from the record (weak or strong evidence,
   or a common-mode event, at step ``s``), the replay's later observations up to the next step it
   re-anchored at (a checkpoint it replayed from) are about that state, not about their ranks:
   they are recorded as consequences (they neither set the first divergent step nor name a
   suspect nor count as a recurrence). The trace's own evidence is about the recorded run and
   is never rewritten.
5. **An update the replay does not reproduce.** A replay whose local and reduced gradients of
   step ``s`` reproduced bit for bit, and whose weights after the update differ from what every
   rank recorded (``replay.compare``), with nothing else strong at ``s``, is one event about the
   replay's update, not ``W`` faults: every replica ran the same update on the same gradient and
   got the same weights, so the likeliest cause is a recipe that rebuilds the update wrong (its
   optimizer, clipping, learning rate, scheduler). It names no rank and does not set the first
   divergent step (:func:`is_unreproduced_update`); the decision leaves every checkpoint after
   it uncertified and answers ``inconclusive``, saying what to check. Where some replicas equal
   the replay and others do not, those others are named (an update that went wrong on them).
"""

from __future__ import annotations

import bisect as _bisect
import dataclasses
from collections.abc import Iterable, Sequence

from sdc_forensics.evidence import Evidence, Location, Strength

#: Locations that belong to one rank alone: what a shared-state change shows up as on every rank.
_RANK_LOCAL = (Location.LOCAL_COMPUTE, Location.INPUT_DATA)
#: Marks the detail of a common-mode record (renderers and the decision's settle lines read it).
COMMON_MODE = "common mode"


def is_common_mode(ev: Evidence) -> bool:
    """True for the one record a common-mode group became."""
    return ev.detail.startswith(COMMON_MODE)


#: Marks the detail of the event an update the replay does not reproduce became (rule 5).
UPDATE_NOT_REPRODUCED = "update not reproduced"


def is_unreproduced_update(ev: Evidence) -> bool:
    """True for the one record that an update mismatch on every rank became (rule 5)."""
    return (
        ev.source == "replay"
        and ev.location is Location.OPTIMIZER_UPDATE
        and not ev.ranks
        and not ev.affects_state
        and ev.detail.startswith(UPDATE_NOT_REPRODUCED)
    )


def _unreproduced(evs: list[Evidence], world_size: int) -> list[Evidence]:
    """Rule 5 at one step: an update mismatch the replay found on every rank, with nothing else
    strong at that step, becomes one event naming no rank (the other evidence is kept)."""
    update = [
        e
        for e in evs
        if e.source == "replay"
        and e.location is Location.OPTIMIZER_UPDATE
        and e.marks_divergence
        and set(e.ranks) >= set(range(world_size))
    ]
    if not update or any(e.marks_divergence for e in evs if e not in update):
        return evs
    ev = update[0]
    event = dataclasses.replace(
        ev,
        ranks=(),
        affects_state=False,
        found=f"{ev.found} recorded on rank(s) {', '.join(map(str, ev.ranks))}",
        detail=f"{UPDATE_NOT_REPRODUCED}: the local gradients and the reduced gradient of step {ev.step} reproduced exactly, "
        f"but the weights after its update differ from what every rank recorded; every replica ran the same update "
        "on the same gradient, so the replay most likely rebuilds the update wrong (the recipe's optimizer, gradient "
        "clipping, learning rate or LR scheduler), not a fault on any rank",
    )
    return [e for e in evs if e not in update] + [event]


def _state_affecting(ev: Evidence) -> bool:
    return ev.affects_state and not ev.is_hint


def _rank_local(ev: Evidence) -> bool:
    return _state_affecting(ev) and bool(ev.ranks) and ev.location in _RANK_LOCAL and not ev.shared


def _consequence(ev: Evidence, cause: Evidence) -> Evidence:
    who = f"rank(s) {', '.join(map(str, cause.ranks))}" if cause.ranks else "no rank in particular"
    return dataclasses.replace(
        ev,
        affects_state=False,
        strength=Strength.WEAK,
        detail=f"{ev.detail} (a consequence of the state change at step {cause.step}, {who}: the replay no longer follows "
        "the recorded state, so this is not evidence about these ranks)",
    )


def shared_state(evidence: Sequence[Evidence], world_size: int, anchors: Iterable[int] = ()) -> list[Evidence]:
    """Apply the rules of this module: evidence with common-mode groups and consequences rewritten.

    Args:
        evidence: every observation, any order.
        world_size: ``W``.
        anchors: the steps replays started from (a replay's state is the record's again there);
            empty: none known, a departure lasts to the end.
    """
    starts = sorted(set(anchors))
    by_step: dict[int, list[Evidence]] = {}
    for ev in evidence:
        by_step.setdefault(ev.step, []).append(ev)
    out: list[Evidence] = []
    # the replay's state departs from the record before this step, since `cause`
    departed_until, cause = -1, None
    for step in sorted(by_step):
        evs = _unreproduced(by_step[step], world_size)
        if step < departed_until and cause is not None:
            # a consequence of an earlier departure: rewritten below as such
            pass
        elif any(is_unreproduced_update(e) for e in evs):
            # the replay's weights left the record's here: what it sees next is about its own update
            out += evs
            departed_until, cause = _next_anchor(starts, step), next(e for e in evs if is_unreproduced_update(e))
            continue
        local = [e for e in evs if _rank_local(e)]
        causes = [e for e in evs if e.shared and e.marks_divergence]
        reach = {r for e in causes for r in (e.reach or range(world_size))}
        within = [e for e in local if set(e.ranks) <= reach]
        covered = {r for e in local for r in e.ranks}
        everyone = set(range(world_size))
        if within and (reach != everyone or world_size < 2 or not covered >= everyone):
            # a sharded job's weight shard changed at rest and its replica computed with it: what
            # those ranks show at this step is that one fault's consequence, not theirs (some of them
            # only: a small change can leave a rank's gradient bit for bit, computed in bfloat16)
            out += [e for e in evs if e not in within] + [_consequence(e, causes[0]) for e in within]
            if any(e.source == "replay" for e in within):
                departed_until, cause = _next_anchor(starts, step), causes[0]
            continue
        if world_size >= 2 and covered >= set(range(world_size)):
            # at a step a replay started from, the state entering it is the checkpoint's, checked against the record
            anchored = step in starts and all(e.source == "replay" for e in local)
            event = _common_event(step, local, out, [e for e in evs if e.shared and e.marks_divergence], anchored)
            out += [e for e in evs if e not in local] + [event]
            if any(e.source == "replay" for e in local):
                departed_until, cause = _next_anchor(starts, step), event
            continue
        if step < departed_until and cause is not None:
            evs = [_consequence(e, cause) if e.source == "replay" and _state_affecting(e) else e for e in evs]
        else:
            first = next((e for e in evs if e.source == "replay" and _state_affecting(e)), None)
            if first is not None:
                departed_until, cause = _next_anchor(starts, step), first
        out += evs
    return out


def _next_anchor(starts: list[int], step: int) -> float:
    i = _bisect.bisect_right(starts, step)
    return starts[i] if i < len(starts) else float("inf")


def _common_event(
    step: int, members: list[Evidence], earlier: list[Evidence], shared: Sequence[Evidence] = (), anchored: bool = False
) -> Evidence:
    """The one record a common-mode group at ``step`` becomes; confirms (rewrites in ``earlier``)
    a weak candidate at ``step - 1`` when every member stands far beyond the drift allowance.
    ``shared``: strong evidence at ``step`` itself of a fault every rank computed with (a sharded
    job's weight shard changed at rest): the event is its consequence. ``anchored``: ``step`` is
    where the replay started, from a checkpoint whose weights equal the record's, so nothing before
    it made the difference: the replay itself does not compute what the job computed."""
    candidates = [
        i
        for i, e in enumerate(earlier)
        if e.step == step - 1
        and _state_affecting(e)
        and not is_common_mode(e)
        and (e.ranks or e.location is Location.COLLECTIVE)
    ]
    far = all(e.marks_divergence for e in members)
    found = "; ".join(f"rank {', '.join(map(str, e.ranks))}: {e.found}" for e in sorted(members, key=lambda e: e.ranks))
    base = dict(
        kind=members[0].kind,
        step=step,
        ranks=(),
        source=members[0].source,
        location=Location.UNKNOWN,
        expected="the replicas' shared state entering this step as recorded",
        found=found,
    )
    what = (
        f"{COMMON_MODE}: every rank's local gradient at step {step} differs from the record: one event about the "
        f"state entering step {step}, made by step {step - 1} (its reduced gradient, update or weights), not "
        f"{len({r for e in members for r in e.ranks})} independent faults"
    )
    if shared:
        who = ", ".join(f"rank(s) {', '.join(map(str, e.ranks))}" for e in shared)
        return Evidence(
            **base,
            affects_state=False,
            strength=Strength.WEAK,
            detail=f"{what}; it is the consequence of the state {who} held at step {step}, which every rank computed with",
        )
    strong = [i for i in candidates if earlier[i].marks_divergence]
    weak = [i for i in candidates if earlier[i].is_weak]
    if strong or (weak and far):
        for i in weak if not strong else ():
            cand = earlier[i]
            earlier[i] = dataclasses.replace(
                cand,
                strength=Strength.STRONG,
                detail=f"{cand.detail}; confirmed: at the next step every rank's local gradient differs from the record far "
                "beyond the drift allowance (more than any clean replay of its kind produces), so this fault changed "
                "training",
            )
        named = earlier[(strong or weak)[0]]
        who = f"rank(s) {', '.join(map(str, named.ranks))}" if named.ranks else "the collective"
        return Evidence(
            **base,
            affects_state=False,
            strength=Strength.WEAK,
            detail=f"{what}; it is the consequence of step {step - 1}'s fault on {who}",
        )
    if weak:
        named = earlier[weak[0]]
        who = f"rank(s) {', '.join(map(str, named.ranks))}" if named.ranks else "the collective"
        why = (
            f"the candidate is step {step - 1}, {who} (weak); the jump is not far beyond the drift allowance on every "
            "rank, so it does not confirm it"
        )
    elif anchored:
        what = (
            f"{COMMON_MODE}: every rank's local gradient at step {step}, the first step replayed from checkpoint {step} "
            "(whose weights equal the record's), differs from the record"
        )
        why = (
            "the replay does not compute what the job computed: most likely the recipe (fetch_microbatch must give the same "
            "bytes for a microbatch ID, loss the same value and scaling, the model the same forward, dropout or other "
            "randomness seeded as the job did: docs/recipes.md), else the replay's environment (thread count, device)"
        )
    else:
        why = (
            f"nothing at step {step - 1} names a rank or the collective: the cause is shared (collective, update, input "
            "pipeline, or the replay itself)"
        )
    return Evidence(**base, strength=Strength.WEAK, detail=f"{what}; {why}")
