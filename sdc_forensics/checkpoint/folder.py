"""A checkpoint folder: the model checkpoint it holds plus every other file below it, each one
verified or listed as not verifiable.

A training job rarely writes one file. Hugging Face's ``Trainer`` writes ``checkpoint-500/``::

    model.safetensors        (or model-0000K-of-0000N.safetensors + model.safetensors.index.json)
    optimizer.pt  scheduler.pt  scaler.pt  rng_state.pth       torch.save files
    trainer_state.json  config.json  generation_config.json     JSON
    training_args.bin                                           torch.save of a pickled dataclass (configuration)
    tokenizer.json  tokenizer_config.json  special_tokens_map.json  merges.txt  ...

A NaN in the optimizer state ruins a resumed run as surely as one in the weights, so a folder is
verified whole. Every regular file below it falls in exactly one class:

* **the model checkpoint** (:func:`~sdc_forensics.checkpoint.kinds.main_format`: a DCP
  directory, an HF index and its shards, one ``.safetensors`` (``model.safetensors`` among
  several), or ``pytorch_model.bin``): read by its reader, tensors keyed as that reader keys them,
  so parameter names still match the trace's checkpoint note;
* **another tensor file** (``.safetensors``, a ``torch.save`` zip, a sub-directory holding a DCP
  ``.metadata`` as FSDP writes): read, digested and NaN/Inf-checked the same way, its tensors keyed
  ``FILE/KEY`` (``optimizer.pt/state.0.exp_avg``, ``pytorch_model_fsdp_0/model.w``) so that they
  never collide with model keys. One whose pickle needs a global outside the ``weights_only``
  allow-list (a pickled dataclass, a numpy array) or is a legacy raw pickle, or that holds a
  tensor verification cannot read as dense bits (a quantized or sparse optimizer state), is *not
  verifiable*; one that is truncated or corrupt is *damaged* (a finding, not an exit-3 error: the rest of the
  folder is still reported);
* **a metadata file** (``*.json`` must parse; ``*.txt``, ``*.md``, ``*.yaml``, ``*.yml``,
  ``.gitattributes``, ``.gitignore`` must be UTF-8): read and checksummed; one that does not
  parse is *damaged*. ``trainer_state.json``'s ``global_step`` is the folder's step when the
  model checkpoint names none;
* **anything else** (``foo.npy``, ``tokenizer.model``, a ``.distcp`` no ``.metadata`` names):
  *not verifiable*, with a detail saying what it is and what to do. Its bytes are checksummed all
  the same, so a certificate still pins them.

Never opened, and *not verifiable*: a symbolic link whose target is outside the folder (unless
the folder lies in a ``huggingface_hub`` cache snapshot, ``models--ORG--NAME/snapshots/REV/FILE
-> ../../blobs/HASH``: targets in that repository's ``blobs/`` are followed; or the target lies
in a root the user allows, ``ReadLimits.allow_roots``, ``--allow-root``), a dangling link, a link
to a directory, anything not a regular file (FIFO, socket, device). When the model checkpoint
itself is such a link the folder is refused (:class:`CheckpointError`, exit 3) before the link
is opened: there is nothing to verify without it.

Ignored, and listed in the report (:meth:`FolderReader.ignored`): ``.git/`` and
``.cache/huggingface/`` at the folder's top, version control and ``huggingface_hub`` download
bookkeeping (lock files, etag ``*.metadata``) that no training job loads; and the Trainer's
``training_args.bin`` at the top when its pickle is refused (the job's arguments, never loaded at
resume: checksummed, not unpickled, no state to verify); DeepSpeed's ``latest`` and conversion
scripts at the top of an ``engine.save_checkpoint`` folder (``deepspeed_files.is_bookkeeping``).
DeepSpeed's optimizer files are read with its three pickled classes as inert placeholders
(``deepspeed_files.py``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from sdc_forensics.checkpoint.base import CheckpointReader, FileIssue, MappedFile, TensorInfo
from sdc_forensics.checkpoint.dcp_reader import METADATA_NAME, DcpReader
from sdc_forensics.checkpoint.deepspeed_files import LATEST, SCRIPTS, dangling_latest, is_bookkeeping, missing_ranks
from sdc_forensics.checkpoint.kinds import NOTHING_TO_READ, TORCH_SUFFIXES, main_format, open_file, sniff_file
from sdc_forensics.checkpoint.hf_index import read_index
from sdc_forensics.checkpoint.limits import ReadLimits, link_advice, link_bounds, outside, resolve
from sdc_forensics.checkpoint.torch_reader import NUMPY_HINT, PickleRefused, TensorNotReadable
from sdc_forensics.errors import CheckpointError

IGNORED = (".git", ".cache/huggingface")
TEXT_SUFFIXES = (".txt", ".md", ".yaml", ".yml")
TEXT_NAMES = (".gitattributes", ".gitignore")
_WHAT = {
    ".npy": "a numpy array file",
    ".npz": "a numpy archive",
    ".model": "a binary tokenizer model (sentencepiece)",
    ".msgpack": "a Flax checkpoint",
    ".h5": "an HDF5 (Keras/TensorFlow) checkpoint",
    ".distcp": "a DCP data file that no .metadata names (left over from another save?)",
    ".pkl": "a plain pickle, which is never loaded (it could run code)",
    ".pickle": "a plain pickle, which is never loaded (it could run code)",
}
_CHECKSUM_ONLY = "its bytes are checksummed but its content is not verified"


class FolderReader(CheckpointReader):
    """A checkpoint directory read whole: the model checkpoint plus every other file below it.

    Args:
        directory: the folder.
        populate: pre-fault memory maps of safetensors files.
        limits: what reading may cost, where links may lead (default: ``limits.current_limits()``).

    Raises:
        CheckpointError: the model checkpoint is malformed or is a link that is not followed, or
            the folder holds no tensor file at all.
    """

    def __init__(self, directory: str | Path, *, populate: bool = False, limits: ReadLimits | None = None) -> None:
        directory = Path(directory)
        super().__init__(directory, directory)
        if not directory.is_dir():
            raise CheckpointError(f"{directory} is not a directory")
        limits = resolve(limits)
        self._bounds = link_bounds(directory, limits)
        # every part (a sub-directory's DCP, a file) may link wherever the folder may
        self._limits = dataclasses.replace(limits, allow_roots=(*limits.allow_roots, *self._bounds))
        files, refused, self._ignored, dcp_dirs = _scan(directory, self._bounds)
        self._unverifiable = list(refused)
        self._issues: list[FileIssue] = []
        # (key prefix, reader); "" = the model checkpoint
        self._parts: list[tuple[str, CheckpointReader]] = []
        # metadata and not-verifiable files: checksummed only
        self._other_files: list[Path] = []
        self._trainer_step: int | None = None
        self.format = "folder"
        try:
            found = main_format(directory)
            if found is None or found[0] != "hf-index":
                self._unverifiable += _missing_shards(directory, files)
            if found is not None:
                self.format = found[0]
                self._open_main(*found, refused={issue.file: issue.detail for issue in refused}, populate=populate)
            claimed = {self.relative(path) for _, part in self._parts for path in part.files}
            for sub in dcp_dirs:
                if self.relative(sub) not in claimed:
                    claimed |= self._open_nested_dcp(sub, files)
            tensor_files = 0
            for path in files:
                rel = self.relative(path)
                if rel not in claimed:
                    tensor_files += self._account(path, rel, populate=populate)
            if found is None and not dcp_dirs and not tensor_files:
                raise CheckpointError(f"{directory} {NOTHING_TO_READ}")
            loaded = [(path, getattr(part, "_payload", None)) for _, part in self._parts for path in part.files]
            self._unverifiable += missing_ranks(loaded, self.relative)
        except CheckpointError:
            self.close()
            raise

    def _open_main(self, kind: str, path: Path, *, refused: dict[str, str], populate: bool) -> None:
        def check(rel: str) -> None:
            if rel in refused:
                raise CheckpointError(f"{self.root}: its model checkpoint file {rel} is a {refused[rel]}")

        candidates = [self.relative(path)] if kind != "dcp" else [METADATA_NAME]
        for rel in candidates:
            check(rel)
        if kind == "hf-index":
            for shard in sorted(set(read_index(path)[0].values())):
                check(shard)
        main = open_file(
            path,
            kind,
            root=self.root,
            populate=populate,
            limits=self._limits,
            # links checked before opening
        )
        self._parts.append(("", main))
        for file in main.files:
            check(self.relative(file))
            real = outside(file, self._bounds)
            # not reachable: every reader checks its files before opening them
            if real is not None:
                raise CheckpointError(
                    f"{self.root}: its model checkpoint file {self.relative(file)} lies outside the folder ({real}); not followed"
                )

    def _open_nested_dcp(self, sub: Path, files: list[Path]) -> set[str]:
        """A DCP checkpoint in a sub-directory; the names it accounts for (all of the sub-directory's when unreadable)."""
        rel = self.relative(sub)
        try:
            reader = DcpReader(sub, limits=self._limits)
        except CheckpointError as exc:
            self._issues.append(FileIssue(file=f"{rel}/", detail=f"the DCP checkpoint in {rel}/ cannot be read: {exc}"))
            inside = [path for path in files if Path(self.relative(path)).is_relative_to(rel)]
            self._other_files += inside
            return {self.relative(path) for path in inside}
        self._parts.append((f"{rel}/", reader))
        return {self.relative(path) for path in reader.files}

    def _account(self, path: Path, rel: str, *, populate: bool) -> int:
        """Verify, or list as not verifiable, one file outside the model checkpoint; 1 if it is a tensor file."""
        name = path.name
        # DeepSpeed's "latest" and conversion scripts beside its TAG folders: no resume loads them
        # (the scripts beside a "latest" whose tag is gone are DeepSpeed's still: said once, on "latest")
        if is_bookkeeping(self.root, rel) or (rel in SCRIPTS and dangling_latest(self.root, LATEST) is not None):
            self._other_files.append(path)
            self._ignored = (*self._ignored, rel)
            return 0
        tag = dangling_latest(self.root, rel)
        if tag is not None:
            self._other_files.append(path)
            self._unverifiable.append(
                FileIssue(
                    file=rel,
                    detail=f"DeepSpeed's pointer names checkpoint {tag!r}, which is not in this folder: a resume "
                    "from the folder (engine.load_checkpoint without a tag) fails; copy that tag's folder in, or "
                    "verify the tag folder you mean",
                )
            )
            return 0
        if name.endswith(".json") or name.endswith(TEXT_SUFFIXES) or name in TEXT_NAMES:
            self._other_files.append(path)
            self._check_text(path, rel)
            return 0
        kind = sniff_file(path)
        if kind is None:
            self._other_files.append(path)
            what = _WHAT.get(path.suffix.lower(), f"a file of unknown format ({path.suffix or 'no suffix'})")
            self._unverifiable.append(
                FileIssue(
                    file=rel,
                    detail=f"{what}, a format sdc-forensics does not read: {_CHECKSUM_ONLY}. "
                    "Move it out of the checkpoint folder if it is not part of the checkpoint, or verify it by other means",
                )
            )
            return 0
        # read-only
        with open(path, "rb") as fh:
            head = fh.read(2)
        if kind == "torch" and head != b"PK" and head[:1] != b"\x80":
            self._other_files.append(path)
            if not head:
                self._issues.append(
                    FileIssue(file=rel, detail="the file is empty: the save was interrupted or the file was truncated")
                )
            else:
                self._unverifiable.append(
                    FileIssue(
                        file=rel,
                        detail=f"a {path.suffix} file that is not a torch.save zip archive; {_CHECKSUM_ONLY}. "
                        "Move it out of the checkpoint folder if it is not part of the checkpoint",
                    )
                )
            return 1
        try:
            reader = open_file(path, kind, root=self.root, populate=populate, limits=self._limits)
        except PickleRefused as exc:
            # checksummed either way: a certificate pins its bytes
            self._other_files.append(path)
            # the job's configuration, never loaded at resume: no state to verify
            if rel == TRAINER_ARGUMENTS:
                self._ignored = (*self._ignored, rel)
            else:
                self._unverifiable.append(FileIssue(file=rel, detail=_refusal(exc)))
            return 1
        # a quantized or sparse optimizer state: intact, just not readable as bits
        except TensorNotReadable as exc:
            self._other_files.append(path)
            why = str(exc).removeprefix(f"{path}: ")
            self._unverifiable.append(FileIssue(file=rel, detail=f"{why}; {_CHECKSUM_ONLY}"))
            return 1
        except CheckpointError as exc:
            self._other_files.append(path)
            why = str(exc).removeprefix(f"{path}: ").removeprefix(f"{path} ")
            # it says what it is, and is not that any more
            if path.suffix in (*TORCH_SUFFIXES, ".safetensors"):
                self._issues.append(FileIssue(file=rel, detail=why))
            # only its first bytes looked like a checkpoint (a plain zip archive, ...)
            else:
                self._unverifiable.append(
                    FileIssue(file=rel, detail=f"not readable as a {kind} checkpoint ({why}); {_CHECKSUM_ONLY}")
                )
            return 1
        self._parts.append((f"{rel}/", reader))
        return 1

    def _check_text(self, path: Path, rel: str) -> None:
        try:
            # read-only
            with open(path, "rb") as fh:
                text = fh.read().decode("utf-8")
            doc = json.loads(text) if path.name.endswith(".json") else None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            kind = "JSON" if path.name.endswith(".json") else "UTF-8 text"
            self._issues.append(
                FileIssue(file=rel, detail=f"is not valid {kind} ({exc}): the file is damaged or truncated")
            )
            return
        if rel == "trainer_state.json" and isinstance(doc, dict):
            step = doc.get("global_step")
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                self._trainer_step = step

    def _full(self, part: CheckpointReader, name: str) -> str:
        """A part's file name (relative to the part's root) relative to the folder."""
        return self.relative(part.root / name)

    @property
    def files(self) -> tuple[Path, ...]:
        main = [path for prefix, part in self._parts if not prefix for path in part.files]
        rest = [path for prefix, part in self._parts if prefix for path in part.files] + self._other_files
        return (*main, *sorted(rest, key=self.relative))

    def maps(self) -> dict[Path, MappedFile]:
        return {path: mapped for _, part in self._parts for path, mapped in part.maps().items()}

    def infos(self) -> list[TensorInfo]:
        return [
            TensorInfo(key=prefix + info.key, dtype=info.dtype, shape=info.shape, file=self._full(part, info.file))
            for prefix, part in self._parts
            for info in part.infos()
        ]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for prefix, part in self._parts:
            for key, tensor in part.tensors():
                yield prefix + key, tensor

    def step(self) -> int | None:
        main = next((part for prefix, part in self._parts if not prefix), None)
        step = main.step() if main is not None else None
        return step if step is not None else self._trainer_step

    def file_issues(self) -> list[FileIssue]:
        parts = [
            FileIssue(file=self._full(part, i.file), detail=i.detail)
            for _, part in self._parts
            for i in part.file_issues()
        ]
        return parts + self._issues

    def unverifiable(self) -> list[FileIssue]:
        return sorted(self._unverifiable, key=lambda issue: issue.file)

    def aliases(self) -> dict[str, str]:
        return {prefix + key: prefix + first for prefix, part in self._parts for key, first in part.aliases().items()}

    def ignored(self) -> tuple[str, ...]:
        return self._ignored

    def close(self) -> None:
        for _, part in self._parts:
            part.close()


#: Hugging Face ``Trainer``'s pickled ``TrainingArguments``: the job's configuration, written for
#: reference and never loaded by ``resume_from_checkpoint``. Its pickle needs transformers' classes
#: (outside ``weights_only``), so it is not unpickled; it holds no training state, so that is no
#: reason to call the folder unverified: it is checksummed and listed as ignored.
TRAINER_ARGUMENTS = "training_args.bin"


def _refusal(exc: PickleRefused) -> str:
    """The not-verifiable detail of a ``torch.save`` file that cannot be loaded safely."""
    if exc.why:
        why = exc.why
    elif not exc.refused:
        why = "it is a legacy raw pickle"
    else:
        why = f"its pickle needs {', '.join(exc.refused[:5])}, outside torch's weights_only allow-list"
        if exc.numpy:
            why += (
                " (numpy arrays or scalars, such as the numpy RNG state transformers' Trainer saves in rng_state.pth: "
                f"pass {NUMPY_HINT} to load them with torch's weights-only unpickler)"
            )
    return (
        f"{why}, so it is not loaded (that could run code); {_CHECKSUM_ONLY}. "
        "Re-save it with tensors and plain Python values only, or accept the checkpoint as unverified"
    )


#: a Hugging Face shard's name: ``model-00001-of-00003.safetensors``
_SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<total>\d{5})\.(?P<ext>safetensors|bin)")


def _missing_shards(directory: Path, files: list[Path]) -> list[FileIssue]:
    """Shards the top-level shard names say exist and that are absent, where no index lists them (an
    index's own shards are checked by its reader): one issue each, naming the set and how many are here."""
    sets: dict[tuple[str, int, str], set[int]] = {}
    for path in files:
        match = _SHARD_NAME.fullmatch(path.name) if path.parent == directory else None
        if match:
            key = (match["stem"], int(match["total"]), match["ext"])
            sets.setdefault(key, set()).add(int(match["index"]))
    issues = []
    for (stem, total, ext), present in sorted(sets.items()):
        for index in sorted(set(range(1, total + 1)) - present)[:MAX_LISTED_SHARDS]:
            issues.append(
                FileIssue(
                    file=f"{stem}-{index:05d}-of-{total:05d}.{ext}",
                    detail=f"missing: the shard names say {total} shards and {len(present)} {'is' if len(present) == 1 else 'are'} here, with no index listing "
                    "them: the checkpoint is incomplete; copy every shard (and its .index.json) into the folder",
                )
            )
    return issues


#: at most this many missing shards are listed per set (a crafted name may claim 99,999)
MAX_LISTED_SHARDS = 8


def _link_refusal(path: Path, bounds: tuple[Path, ...]) -> str:
    """Why the link ``path`` is not followed, or "" when it is."""
    target = Path(os.path.realpath(path))
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (
                "symbolic link loop (following it leads back to a link on its way): not followed, not verified; "
                "the checkpoint is incomplete: replace the link with the file it should name"
            )
    if not target.exists():
        return f"dangling symbolic link (its target {target} does not exist): the checkpoint is incomplete; restore the target"
    if outside(path, bounds) is not None:
        return (
            f"symbolic link to {target}, outside the checkpoint folder (and not a huggingface_hub cache blob): not followed, "
            f"not verified; {link_advice(target)}, or verify it on its own"
        )
    if target.is_dir():
        return "symbolic link to a directory: not followed, not verified; verify that directory on its own"
    if not target.is_file():
        return "symbolic link to something that is not a regular file: not opened, not verified"
    return ""


def _scan(root: Path, bounds: tuple[Path, ...]) -> tuple[list[Path], list[FileIssue], tuple[str, ...], list[Path]]:
    """Every file below ``root`` without following links out of ``bounds`` (``limits.link_bounds``).

    Returns:
        ``(files, refused, ignored, dcp_dirs)``: regular files and followed links (sorted paths);
        entries never opened, with why; ignored relative paths; sub-directories holding a DCP
        ``.metadata`` (the top-level one is the model checkpoint's business).
    """
    files: list[Path] = []
    refused: list[FileIssue] = []
    ignored: list[str] = []
    dcp_dirs: list[Path] = []

    def walk(directory: Path, prefix: str) -> None:
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            refused.append(
                FileIssue(file=prefix or ".", detail=f"cannot list this directory ({exc.strerror}): not verified")
            )
            return
        for entry in entries:
            rel, path = prefix + entry.name, directory / entry.name
            if rel in IGNORED and entry.is_dir(follow_symlinks=False):
                ignored.append(rel + "/")
            elif entry.is_symlink():
                why = _link_refusal(path, bounds)
                if why:
                    refused.append(FileIssue(file=rel, detail=why))
                else:
                    files.append(path)
            elif entry.is_dir(follow_symlinks=False):
                if (path / METADATA_NAME).is_file():
                    dcp_dirs.append(path)
                walk(path, rel + "/")
            elif entry.is_file(follow_symlinks=False):
                files.append(path)
            else:
                refused.append(
                    FileIssue(
                        file=rel,
                        detail="not a regular file (a FIFO, socket or device): not opened, not verified; "
                        "remove it from the checkpoint folder",
                    )
                )

    walk(root, "")
    return files, refused, tuple(ignored), dcp_dirs
