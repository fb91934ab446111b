"""DeepSpeed's ``engine.save_checkpoint`` folders, read without DeepSpeed.

``engine.save_checkpoint(DIR)`` writes ``DIR/TAG/mp_rank_00_model_states.pt`` (the module's state
under ``module``: plain tensors and values, read like any ``torch.save`` file), one
``DIR/TAG/zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank (below), and at the top ``latest``
(a text file naming TAG) and DeepSpeed's conversion scripts ``zero_to_fp32.py`` and
``zero_to_torch.py``. The top-level three are bookkeeping no resume loads: a folder reader lists
them as ignored (:func:`is_bookkeeping`; still checksummed), not as unverifiable files.

``TAG/zero_pp_rank_R_mp_rank_00_optim_states.pt`` (DeepSpeed 0.19, ZeRO 1, 2 and 3) pickles, next
to its tensors (the fp32 partition, the torch optimizer's state) and plain values, three
DeepSpeed objects that torch's ``weights_only`` allow-list refuses:

* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (the loss scaler: a plain object, rebuilt by
  ``NEWOBJ`` then ``BUILD`` with its ``__dict__``),
* ``deepspeed.runtime.zero.config.ZeroStageEnum`` (the ZeRO stage: an ``int`` enum, rebuilt by
  ``REDUCE`` with its value),
* ``deepspeed.utils.tensor_fragment.fragment_address`` (a dataclass: where a parameter's slice
  lies in the flat partition, two integers).

The checkpoint readers map exactly those three names to the inert classes below
(``torch.serialization.safe_globals`` with ``(class, "module.name")`` pairs): DeepSpeed is never
imported, and nothing of it runs. A placeholder keeps what the pickle handed it, as data
(``args``, ``state``); it has no behaviour, so the worst a hostile file can do through it is
store values. Every other global stays refused as before.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sdc_forensics.checkpoint.base import FileIssue

#: what engine.save_checkpoint copies beside its TAG folders: DeepSpeed's offline conversion scripts
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
#: the pointer file naming the last TAG
LATEST = "latest"
_MAX_TAG_BYTES = 4096


class _Inert:
    """Stands for a DeepSpeed object in a loaded checkpoint: holds what the pickle handed it, does nothing."""

    #: the DeepSpeed global this class stands for
    stands_for = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<placeholder for {self.stands_for}>"


def _placeholder(name: str) -> type:
    # one class per name: torch's unpickler matches the object's exact type against the allow-list
    return type(f"Placeholder_{name.rsplit('.', 1)[1]}", (_Inert,), {"stands_for": name, "__module__": __name__})


#: DeepSpeed's globals in its optimizer files, and the inert class each is read as
PLACEHOLDERS: dict[str, type] = {
    name: _placeholder(name)
    for name in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    )
}


def safe_globals_entries() -> list[tuple[type, str]]:
    """``torch.serialization.safe_globals`` entries mapping each DeepSpeed name to its placeholder."""
    return [(cls, name) for name, cls in PLACEHOLDERS.items()]


def _latest_tag(root: Path) -> str | None:
    """The text of ``root/latest``, stripped (None: unreadable or not UTF-8). Read-only, bounded: a
    hostile folder's "latest" may be anything."""
    try:
        with open(root / LATEST, "rb") as fh:
            return fh.read(_MAX_TAG_BYTES + 1).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def dangling_latest(root: Path, rel: str) -> str | None:
    """The tag a top-level ``latest`` names where no such sub-folder exists (DeepSpeed's resume would
    fail on it), else None."""
    tag = _latest_tag(root) if rel == LATEST else None
    # only a plausible tag name: anything else stays a file of unknown format
    if tag is None or not re.fullmatch(r"[A-Za-z0-9_.-]{1,256}", tag) or tag in (".", ".."):
        return None
    return None if (root / tag).exists() else tag


def is_bookkeeping(root: Path, rel: str) -> bool:
    """Whether ``rel`` (relative to the folder ``root``) is ``latest`` or a conversion script at the top
    of a DeepSpeed ``save_checkpoint`` folder: ``latest`` is UTF-8 text naming a sub-folder of ``root``."""
    tag = _latest_tag(root) if rel == LATEST or rel in SCRIPTS else None
    if not tag or len(tag) > _MAX_TAG_BYTES or tag in (".", "..") or "/" in tag or "\\" in tag:
        return False
    where = root / tag
    return where.is_dir() and not where.is_symlink()


#: one rank's ZeRO file in a TAG folder (``bf16_`` under DeepSpeed's bf16 optimizer)
_ZERO_FILE = re.compile(
    r"(?P<prefix>(?:bf16_)?zero_pp_rank_)(?P<rank>\d+)(?P<rest>_mp_rank_(?P<mp>\d+)_optim_states\.pt)"
)
#: at most this many absent ranks are listed per folder (a hostile count must not list millions)
_MAX_LISTED = 16


def _ranks_saved(payload: Any) -> int | None:
    """How many data-parallel ranks a ZeRO file says saved the checkpoint: ``partition_count``
    (an int under ZeRO 3, one per parameter group under ZeRO 1 and 2), else None."""
    state = payload.get("optimizer_state_dict") if isinstance(payload, dict) else None
    count = state.get("partition_count") if isinstance(state, dict) else None
    if isinstance(count, (list, tuple)) and count and len(set(count)) == 1:
        count = count[0]
    return count if isinstance(count, int) and not isinstance(count, bool) and 0 < count <= 1 << 20 else None


def missing_ranks(files: list[tuple[Path, Any]], relative) -> list[FileIssue]:
    """The ZeRO files a TAG folder lacks: each present ``zero_pp_rank_R_mp_rank_M_optim_states.pt``
    (``files``: its path and loaded payload) says how many ranks saved; every absent rank's file is
    one issue. DeepSpeed cannot load such a folder (a trial user's folder without rank 1's file was
    VERIFIED)."""
    seen: dict[tuple[Path, str, str, str], tuple[set[int], set[int]]] = {}
    for path, payload in files:
        match = _ZERO_FILE.fullmatch(path.name)
        if match is None:
            continue
        ranks, counts = seen.setdefault((path.parent, match["prefix"], match["rest"], match["mp"]), (set(), set()))
        ranks.add(int(match["rank"]))
        count = _ranks_saved(payload)
        if count is not None:
            counts.add(count)
    issues = []
    for (folder, prefix, rest, _), (ranks, counts) in sorted(seen.items(), key=lambda kv: str(kv[0])):
        if len(counts) != 1:
            continue
        total = counts.pop()
        absent = sorted(set(range(total)) - ranks)
        for rank in absent[:_MAX_LISTED]:
            issues.append(
                FileIssue(
                    file=relative(folder / f"{prefix}{rank}{rest}"),
                    detail=f"missing: the ZeRO files say {total} ranks saved this checkpoint and {len(ranks)} "
                    f"{'is' if len(ranks) == 1 else 'are'} here: the DeepSpeed checkpoint is incomplete (DeepSpeed "
                    "cannot load it); copy every rank's file into the folder",
                )
            )
    return issues
