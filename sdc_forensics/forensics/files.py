"""The checkpoint files an analysis reads: which file is checkpoint ``N``, and what reading it gave.

:func:`checkpoint_file` is the one answer to "which file is checkpoint N" (the file verified, the
interval replayed from it, the ledger's record of it, the follower's "is it still there?");
:func:`verify_files` reads every noted file against its note (``checkpoint.verify``), and
:func:`storage_evidence` turns a file that differs from what was saved into evidence. A file that
is damaged, or saved from a wrong state, is never replayed from (:func:`replayable`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from sdc_forensics.checkpoint.findings import ANOTHER_LAYOUT, FindingKind
from sdc_forensics.decide import decision
from sdc_forensics.decide.decision import CheckpointFile
from sdc_forensics.evidence import Evidence, EvidenceKind, Location
from sdc_forensics.replay.options import AnalysisOptions
from sdc_forensics.trace.checkpoints import CheckpointNote

__all__ = ["checkpoint_file", "replayable", "storage_evidence", "verify_files"]

# the file differs from what was saved (storage), or holds NaN/Inf or not-the-majority content
# (saved that way: a consequence of a divergence): never replayed from
_NOT_A_START = decision.STORAGE_FINDINGS | decision.STATE_FINDINGS


def checkpoint_file(
    note: CheckpointNote, trace_path: str | os.PathLike, options: AnalysisOptions | None = None
) -> Path | None:
    """Which file is checkpoint ``note.step``: the one ``options.checkpoint_paths`` names for it (the file
    ``verify-checkpoint PATH --trace`` asks about), else the one ``--checkpoints`` or the note leads to from the
    trace directory (``checkpoint.locate.locate_checkpoint``); None when none is found.

    Args:
        note: the checkpoint's note.
        trace_path: the trace directory (relative note paths are found from it).
        options: the analysis options (None: the note's own paths, as ``inspect`` reads them).
    """
    from sdc_forensics.checkpoint.locate import locate_checkpoint

    if options is None:
        return locate_checkpoint(note, None, trace_path)
    return options.checkpoint_paths.get(note.step) or locate_checkpoint(note, options.checkpoints_dir, trace_path)


def earlier_attempt_files(trace, options: AnalysisOptions | None = None) -> list[tuple[Path, CheckpointNote]]:
    """``(file, note)`` of each checkpoint an earlier attempt saved that a later attempt noted again
    at another path (Lightning's ``-v1``, another HF ``output_dir``): still on disk, and holding the
    earlier attempt's state. A later checkpoint written over the same file is not one of them.
    ``certify`` names them; ``verify-checkpoint FILE --trace`` judges one on its own attempt."""
    from sdc_forensics.trace.checkpoints import read_checkpoint_notes

    latest = {n.step: n for n in trace.checkpoint_notes()}
    out = []
    for note in read_checkpoint_notes(trace.path, every_attempt=True):
        newer = latest.get(note.step)
        if newer is None or newer.attempt == note.attempt:
            continue
        found = checkpoint_file(note, trace.path, options)
        if found is None:
            continue
        again = checkpoint_file(newer, trace.path, options)
        if again is None or again.resolve() != found.resolve():
            out.append((found, note))
    return out


def verify_files(
    notes: Sequence[CheckpointNote], options: AnalysisOptions, trace_path: Path, seed: int
) -> dict[int, CheckpointFile]:
    """``{N: CheckpointFile}`` for every noted checkpoint, digested with the trace's seed."""
    from sdc_forensics.checkpoint.verify import VerifyOptions, verify_checkpoint
    from sdc_forensics.errors import CheckpointError

    out = {}
    # a file two notes lead to holds the latest one's content (Accelerate's automatic names restart after a
    # resume, and its rotation deletes checkpoint_1 before writing a later step there): the earlier one's is gone
    located = {note.step: checkpoint_file(note, trace_path, options) for note in notes}
    owner: dict[Path, CheckpointNote] = {}
    for note in sorted(notes, key=lambda n: (n.attempt, n.step)):
        if located[note.step] is not None:
            owner[located[note.step].resolve()] = note
    for note in notes:
        path = located[note.step]
        latest = owner.get(path.resolve()) if path is not None else None
        if latest is not None and latest.step != note.step:
            out[note.step] = CheckpointFile(written_over_by=latest.step, written_over_path=str(path))
            continue
        report, error = None, ""
        if path is not None:
            try:
                report = verify_checkpoint(path, note=note, options=VerifyOptions(seed=seed))
            except CheckpointError as exc:
                error = str(exc)
        out[note.step] = CheckpointFile(path=str(path) if path else "", report=report, error=error)
    return out


def replayable(file: CheckpointFile) -> bool:
    """True when ``file`` was read and is neither damaged nor saved from a wrong state, nor laid out
    unlike its note (a DeepSpeed folder or a converted file named for a noted checkpoint): a replay
    may start from it."""
    return file.report is not None and not any(
        f.kind.value in _NOT_A_START or f.subject == ANOTHER_LAYOUT for f in file.report.findings
    )


def storage_evidence(
    notes: Sequence[CheckpointNote], files: Mapping[int, CheckpointFile], sharded: bool = False
) -> list[Evidence]:
    """Evidence of each noted file that differs from what its rank saved, or cannot be read (storage)."""
    out = []
    for note in notes:
        file = files[note.step]
        findings = (
            [f for f in file.report.findings if f.kind.value in decision.STORAGE_FINDINGS]
            if file.report is not None
            else []
        )
        # a diverged replica's shard, written as it was: not the disk
        if decision.diverged_replica_copy(note, sharded):
            findings = [f for f in findings if f.kind is not FindingKind.DIGEST_MISMATCH]
        if file.error or findings:
            first = findings[0] if findings else None
            out.append(
                Evidence(
                    kind=EvidenceKind.CHECKPOINT_MISMATCH,
                    step=note.step,
                    ranks=(note.saved_by_rank,),
                    source="checkpoint",
                    expected=first.expected if first else "a readable checkpoint",
                    found=first.found if first else file.error,
                    location=Location.STORAGE,
                    affects_state=False,
                    detail=f"checkpoint {Path(file.path or note.path).name}: "
                    + (f"{first.kind.value} in {first.subject}" if first else "unreadable")
                    + "; the file differs from what rank {} saved".format(note.saved_by_rank),
                )
            )
    return out
