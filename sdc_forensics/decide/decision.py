"""The one decision: evidence -> first divergent step -> suspects -> verdict -> checkpoint statuses.

Every command that names a first divergent step or calls a checkpoint clean (``bisect``,
``certify``, ``verify-checkpoint --trace``, ``replay``, ``report``) gets its answer from
:func:`decide`; a trace-only answer is the same rules applied to less evidence. torch-free: the inputs
are evidence records, checkpoint notes and what was examined.

The rules (design brief, "Conventions" and "Analysis and verdicts"; docs/bisect.md):

* **Common mode first** (``decide/common_mode.py``): what every rank shows at one step is one
  event about the shared state entering it, pointing back to the step that made it; a replay's
  observations after its state departed from the record are consequences, not evidence about
  their ranks. Everything below sees the evidence after that rewrite.
* **First divergent step** ``s*``: the earliest *onset* of strong, state-affecting evidence
  (``Evidence.onset``: a replica found diverged at a weights check may have gone wrong on any step
  after the previous check, so the earliest such step counts). Weak evidence (a tolerant replay
  residual within the range clean replays produce) and hints never set it.
* **Verdict**: ``corruption`` when strong evidence names a suspect; ``inconclusive`` when the
  only evidence is weak, or strong but unlocalised, or the replay did not reproduce an update on
  any rank (``common_mode`` rule 5: most likely the recipe; ``settle`` says what to check), or a
  trace-only run has hints; ``clean`` otherwise, for the steps examined (said as such).
* **Location at rest**: a replay's wrong local gradient on a rank whose weights the trace finds
  diverged from the other replicas' at that step is ``state_at_rest`` (:func:`_at_rest`).
* **Suspects**: the ranks strong evidence at ``s*`` names (or the collective); a storage-only
  incident names the rank whose file was damaged, and its advice is about the disk, never the GPU.
* **Recurring**: two or more independent fault events on one rank. A replica that stays
  different after one event (its weights diverged) is one event until its weights are seen equal
  to the majority again; storage damage is never a GPU event.
* **Checkpoint status** (one :class:`CheckpointStatus` type for every command):
  ``corrupt`` (unreadable, NaN/Inf, not as saved, not the replicas' majority), ``tainted``
  (``N > s*``), ``unverified`` (not every step before ``N`` was examined and found clean, or
  some only within tolerance; weak evidence before ``N``; files not read or not verifiable;
  trace damaged; an update before ``N`` the replay did not reproduce), ``clean`` (none of those:
  the file is as saved, holds the replicas' majority weights and no NaN/Inf, and every step before
  ``N`` was replayed exactly: local gradients, reduced gradient and weights after the update).
  A tolerant comparison cannot see a fault below the replay's drift (bit-20 gradient flips read
  4-9x the tolerance where clean drift on a conv net reaches 1,000x: docs/benchmarks.md), so it
  never certifies, and with nothing above tolerance the verdict is ``inconclusive``.

Over 400 lines on purpose: every rule that names a first divergent step, a suspect or a checkpoint
status is here and only here (docs/decisions.md), so that every command takes the same answer; its
evidence vocabulary and its divergence-window rule are ``sdc_forensics/evidence.py``, its common-mode rule
``common_mode.py``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sdc_forensics.checkpoint.findings import FindingKind
from sdc_forensics.decide.common_mode import is_common_mode, is_unreproduced_update, shared_state
from sdc_forensics.evidence import Evidence, EvidenceKind, Location, divergence_window, first_divergent_step, sort_key
from sdc_forensics.trace.reader import step_ranges

# the file differs from what was saved (storage), or was saved from a wrong state
STORAGE_FINDINGS = frozenset(
    {
        FindingKind.DIGEST_MISMATCH,
        FindingKind.FILE_DAMAGED,
        FindingKind.FILE_CHECKSUM_MISMATCH,
        FindingKind.MISSING_TENSOR,
        FindingKind.UNEXPECTED_TENSOR,
    }
)
STATE_FINDINGS = frozenset({FindingKind.NONFINITE, FindingKind.WEIGHTS_NOT_MAJORITY})
UNVERIFIABLE_FINDINGS = frozenset({FindingKind.NOT_VERIFIABLE})

# most specific first: the location a suspect gets when several kinds of evidence name it
_LOCATION_ORDER = (
    Location.INPUT_DATA,
    Location.COLLECTIVE,
    Location.STATE_AT_REST,
    Location.LOCAL_COMPUTE,
    Location.OPTIMIZER_UPDATE,
    Location.STORAGE,
    Location.UNKNOWN,
)


class Verdict(str, enum.Enum):
    CLEAN = "clean"
    CORRUPTION = "corruption"
    INCONCLUSIVE = "inconclusive"


class Status(str, enum.Enum):
    """A checkpoint's certification status."""

    CLEAN = "clean"
    UNVERIFIED = "unverified"
    TAINTED = "tainted"
    CORRUPT = "corrupt"

    @property
    def clean(self) -> bool:
        return self is Status.CLEAN


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointStatus:
    """The decision about one checkpoint, with reasons (most important first).

    Attributes:
        step: ``N``, the completed steps it holds.
        path: the file or directory examined ("" when not found or not read).
        status: the :class:`Status`.
        reasons: one sentence per reason.
        findings: the file verification findings (``checkpoint.verify.Finding``).
        report: the verification report (None when the file was not read).
    """

    step: int
    path: str
    status: Status
    reasons: tuple[str, ...]
    findings: tuple[Any, ...] = ()
    report: Any = None

    @property
    def clean(self) -> bool:
        return self.status.clean

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": self.path,
            "status": self.status.value,
            "reasons": list(self.reasons),
            "findings": [f.to_json() for f in self.findings],
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointFile:
    """What reading one noted checkpoint gave: the report, or the error that stopped it."""

    path: str = ""
    report: Any = None
    error: str = ""
    #: a later checkpoint noted at the same file (a rotation that reused the name): this one's content is gone
    written_over_by: int | None = None
    written_over_path: str = ""

    @property
    def read(self) -> bool:
        return self.report is not None or bool(self.error)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Suspect:
    """A rank (or the collective as a whole, ``rank=None``) and why it is suspected."""

    rank: int | None
    host: str | None
    gpu: str | None
    location: Location
    recurring: bool
    steps: tuple[int, ...]
    evidence: tuple[Evidence, ...]
    shared: bool = False
    replicas: int = 0
    # a sharded job: the rank's mesh coordinates ("replicate=1, shard=0"); "" otherwise
    mesh: str = ""
    # the earlier attempt of a resumed run whose steps (re-executed later) this suspect went wrong on; None: the latest lineage
    attempt: int | None = None

    @property
    def recommendation(self) -> str:
        if self.shared:
            return (
                "every rank of the job is named at this step, so the cause is most likely shared, not one GPU each: the "
                "collective, the optimizer update, the input pipeline, or the replay itself; check the input pipeline and "
                "the collective (an all-reduce self-test), and replay exactly before draining any node"
            )
        if self.rank is None and self.replicas == 2 and self.location is Location.UNKNOWN:
            return (
                "the two replicas disagree and two cannot form a majority, so neither rank can be blamed yet: a replay "
                "(sdc-forensics bisect with the recipe and checkpoints), an audit, or a third replica settles which one is "
                "wrong; then check that rank's GPU (and the interconnect if neither is)"
            )
        if self.rank is None:
            return "check the interconnect and the collective library of every node in the job; rerun an all-reduce self-test"
        if self.location is Location.STORAGE:
            many = "files on this node were" if len(self.steps) > 1 else "a checkpoint file was"
            return (
                f"{many} damaged at rest: check the disk and file system of {self.host or '?'} (or the shared storage), "
                "rewrite or discard the file(s); the GPU is not implicated"
            )
        if self.location is Location.INPUT_DATA:
            return (
                f"the input bytes rank {self.rank} trained on are not what its microbatches give when fetched again: "
                f"either the data path of {self.host or '?'} changed them (host memory, the loader, a cached shard), or "
                "the recipe's fetch_microbatch does not return what the job trained on for those IDs; check the recipe "
                "first (fetch them twice and compare), then the host"
                + (f"; recurring ({len(self.steps)} events): drain node {self.host or '?'}" if self.recurring else "")
            )
        if self.recurring:
            return f"recurring ({len(self.steps)} independent events): drain node {self.host or '?'} and take GPU {self.gpu or '?'} out of service"
        return (
            f"one event: run the DCGM diagnostic on {self.host or '?'} / {self.gpu or '?'} before reusing it "
            "(sdc-forensics report gives the commands)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "gpu": self.gpu,
            "location": self.location.value,
            "recurring": self.recurring,
            "steps": list(self.steps),
            "recommendation": self.recommendation,
            "evidence": [e.to_json() for e in self.evidence],
            **({"mesh": self.mesh} if self.mesh else {}),
            **({"attempt": self.attempt} if self.attempt is not None else {}),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Examined:
    """What the analysis looked at.

    Attributes:
        first_step: the first step the trace records (checkpoint ``first_step`` has no step before it).
        replayed: steps replayed and compared (exactly or within tolerance).
        tolerant_steps: the replayed steps compared within tolerance, not bitwise.
        trace_consistent: False when trace damage makes its evidence untrustworthy.
        files_read: checkpoint files were read (False: trace-only).
        trace_only: the user asked for the trace alone.
        anchors: the steps replays started from (checkpoints): a replay's state is the record's
            again there (``common_mode``: its consequences end at the next anchor).
    """

    first_step: int = 0
    replayed: frozenset[int] = frozenset()
    tolerant_steps: frozenset[int] = frozenset()
    trace_consistent: bool = True
    files_read: bool = False
    trace_only: bool = False
    anchors: frozenset[int] = frozenset()

    def unexamined_before(self, step: int) -> tuple[range, ...]:
        """Steps in ``[first_step, step)`` that no replay examined, as spans (empty: none). Built
        from the replayed steps, never by walking the span: a note's step may be crafted (2^53)."""
        spans, lo = [], self.first_step
        for s in sorted(s for s in self.replayed if self.first_step <= s < step):
            if s > lo:
                spans.append(range(lo, s))
            lo = s + 1
        return tuple(spans) + ((range(lo, step),) if step > lo else ())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """Everything decided."""

    verdict: Verdict
    first_divergent_step: int | None
    divergence_window: tuple[int, int] | None
    suspects: tuple[Suspect, ...]
    checkpoints: tuple[CheckpointStatus, ...]
    weak: tuple[Evidence, ...]
    settle: tuple[str, ...]
    evidence: tuple[Evidence, ...] = ()

    @property
    def last_clean(self) -> CheckpointStatus | None:
        return last_clean(self.checkpoints)


def decide(
    evidence: Sequence[Evidence],
    *,
    world_size: int,
    identity: Callable[[int], Any],
    notes: Sequence[Any],
    files: Mapping[int, CheckpointFile],
    majority: Mapping[int, str],
    examined: Examined,
    sharded: bool = False,
) -> Decision:
    """Apply the rules of this module to the evidence gathered.

    Args:
        evidence: every observation (trace, replay, checkpoint files), any order.
        world_size: ``W``.
        identity: ``rank -> RankIdentity`` (host, gpu).
        notes: the run's checkpoint notes (``trace.checkpoints.CheckpointNote``).
        files: ``{N: CheckpointFile}`` for the notes whose files were looked for (empty: trace-only).
        majority: ``{N: hex}`` strict-majority weights digest of ``θ_N`` from the STEP records.
        examined: what was examined.
        sharded: the job is sharded (FSDP2/HSDP): any replica of a shard may have written it to a checkpoint.
    """
    evidence = sorted(
        shared_state([_pinned(e, examined) for e in _at_rest(evidence, sharded)], world_size, examined.anchors),
        key=sort_key,
    )
    window = divergence_window(evidence)
    first = window[0] if window is not None else None
    suspects = find_suspects(evidence, world_size, identity)
    weak = tuple(e for e in evidence if e.is_weak and (first is None or e.step < first))
    settle: list[str] = []
    # s* is the first *confirmed* divergence; the weak one may be earlier
    if weak and first is not None:
        window = (weak[0].step, window[1])
    localised = [s for s in suspects if not (s.rank is None and s.location is Location.UNKNOWN)]
    unreproduced = tuple(sorted({e.step for e in evidence if is_unreproduced_update(e)}))
    vague = [e for e in evidence if e.marks_divergence and not e.ranks and e.location is Location.UNKNOWN]
    if first is not None and localised:
        verdict = Verdict.CORRUPTION
    elif vague and world_size == 2:
        verdict = Verdict.INCONCLUSIVE
        settle.append(
            f"ranks 0 and 1 disagree at step {vague[0].step} ({vague[0].detail}), and with two replicas no strict "
            "majority is possible: either may be the wrong one; a replay of that step (bisect with the recipe and "
            "checkpoints) is the third vote that settles it, as would an audit or a third replica"
        )
    elif vague:
        verdict = Verdict.INCONCLUSIVE
        settle.append(
            f"evidence at step {vague[0].step} could not be localised ({vague[0].detail}); replay that step "
            "with the recipe and checkpoints, or enable audits"
        )
    # weak evidence, or a replay that did not reproduce an update: nothing certifies past it
    elif weak or unreproduced:
        verdict = Verdict.INCONCLUSIVE
    # storage only: no divergent step, but damaged files
    elif localised:
        verdict = Verdict.CORRUPTION
    elif examined.trace_only and any(e.is_hint for e in evidence):
        verdict = Verdict.INCONCLUSIVE
        hinted = sorted({e.step for e in evidence if e.is_hint})
        settle.append(
            f"outlier hints at step(s) {', '.join(map(str, hinted[:5]))}: a replay of those steps confirms or clears them"
        )
    elif not examined.trace_only and not examined.replayed:
        # a replay was wanted and none could run: the trace alone is not a clean bill
        verdict = Verdict.INCONCLUSIVE
    elif not examined.trace_consistent:
        # nothing found, but in a trace with holes: no clean bill for what is missing
        verdict = Verdict.INCONCLUSIVE
        settle.append(
            "the trace is damaged (a rank file missing or unreadable, bad checksums, or steps missing): nothing was "
            "found in what could be read, but that is not every rank's every step; restore the damaged rank files "
            "(or bisect the checkpoints with a replay) to decide"
        )
    elif examined.tolerant_steps:
        # nothing above tolerance; a fault below the replay's drift would not show
        verdict = Verdict.INCONCLUSIVE
        settle.append(
            f"steps {_spans(sorted(examined.tolerant_steps))} were compared within tolerance only (another thread count "
            "or device): nothing stood out, but a fault below the replay's drift would not show; replay exactly (the "
            "recorded thread counts, without --threads/--tolerant, or the recorded GPU model) to certify; where it "
            "already ran so, the recipe's kernels are not the job's (compile the model as the job did, torch.compile "
            "or autocast: docs/recipes.md)"
        )
    else:
        verdict = Verdict.CLEAN
    if weak and first is not None:
        settle.insert(
            0,
            f"weak evidence at step {weak[0].step} precedes the first confirmed divergence at step {first}: "
            "the fault may have begun there",
        )
    if weak:
        settle[:0] = _weak_lines(weak)
    if unreproduced:
        settle.insert(0, _recipe_line(unreproduced))
    statuses = tuple(
        checkpoint_status(
            n,
            files.get(n.step),
            first=first,
            weak=weak,
            majority=majority.get(n.step),
            examined=examined,
            unreproduced=unreproduced,
            sharded=sharded,
            later_found=any(s > n.step and f.path for s, f in files.items() if f is not None),
        )
        for n in sorted(notes, key=lambda n: n.step)
    )
    return Decision(
        verdict=verdict,
        first_divergent_step=first,
        divergence_window=window,
        suspects=suspects,
        checkpoints=statuses,
        weak=weak,
        settle=tuple(settle),
        evidence=tuple(evidence),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EarlierAttempt:
    """An earlier attempt of a resumed run, judged on the steps a later attempt re-executed.

    Attributes:
        attempt: the attempt judged.
        resumed_by: the attempt that re-executed its steps from ``steps[0]`` on.
        steps: ``(first, last)`` of the re-executed steps judged (its own records).
        decision: :func:`decide` applied to that attempt's own records of those steps (no checkpoints: its later ones are
            superseded, judged with the latest attempt's).
    """

    attempt: int
    resumed_by: int
    steps: tuple[int, int]
    decision: Decision
    # what its replay examined (None: nothing was replayed)
    examined: Examined | None = None


def with_earlier_attempts(
    latest: Decision,
    earlier: Sequence[EarlierAttempt],
    owners: dict[int, tuple[int, int]] | None = None,
    *,
    notes: Sequence = (),
    files: Mapping[int, CheckpointFile] | None = None,
    examined: Examined | None = None,
    sharded: bool = False,
) -> Decision:
    """The run's decision once the earlier attempts of a resumed run are judged too (design brief: every attempt).

    A fault in steps a later attempt re-executed does not end with the re-execution: the GPU that made it is still
    suspect. So an earlier attempt's suspects join the answer (each with its ``attempt``) and a corruption there is
    the run's verdict; but the latest attempt resumed from a checkpoint before that fault, so the first divergent
    step and every checkpoint status stay those of the latest attempt's lineage (its own replay). What an earlier
    attempt could not settle is said, and changes nothing else.

    Except a checkpoint an earlier attempt saved after the step a later one resumed from, which the
    later one did not save again (``owners``: step -> ``(attempt that saved it, attempt that resumed
    before it)``, ``trace.checkpoints.superseded_by``): it holds that earlier attempt's state, so it
    is judged by that attempt's own steps (:func:`_off_lineage`, with the checkpoint's ``notes``, its
    ``files`` and what the lineage's replay ``examined``), never certified by the latest lineage's
    replay of other records.
    """
    if owners:
        by_step = {n.step: n for n in notes}
        latest = dataclasses.replace(
            latest,
            checkpoints=tuple(
                c
                if c.step not in owners
                else _off_lineage(
                    c,
                    by_step.get(c.step),
                    (files or {}).get(c.step),
                    owners[c.step],
                    earlier,
                    latest=latest,
                    examined=examined,
                    sharded=sharded,
                )
                for c in latest.checkpoints
            ),
        )
    suspects, settle, evidence = list(latest.suspects), [], list(latest.evidence)
    verdict = latest.verdict
    for past in sorted(earlier, key=lambda p: p.attempt):
        span = f"steps {past.steps[0]}..{past.steps[1]}" if past.steps[1] > past.steps[0] else f"step {past.steps[0]}"
        decided = past.decision
        if decided.verdict is Verdict.CORRUPTION and decided.suspects:
            named = [dataclasses.replace(s, attempt=past.attempt) for s in decided.suspects]
            suspects += named
            evidence += decided.evidence
            verdict = Verdict.CORRUPTION
            who = "; ".join(f"{_suspect_words(s)} ({s.location.value})" for s in named)
            settle.append(
                f"attempt {past.attempt} went wrong at step {decided.first_divergent_step}: {who}; attempt "
                f"{past.resumed_by} re-executed its {span} from a checkpoint before the fault, so its checkpoints are "
                "judged on their own replay, but that hardware is still suspect: a re-execution does not clear it"
            )
        elif decided.verdict is Verdict.INCONCLUSIVE:
            settle.append(
                f"attempt {past.attempt}'s {span}, re-executed by attempt {past.resumed_by}, could not be settled: "
                + "; ".join(decided.settle[:1] or ("see its evidence",))
            )
    if not settle:
        return latest
    return dataclasses.replace(
        latest,
        verdict=verdict,
        suspects=tuple(suspects),
        settle=tuple(settle) + latest.settle,
        evidence=tuple(sorted(evidence, key=sort_key)),
    )


def off_lineage_examined(lineage: Examined, past: EarlierAttempt) -> Examined:
    """What examined the steps before a checkpoint that attempt ``past`` saved off the latest lineage
    (``trace.checkpoints.superseded_by``): the lineage's replay before the step a later attempt resumed
    from, which both share, and from there ``past``'s own replay of its own records (none: not examined).
    The latest lineage ends where its latest attempt does (``Trace.step_range``), so its replay never
    reaches that checkpoint's later steps."""
    lo = past.steps[0]
    own = past.examined or Examined(first_step=lo)
    return dataclasses.replace(
        lineage,
        replayed=frozenset(s for s in lineage.replayed if s < lo) | own.replayed,
        tolerant_steps=frozenset(s for s in lineage.tolerant_steps if s < lo) | own.tolerant_steps,
        anchors=frozenset(s for s in lineage.anchors if s < lo) | own.anchors,
    )


def _off_lineage(
    status: CheckpointStatus,
    note,
    file: CheckpointFile | None,
    owner: tuple[int, int],
    earlier: Sequence[EarlierAttempt],
    *,
    latest: Decision,
    examined: Examined | None,
    sharded: bool,
) -> CheckpointStatus:
    """The status of a checkpoint off the latest lineage (``owner``: the attempt that saved it, the one
    that resumed before it; ``status``: the lineage's, which never replayed its later steps), by the one
    status rule (:func:`checkpoint_status`) with what examined its own steps
    (:func:`off_lineage_examined`): the lineage's divergence and weak evidence where they share the
    steps, its own attempt's after; tainted after that attempt's first divergent step; unverified
    while that attempt could not be settled."""
    attempt, resumed_by = owner
    where = (
        f"saved by attempt {attempt}, whose steps attempt {resumed_by} re-executed from an earlier checkpoint "
        "without saving this one again"
    )
    past = next((p for p in earlier if p.attempt == attempt), None)
    if past is not None and note is not None and examined is not None:
        lo, first = past.steps[0], latest.first_divergent_step
        status = checkpoint_status(
            note,
            file,
            first=first if first is not None and first < lo else None,
            weak=tuple(e for e in latest.weak if e.step < lo),
            majority=None,
            examined=off_lineage_examined(examined, past),
            sharded=sharded,
        )
    if status.status is Status.CORRUPT:
        return dataclasses.replace(status, reasons=status.reasons + (where,))
    own_first = past.decision.first_divergent_step if past is not None else None
    if own_first is not None and own_first < status.step:
        taint = f"holds attempt {attempt}'s state after its first divergent step {own_first} ({where})"
        return dataclasses.replace(status, status=Status.TAINTED, reasons=(taint,))
    if status.status is not Status.CLEAN:
        return dataclasses.replace(status, reasons=status.reasons + (where,))
    if (
        past is not None
        and note is not None
        and examined is not None
        and past.decision.verdict is not Verdict.INCONCLUSIVE
    ):
        return status  # every step before it replayed exactly: the lineage's before the resume, its own after
    lo = past.steps[0] if past is not None else status.step - 1
    return dataclasses.replace(
        status,
        status=Status.UNVERIFIED,
        reasons=(f"{where}: its own steps {lo}..{status.step - 1} were not all replayed exactly",),
    )


def _suspect_words(suspect: Suspect) -> str:
    if suspect.rank is None:
        return "the collective"
    where = ", ".join(x for x in (suspect.host, suspect.gpu) if x)
    return f"rank {suspect.rank}" + (f" ({where})" if where else "")


_EXACTLY = (
    "replay exactly (without --threads/--tolerant on CPU, or on the recorded GPU model), or from a checkpoint closer "
    "to the step, to settle it"
)


def _recipe_line(steps: Sequence[int]) -> str:
    """What to say when the replay did not reproduce the update of ``steps`` on any rank (``common_mode`` rule 5)."""
    return (
        f"the replay does not reproduce the update of step(s) {_spans(steps)}: the local and reduced gradients matched "
        "exactly, the weights after the update differ on every rank alike, so the recipe most likely rebuilds the update "
        "wrong: check its optimizer (type, hyper-parameters, parameter groups), gradient clipping (before_step), learning "
        "rate (one the loop sets by hand: set it in before_step from the step it is handed, docs/recipes.md) and LR "
        "scheduler (after_step); if it reproduces the updates of the steps around it, a one-time fault after the "
        "reduction leaves the same evidence where clipping spans the ranks (FSDP, HSDP, TP, PP stages): one rank's gradient changed "
        "in memory before the update, or its share of the clip norm miscomputed, reaches every rank through the clip "
        "coefficient, and the trace does not record which rank; no checkpoint after it is certified until a replay "
        "reproduces every step"
    )


def _weak_lines(weak: Sequence[Evidence]) -> list[str]:
    """What to say about weak evidence: the earliest (the candidate), and a common-mode event after it."""
    w = weak[0]
    if is_common_mode(w):
        return [f"weak evidence at step {w.step}: {w.detail}; {_EXACTLY}"]
    if w.detail.startswith("buffers changed"):
        # replay/buffers.py (torch-free here): exact, but no checkpoint's buffers were reproduced anywhere
        return [
            f"weak evidence at steps {w.onset}..{w.step}: {w.detail}; make the recipe update every buffer the loop "
            "updates (docs/recipes.md), or replay from a checkpoint whose buffers reproduce, to settle it"
        ]
    lines = [
        f"weak evidence at step {w.step}, {_who(w)}: a tolerant replay residual ({w.found}) not far enough above what clean "
        f"tolerant replays produce to tell a fault from replay drift; {_EXACTLY}"
    ]
    common = next((e for e in weak[1:] if is_common_mode(e)), None)
    if common is not None:
        lines.append(f"step {common.step}: {common.detail}")
    return lines


def _who(ev: Evidence) -> str:
    if ev.ranks:
        return f"rank(s) {', '.join(map(str, ev.ranks))}"
    return "the collective" if ev.location is Location.COLLECTIVE else "no rank in particular"


def _holds(divergence: Evidence, rank: int, sharded: bool) -> bool:
    """``divergence`` (a weights vote) puts ``rank`` among the diverged replicas: it names it, or, in a
    DDP job (every rank a replica of the whole model), it names none because no strict majority exists
    (two replicas that differ: either may be the one). In a sharded job a split vote is one replica
    group's, and a shard's peers compute with the gathered shard, so it names no other rank."""
    return rank in divergence.ranks or (not divergence.ranks and not sharded)


def _at_rest(evidence: Sequence[Evidence], sharded: bool = False) -> list[Evidence]:
    """A DDP replica whose weights changed at rest: the replay finds rank ``r``'s local gradient of step
    ``s`` wrong (computed with other weights than the replicas'), and the trace finds ``r``'s weights after
    ``s`` different from the majority's while they were equal after the check before (``WEIGHT_DIVERGENCE``
    whose bound holds ``s``). A wrong local gradient alone is averaged into every replica, which stay
    equal; a wrong update leaves the local gradient right. Both together: ``r``'s state changed between
    the update before ``s`` and its forward, so the replay's evidence is located there (a sharded job's
    rest digest says so directly: ``triage/trace_only.py``). Two replicas of a DDP job have no majority
    to name ``r``; the replay names it, since its gradient is the one computed from weights other
    than the replicas' (:func:`_holds`; not in a sharded job, whose split vote is one group's)."""
    # a sharded job's vote of the gathered parameters (located local_compute) found a transient copy different, not the
    # rank's own weights: the state at rest was right, and its wrong gradient stays local compute
    diverged = [
        e
        for e in evidence
        if e.kind is EvidenceKind.WEIGHT_DIVERGENCE
        and e.source == "trace"
        and e.marks_divergence
        and e.location is not Location.LOCAL_COMPUTE
    ]
    if not diverged:
        return list(evidence)
    out = []
    for ev in evidence:
        if (
            ev.kind is EvidenceKind.REPLAY_MISMATCH
            and ev.location is Location.LOCAL_COMPUTE
            and ev.marks_divergence
            and ev.ranks
            and all(any(_holds(d, r, sharded) and d.onset <= ev.step <= d.step for d in diverged) for r in ev.ranks)
        ):
            ev = dataclasses.replace(
                ev,
                location=Location.STATE_AT_REST,
                detail=(
                    f"{ev.detail}, and its weights after the step differ from the other replicas' though they were equal before "
                    "it: its weights changed in memory between the update before this step and its forward (at rest)"
                ),
            )
        out.append(ev)
    return out


def _pinned(ev: Evidence, examined: Examined) -> Evidence:
    """Evidence that only bounds its fault (replicas found different at a weights check, equal at
    the one before) stops bounding it once a replay examined every step of the bound: the replay's
    own evidence then says where it happened. A replay's own bound (module buffers, digested only
    at checkpoints) is not pinned by replaying its steps: it stays."""
    if (
        ev.earliest_step is None
        or ev.source == "replay"
        or any(s not in examined.replayed for s in range(ev.earliest_step, ev.step + 1))
    ):
        return ev
    return dataclasses.replace(ev, earliest_step=None)


def checkpoint_status(
    note,
    file: CheckpointFile | None,
    *,
    first: int | None,
    weak: Sequence[Evidence] = (),
    majority: str | None,
    examined: Examined,
    unreproduced: Sequence[int] = (),
    sharded: bool = False,
    later_found: bool = False,
) -> CheckpointStatus:
    """The status of checkpoint ``note.step``: the one rule every command uses (``unreproduced``: steps
    whose update the replay did not reproduce on any rank, so they were not replayed exactly;
    ``later_found``: a later checkpoint's file was found, so a missing one was most likely rotated away)."""
    step = note.step
    path = (file.path if file is not None else "") or ""
    report = file.report if file is not None else None
    findings = tuple(report.findings) if report is not None else ()
    if file is not None and file.error:
        return CheckpointStatus(
            step=step, path=path, status=Status.CORRUPT, reasons=(f"unreadable or malformed: {file.error}",)
        )
    bad = [f"{f.kind.value} {f.subject}: {f.detail}" for f in findings if f.kind not in UNVERIFIABLE_FINDINGS]
    copied = [f for f in findings if f.kind in REPLICA_COPY_FINDINGS] if diverged_replica_copy(note, sharded) else []
    if copied:
        # the shards written are not the majority's: a diverged replica's copy, which the trace names (not the disk)
        bad = [
            f"{f.kind.value} {f.subject}: {f.detail}"
            for f in findings
            if f.kind not in UNVERIFIABLE_FINDINGS and f.kind not in REPLICA_COPY_FINDINGS
        ]
        who = (
            f"rank(s) {', '.join(map(str, note.diverged_ranks))} had diverged from their replicas when it was saved (the "
            "recorder's vote)"
            if note.blessed and note.diverged_ranks
            else "the replicas of a shard disagreed when it was saved (no strict majority)"
        )
        bad.insert(
            0,
            f"holds a diverged replica's weights: {who}, and {len(copied)} of its tensors (e.g. {copied[0].subject}) are "
            "not the copy noted at save time: a sharded checkpoint's shard is written by one replica of it, here one "
            "whose weights had diverged (the evidence names the rank); not storage damage",
        )
    if not note.blessed and not note.agreeing_ranks:
        bad.insert(
            0,
            f"saved from rank {note.saved_by_rank} with no strict majority among the replicas: it may be a diverged "
            "replica, and the recorder did not bless it",
        )
    elif note.saved_by_rank in note.diverged_ranks:
        bad.insert(0, f"saved from rank {note.saved_by_rank}, a diverged replica (not the majority's weights)")
    elif not note.blessed:
        bad.insert(0, "the recorder refused to bless it (no strict majority, or the saving rank was not in it)")
    if majority and note.weights_digest and majority != note.weights_digest:
        bad.append(
            f"the note's digest {note.weights_digest} is not the trace's replica majority {majority} for step {step}"
        )
    tainted = first is not None and step > first
    taint = f"holds state after the first divergent step {first} (step {step} > {first})"
    if bad:
        return CheckpointStatus(
            step=step,
            path=path,
            status=Status.CORRUPT,
            reasons=tuple(bad + ([taint] if tainted else [])),
            findings=findings,
            report=report,
        )
    if tainted:
        return CheckpointStatus(
            step=step, path=path, status=Status.TAINTED, reasons=(taint,), findings=findings, report=report
        )
    why: list[str] = []
    if file is not None and file.written_over_by is not None:
        why.append(
            f"its file {file.written_over_path} was written again by checkpoint {file.written_over_by} (the job reused the "
            "name, as a checkpoint limit's rotation can after a resume): its own content is gone, not damaged; the steps "
            "after it can be certified only from the ledger"
        )
    elif file is None or not file.read:
        why.append(
            "the file was not read (trace-only)"
            if examined.trace_only or not examined.files_read
            else f"checkpoint file {note.path} not found, while later checkpoints' files were: most likely deleted after "
            "it was written (a checkpoint limit such as save_total_limit, save_top_k or total_limit deletes the oldest); "
            "the steps after it can then be certified only from the ledger, which `certify --follow` beside the job fills while each "
            "file exists (if it was moved, pass --checkpoints DIR)"
            if later_found
            else f"checkpoint file {note.path} not found (looked where the job wrote it, and in --checkpoints DIR when "
            "given): pass --checkpoints DIR, the folder that holds it"
        )
    why += [f"not verifiable: {f.subject}: {f.detail}" for f in findings if f.kind in UNVERIFIABLE_FINDINGS]
    if not note.weights_digest:
        why.append("no replicas' majority digest was recorded for this step, so its content cannot be confirmed")
    if not examined.trace_consistent:
        why.append("the trace is damaged or inconsistent; its evidence cannot be trusted")
    early = [e for e in weak if e.step < step]
    if early:
        why.append(f"weak evidence at step {early[0].step} ({_who(early[0])}) is unresolved")
    off = [s for s in unreproduced if s < step]
    if off:
        why.append(
            f"the replay did not reproduce the update of step(s) {_spans(off)} (the weights after it differ on every "
            "rank while its gradients matched): those steps were not replayed exactly; check the recipe"
        )
    missing = examined.unexamined_before(step)
    if missing:
        why.append(
            f"steps {_spans(missing)} were not replayed: a wrong local gradient there would not show in the trace"
        )
    loose = sorted(s for s in examined.tolerant_steps if s < step)
    if loose:
        why.append(
            f"steps {_spans(loose)} were compared within tolerance only: a fault below the replay's drift would not show"
        )
    if why:
        return CheckpointStatus(
            step=step, path=path, status=Status.UNVERIFIED, reasons=tuple(why), findings=findings, report=report
        )
    where = "no divergence found" if first is None else f"step {step} <= first divergent step {first}"
    before = (
        "no step before it"
        if step <= examined.first_step
        else f"every step {examined.first_step}..{step - 1} replayed bit for bit"
    )
    return CheckpointStatus(
        step=step,
        path=path,
        status=Status.CLEAN,
        findings=findings,
        report=report,
        reasons=(where, "content as saved, equal to the replicas' majority, no NaN/Inf", before),
    )


#: What a diverged replica's shard written to a sharded checkpoint looks like against its note.
REPLICA_COPY_FINDINGS = frozenset({FindingKind.DIGEST_MISMATCH, FindingKind.WEIGHTS_NOT_MAJORITY})


def diverged_replica_copy(note, sharded: bool) -> bool:
    """True when checkpoint ``note``'s content differing from the note is explained by a diverged
    replica, not storage: a sharded job (each shard written by one of its replicas, any of them)
    whose recorder found ranks diverged when it saved, or no majority among the replicas."""
    return sharded and (bool(note.diverged_ranks) or not note.blessed)


def last_clean(statuses: Iterable[CheckpointStatus]) -> CheckpointStatus | None:
    """The clean checkpoint with the highest step: the resume point (None if there is none)."""
    clean = [s for s in statuses if s.clean]
    return max(clean, key=lambda s: s.step) if clean else None


def _spans(steps: Sequence[int]) -> str:
    return step_ranges(steps, sep="..")


# -- suspects -------------------------------------------------------------------------------------


def find_suspects(evidence: Sequence[Evidence], world_size: int, identity: Callable[[int], Any]) -> tuple[Suspect, ...]:
    """Suspects at the first divergent step, or of a storage-only incident.

    Args:
        evidence: all evidence (hints and weak evidence never name a suspect).
        world_size: ``W``.
        identity: ``rank -> RankIdentity`` (host, gpu).
    """
    first = first_divergent_step(evidence)
    strong = [e for e in evidence if not e.is_hint and not e.is_weak]
    if first is not None:
        at_first = [e for e in strong if e.onset == first and e.marks_divergence]
    else:
        at_first = [e for e in strong if e.location is Location.STORAGE]
    ranked: dict[int | None, list[Evidence]] = {}
    for ev in at_first:
        for rank in ev.ranks or (None,):
            ranked.setdefault(rank, []).append(ev)
    if None in ranked and len(ranked) > 1:
        # rank-specific evidence explains the rank-less observation (its consequence)
        ranked.pop(None)
    # every rank named at once: one shared cause, never W independent faults (design brief, "Common-mode evidence")
    shared = world_size >= 2 and set(range(world_size)) <= {r for r in ranked if r is not None}
    suspects = []
    for rank, evs in sorted(ranked.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        location = min((e.location for e in evs), key=_LOCATION_ORDER.index)
        chain = sorted((e for e in strong if (rank in e.ranks) or (rank is None and not e.ranks)), key=sort_key)
        storage_only = all(e.location is Location.STORAGE for e in evs)
        if storage_only:
            chain = [e for e in chain if e.location is Location.STORAGE]
            steps = tuple(sorted({e.step for e in chain}))
        else:
            steps = fault_events([e for e in chain if e.location is not Location.STORAGE], rank, world_size) or (first,)
        ident = identity(rank) if rank is not None else None
        suspects.append(
            Suspect(
                rank=rank,
                host=(ident.host or None) if ident else None,
                gpu=(ident.gpu or None) if ident and not storage_only else None,
                location=location,
                recurring=rank is not None and not storage_only and not shared and len(steps) > 1,
                steps=steps,
                evidence=tuple(chain),
                shared=shared and rank is not None,
                replicas=world_size,
            )
        )
    return tuple(suspects)


# evidence after which a rank's replica stays different from the others (until seen equal again)
_PERSISTENT = (EvidenceKind.WEIGHT_DIVERGENCE,)


def fault_events(chain: Sequence[Evidence], rank: int | None, world_size: int) -> tuple[int, ...]:
    """The steps of independent fault events in one rank's evidence chain.

    An observation is a new event unless it is a consequence of an earlier one. Once the rank's
    replica diverged (its weights differ from the majority, or its optimizer update or its
    all-reduce result went wrong, both of which leave its weights different), every later
    observation on it is the same event: DDP never re-synchronises replicas, and a resumed run
    is a new attempt. A wrong local gradient is averaged into every replica, which stay equal, so
    a later fault on the same rank is a new event. Evidence naming half the ranks or more is not
    counted per rank.
    """
    events: list[int] = []
    diverged = False
    for ev in sorted(chain, key=sort_key):
        if not ev.marks_divergence:
            continue
        if rank is not None and len(ev.ranks) > 1 and len(ev.ranks) * 2 >= world_size:
            # half the ranks or more at once: not this rank's own event
            continue
        if diverged:
            continue
        if not events or ev.step != events[-1]:
            events.append(ev.step)
        if ev.kind in _PERSISTENT or ev.location in (
            Location.OPTIMIZER_UPDATE,
            Location.COLLECTIVE,
            Location.STATE_AT_REST,
        ):
            diverged = True
    return tuple(events)
