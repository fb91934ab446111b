"""Checkpoint notes: what the recorder knew about each checkpoint when it was written.

One JSON file per checkpoint and attempt, ``TRACE_DIR/checkpoints/step-NNNNNNNN.attempt-AAA.json``,
written atomically by the rank that saved the checkpoint (a rank of the strict majority) after the replicas' weights were compared. Digests are
16-digit lowercase hex strings of the exact digest (``docs/fingerprints.md``).

``weights_digest`` is the combined digest of the model parameters, in ``param_names`` order,
of the strict majority of replicas at that step; ``tensors`` maps every tensor in the checkpoint
file (model and optimizer state, by the key it is saved under) to its digest at save time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from sdc_forensics.errors import TraceError

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


def note_path(trace_dir: str | os.PathLike, step: int, attempt: int) -> Path:
    """Where the note of checkpoint ``step`` written in ``attempt`` lives."""
    return Path(trace_dir) / NOTES_DIR / f"step-{step:08d}.attempt-{attempt:03d}.json"


def write_checkpoint_note(trace_dir: str | os.PathLike, note: CheckpointNote) -> Path:
    """Write a note atomically."""
    path = note_path(trace_dir, note.step, note.attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(note), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_checkpoint_notes(trace_dir: str | os.PathLike) -> list[CheckpointNote]:
    """All notes, sorted by step; for a step noted by several attempts, the latest attempt wins."""
    folder = Path(trace_dir) / NOTES_DIR
    if not folder.is_dir():
        return []
    latest: dict[int, CheckpointNote] = {}
    names = {f.name for f in dataclasses.fields(CheckpointNote)}
    for path in sorted(folder.glob("step-*.attempt-*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            doc = {k: v for k, v in doc.items() if k in names}
            for key in ("param_names", "agreeing_ranks", "diverged_ranks"):
                doc[key] = tuple(doc.get(key, ()))
            note = CheckpointNote(**doc)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
            raise TraceError(f"{path} is not a valid checkpoint note ({exc}); remove or restore it") from None
        if note.step not in latest or note.attempt >= latest[note.step].attempt:
            latest[note.step] = note
    return [latest[s] for s in sorted(latest)]
