"""Hugging Face sharded checkpoints: ``*.safetensors.index.json`` (or ``*.bin.index.json``, with
``torch.save`` shards) and the shards it names.

Index layout (JSON)::

    {"metadata": {"total_size": BYTES, ...},            optional
     "weight_map": {TENSOR_NAME: "model-00001-of-00002.safetensors", ...}}

Checks, each one line in a :class:`CheckpointError`: the index is a JSON object with a
``weight_map`` of strings to plain file names in the index's directory (no ``/``, no ``..``);
every shard it names exists and passes the safetensors structure checks; every tensor it names
is in the shard it names; every tensor of every shard is named by the index, for that shard.
Tensors are then read shard by shard through :class:`SafetensorsReader` (or :class:`TorchReader`
for ``.bin``/``.pt`` shards, never unpickling anything outside the ``weights_only`` allow-list).
A shard (or the index) that resolves out of the index's directory through a symbolic link is
refused before it is opened, unless it lands in an allowed root (``limits.py``: the
``huggingface_hub`` cache ``blobs/`` of a snapshot, ``--allow-root``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from sdc_forensics.checkpoint.base import CheckpointReader, FileIssue, MappedFile, SingleFileReader, TensorInfo
from sdc_forensics.checkpoint.limits import ReadLimits, check_inside, resolve, why_not_a_file
from sdc_forensics.checkpoint.safetensors_reader import SafetensorsReader
from sdc_forensics.checkpoint.torch_reader import TorchReader
from sdc_forensics.errors import CheckpointError, reader
from sdc_forensics.untrusted import MAX_DEPTH, depth, describe, load_json

INDEX_SUFFIX = ".safetensors.index.json"
INDEX_SUFFIXES = (INDEX_SUFFIX, ".bin.index.json", ".pt.index.json")
#: The longest file name (bytes) common file systems allow: a longer shard name cannot exist.
MAX_NAME_BYTES = 255


def is_index_name(name: str) -> bool:
    """Whether ``name`` is an HF index file name."""
    return name.endswith(INDEX_SUFFIXES)


@reader
def find_index(directory: Path) -> Path | None:
    """The one HF index (``*.safetensors.index.json``, ``*.bin.index.json``) in ``directory``."""
    found = sorted(p for p in directory.glob("*.index.json") if is_index_name(p.name))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise CheckpointError(f"{directory} holds several index files ({names}); pass the one to verify")
    return found[0] if found else None


class HfIndexReader(CheckpointReader):
    """A sharded safetensors checkpoint, opened through its index.

    Args:
        index_path: the ``*.safetensors.index.json`` file.
        populate: pre-fault each shard's map when opening it.
        limits: what reading it may cost, where links may lead (default: ``limits.current_limits()``).
    """

    format = "hf-index"

    def __init__(self, index_path: str | Path, *, populate: bool = False, limits: ReadLimits | None = None) -> None:
        index_path = Path(index_path)
        super().__init__(index_path, index_path.parent)
        limits = resolve(limits)
        if index_path.is_file():
            check_inside(index_path, self.root, limits, "index")
        self.weight_map, self.metadata = read_index(index_path)
        self._shards: dict[str, SingleFileReader] = {}
        try:
            for shard in sorted(set(self.weight_map.values())):
                shard_path = self.root / shard
                try:
                    found = shard_path.is_file()
                # is_file() answers False only for a few errnos (ENAMETOOLONG, EACCES raise)
                except OSError as exc:
                    raise CheckpointError(
                        f"{index_path} names shard {shard[:80]!r}, which cannot be looked up ({exc.strerror}): check the index"
                    ) from None
                if not found:
                    raise CheckpointError(
                        f"{index_path} names shard {shard!r}, which {why_not_a_file(shard_path)} in {self.root}: the checkpoint "
                        "is incomplete"
                    )
                check_inside(shard_path, self.root, limits, "shard")
                if shard_path.suffix == ".safetensors":
                    self._shards[shard] = SafetensorsReader(
                        shard_path, root=self.root, populate=populate, limits=limits
                    )
                else:
                    self._shards[shard] = TorchReader(shard_path, root=self.root, limits=limits)
            self._check_completeness()
        except CheckpointError:
            self.close()
            raise

    def _check_completeness(self) -> None:
        keys = {shard: {info.key for info in reader.infos()} for shard, reader in self._shards.items()}
        for name, shard in self.weight_map.items():
            if name not in keys[shard]:
                raise CheckpointError(
                    f"{self.path} puts tensor {name!r} in shard {shard!r}, but that shard does not hold it"
                )
        for shard in self._shards:
            for name in sorted(keys[shard]):
                listed = self.weight_map.get(name)
                if listed != shard:
                    where = "does not list it" if listed is None else f"puts it in {listed!r}"
                    raise CheckpointError(
                        f"shard {shard!r} holds tensor {name!r} but {self.path.name} {where}: index and shards disagree"
                    )

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.path, *(reader.path for reader in self._shards.values()))

    def maps(self) -> dict[Path, MappedFile]:
        return {reader.path: reader.mapped for reader in self._shards.values()}

    @property
    def shards(self) -> dict[str, SingleFileReader]:
        """Shard file name -> its reader, sorted by name."""
        return dict(self._shards)

    def infos(self) -> list[TensorInfo]:
        return [info for shard in self._shards.values() for info in shard.infos()]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for shard in self._shards.values():
            yield from shard.tensors()

    def file_issues(self) -> list[FileIssue]:
        return [issue for shard in self._shards.values() for issue in shard.file_issues()]

    def aliases(self) -> dict[str, str]:
        return {key: first for shard in self._shards.values() for key, first in shard.aliases().items()}

    def step(self) -> int | None:
        value = self.metadata.get("step")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        steps = {shard.step() for shard in self._shards.values()} - {None}
        return steps.pop() if len(steps) == 1 else None

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()


@reader
def read_index(index_path: Path) -> tuple[dict[str, str], dict]:
    """``(weight_map, metadata)`` of an index file, checked; raises :class:`CheckpointError`."""
    if not index_path.is_file():
        raise CheckpointError(f"{index_path} does not exist or is not a file")
    try:
        # read-only
        with open(index_path, "rb") as fh:
            # ValueError for bad UTF-8/JSON, deep nesting, 5,000-digit integers
            doc = load_json(fh.read())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index_path} is not valid JSON ({exc}): the index is damaged") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f'{index_path} has no non-empty "weight_map" object: not a safetensors index')
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or not shard
            or "/" in shard
            or "\\" in shard
            or "\0" in shard
            or shard in (".", "..")
        ):
            raise CheckpointError(
                f"{index_path}: tensor {name[:80]!r} maps to {describe(shard)}; shards must be plain file names next to the index"
            )
        if len(shard.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise CheckpointError(
                f"{index_path}: tensor {name[:80]!r} maps to a shard name of {len(shard)} characters, longer than a file name can be "
                f"({MAX_NAME_BYTES} bytes): the index is damaged"
            )
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict) or depth(metadata, MAX_DEPTH + 1) > MAX_DEPTH:
        raise CheckpointError(
            f'{index_path}: "metadata" must be an object nested at most {MAX_DEPTH} levels: the index is damaged'
        )
    return dict(weight_map), metadata
