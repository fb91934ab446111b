"""Checkpoint notes: what the recorder knew about each checkpoint when it was written.

One JSON file per checkpoint and attempt, ``TRACE_DIR/checkpoints/step-NNNNNNNN.attempt-AAA.json``,
written atomically by the rank that saved the checkpoint (a rank of the strict majority) after the replicas' weights were compared. Digests are
16-digit lowercase hex strings of the exact digest (``docs/fingerprints.md``).

``weights_digest`` is the combined digest of the model parameters, in ``param_names`` order,
of the strict majority of replicas at that step; ``tensors`` maps every tensor in the checkpoint
file (model and optimizer state, by the key it is saved under) to its digest at save time.

``path`` is the checkpoint path as the job wrote it (often relative to the job's working
directory); ``path_from_trace`` (optional, absent in older notes) is the same file relative to
the trace directory, so that a trace read from another directory, or moved together with its
checkpoints, still finds them (``checkpoint/locate.py``). Both are hostile input: readers only
follow them inside the trace directory's ancestors (``docs/trace-format.md``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from sdc_forensics.errors import TraceError, reader
from sdc_forensics.newfile import write_atomic
from sdc_forensics.trace.format import MAX_STEP
from sdc_forensics.trace.manifest import MAX_ATTEMPT, MAX_WORLD_SIZE
from sdc_forensics.untrusted import Fields, load_json

NOTES_DIR = "checkpoints"


def hex64(value: int) -> str:
    """A digest as 16 lowercase hex digits."""
    return f"{int(value) % (1 << 64):016x}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointNote:
    """One checkpoint as recorded at save time.

    Attributes:
        step: number of completed steps the checkpoint holds (checkpoint N holds theta_N).
        path: the checkpoint path as the training job wrote it.
        path_from_trace: the same file relative to the trace directory (``../checkpoints/x.pt``),
            "" when not recorded (notes written before it was added).
        attempt: the attempt that wrote it.
        weights_digest: majority replica weights digest (hex) at this step, "" if none.
        param_names: parameter names, in the order ``weights_digest`` combines them.
        tensors: key -> digest (hex) of every tensor saved, as the saving rank held it.
        saved_by_rank: the global rank whose state was written.
        agreeing_ranks: ranks whose weights matched the majority.
        diverged_ranks: ranks whose weights did not.
        blessed: False when the recorder refused to bless it (no strict majority, or the saving
            rank was not in the majority).
        file_digests: relative file name -> digest (hex) of the file bytes, when computed.
    """

    step: int
    path: str
    attempt: int = 0
    weights_digest: str = ""
    param_names: tuple[str, ...] = ()
    tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    saved_by_rank: int = 0
    agreeing_ranks: tuple[int, ...] = ()
    diverged_ranks: tuple[int, ...] = ()
    blessed: bool = True
    file_digests: dict[str, str] = dataclasses.field(default_factory=dict)
    saved_ns: int = 0
    path_from_trace: str = ""


def note_path(trace_dir: str | os.PathLike, step: int, attempt: int) -> Path:
    """Where the note of checkpoint ``step`` written in ``attempt`` lives."""
    return Path(trace_dir) / NOTES_DIR / f"step-{step:08d}.attempt-{attempt:03d}.json"


def write_checkpoint_note(trace_dir: str | os.PathLike, note: CheckpointNote) -> Path:
    """Write a note atomically."""
    path = note_path(trace_dir, note.step, note.attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dataclasses.asdict(note)
    # an optional key: older notes (and the golden files) stay as they were
    if not note.path_from_trace:
        del doc["path_from_trace"]
    return write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


_HEX16 = re.compile(r"[0-9a-f]{16}")
_HINT = "remove or restore it (it was not written by sdc-forensics, or is damaged)"


@reader
def parse_checkpoint_note(doc, where: str) -> CheckpointNote:
    """A decoded note, every field type- and range-checked; raises :class:`TraceError`."""
    f = Fields(doc, f"{where} (checkpoint note)", TraceError, _HINT)
    weights_digest = f.str("weights_digest", "", max_len=64)
    tensors, file_digests = f.str_map("tensors", {}), f.str_map("file_digests", {})
    for key, digests in (
        ("weights_digest", [weights_digest] if weights_digest else []),
        ("tensors", tensors.values()),
        ("file_digests", file_digests.values()),
    ):
        bad = next((d for d in digests if not _HEX16.fullmatch(d)), None)
        # digests are 16 lowercase hex digits (hex64); anything else is not a digest
        if bad is not None:
            raise f.fail(key, "16 lowercase hex digits per digest", bad)
    return CheckpointNote(
        step=f.int("step", lo=0, hi=MAX_STEP),
        path=f.str("path"),
        attempt=f.int("attempt", 0, lo=0, hi=MAX_ATTEMPT),
        weights_digest=weights_digest,
        param_names=f.strs("param_names", ()),
        tensors=tensors,
        saved_by_rank=f.int("saved_by_rank", 0, lo=0, hi=MAX_WORLD_SIZE - 1),
        agreeing_ranks=f.ints("agreeing_ranks", (), lo=0),
        diverged_ranks=f.ints("diverged_ranks", (), lo=0),
        blessed=f.bool("blessed", True),
        file_digests=file_digests,
        saved_ns=f.int("saved_ns", 0, lo=-(1 << 63), hi=(1 << 63) - 1),
        path_from_trace=_relative_path(f, "path_from_trace"),
    )


def _relative_path(f: Fields, key: str) -> str:
    value = f.str(key, "", max_len=4096)
    if value and not climbs_then_descends(value):
        raise f.fail(
            key, "a relative path: leading '..' components, then names (e.g. ../checkpoints/step-00000010.pt)", value
        )
    return value


def climbs_then_descends(path: str) -> bool:
    """Whether ``path`` is relative, climbs only with leading ``..`` components, then only
    descends: ``../checkpoints/step-00000010.pt`` yes; ``/etc/x``, ``a/../../b``, ``C:x``, ``..`` no.
    Joined to a directory, such a path always lands under that directory or one of its ancestors."""
    parts = path.replace("\\", "/").split("/")
    climbs = 0
    while climbs < len(parts) and parts[climbs] == "..":
        climbs += 1
    rest = parts[climbs:]
    return (
        bool(rest)
        and "\0" not in path
        and not path.startswith("/")
        and ":" not in parts[0]
        and all(p not in ("", ".", "..") for p in rest)
    )


@reader
def read_checkpoint_notes(
    trace_dir: str | os.PathLike, max_attempt: int | None = None, every_attempt: bool = False
) -> list[CheckpointNote]:
    """All notes, sorted by step; for a step noted by several attempts, the latest attempt wins.

    ``max_attempt``: the notes as they stood when that attempt was the latest (a later attempt's are left out).
    ``every_attempt``: every attempt's note of a step, by step then attempt (a resumed run's earlier
    checkpoint files are still on disk, and still the earlier attempt's).

    Raises:
        TraceError: a note is not valid JSON or a field has the wrong type or range.
    """
    folder = Path(trace_dir) / NOTES_DIR
    if not folder.is_dir():
        return []
    latest: dict = {}
    for path in sorted(folder.glob("step-*.attempt-*.json")):
        try:
            doc = load_json(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise TraceError(f"{path} is not a valid checkpoint note ({exc}); {_HINT}") from None
        note = parse_checkpoint_note(doc, str(path))
        if max_attempt is not None and note.attempt > max_attempt:
            continue
        if every_attempt:
            latest[(note.step, note.attempt)] = note
        elif note.step not in latest or note.attempt >= latest[note.step].attempt:
            latest[note.step] = note
    return [latest[s] for s in sorted(latest)]


def superseded_by(note: CheckpointNote, attempts) -> int | None:
    """The later attempt that re-executed the step before checkpoint ``note.step`` without saving
    that checkpoint again (a resume from a checkpoint before it), or None: the checkpoint then holds
    its own attempt's state, off the latest lineage, and is judged with its own attempt's steps.
    ``attempts``: the manifest's (``Attempt.attempt``, ``Attempt.start_step``)."""
    later = [a.attempt for a in attempts if a.attempt > note.attempt and a.start_step < note.step]
    return min(later) if later else None


def unreplayable_steps(first_step: int | None, checkpoint_steps) -> tuple[int, int] | None:
    """Steps ``(first, last)`` that come before the run's first checkpoint, or None.

    Replay starts from a checkpoint, and checkpoint ``N`` holds the state *after* ``N`` steps, so
    a run whose first checkpoint is ``N > first_step`` has steps ``first_step..N-1`` that no
    replay can ever re-execute: nothing after them can be certified clean. The fix is a
    checkpoint of ``first_step`` (the initial state: checkpoint 0), saved before the first step.
    No checkpoint at all is not a gap here (every command says that on its own).
    """
    steps = sorted(int(s) for s in checkpoint_steps)
    if first_step is None or not steps or steps[0] <= first_step:
        return None
    return int(first_step), steps[0] - 1


def unreplayable_text(gap: tuple[int, int]) -> str:
    """The one sentence every command and the recorder say about :func:`unreplayable_steps`."""
    first, last = gap
    steps = f"step {first}" if first == last else f"steps {first}..{last}"
    return (
        f"the first checkpoint is {last + 1}, and none holds the state before step {first}: {steps} can "
        f"never be replayed, so no checkpoint of this run can be certified clean; save checkpoint {first} before the "
        f'first step runs (rec.checkpoint({first}, path, state) before the training loop; docs/recorder.md, "Checkpoints")'
    )
