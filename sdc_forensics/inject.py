"""Fault injection for tests, drills and the demo: flip one bit at a chosen place, step and rank.

Spec syntax (several specs may be given)::

    LOCATION:step=S:rank=R:bit=B[:element=I]

Locations (where the flipped bit lands, and what the trace then shows):

* ``grad``: rank R's local gradient as it enters the all-reduce at step S (the DDP bucket
  buffer, before the recorder fingerprints it: the trace records what the rank really sent).
  Element I indexes the concatenation of the bucket buffers in bucket order.
* ``allreduce``: the reduced gradient on rank R only, after the collective, before the recorder
  fingerprints it and before the optimizer reads it. Element I as for ``grad``.
* ``allreduce-all``: the reduced gradient identically on every rank (corruption inside the
  collective); ``rank`` is ignored. Only the sketch check can see it.
* ``weights``: a parameter of rank R at rest, after the update of step S-1 and before the
  forward of step S. Element I indexes the parameters concatenated in ``named_parameters()``
  order.
* ``update``: rank R's optimizer update of step S (the parameter right after ``optimizer.step``,
  before the weights digest). Element I as for ``weights``.
* ``input``: rank R's input at step S, after it was fetched and before the forward. The input
  digest in the trace is taken from what the rank consumed, so it sees the flip; replay refetches
  the clean microbatch by ID, and the input-digest mismatch tells an input fault apart.
  Element I indexes the floating-point input tensors of the step's microbatches, concatenated
  (a strided view, such as a slice of a longer sequence, is flipped in place). A microbatch of
  integers only (a language model's token ids) has its integer tensors flipped instead, each flip
  keeping a valid id: bit ``bit`` modulo the bit length of the tensor's largest id, or, where that
  would exceed the largest id, the element's lowest set bit; a negative ignore marker (-100)
  becomes id 0 (see ``flip_id_``). Where inputs and
  labels are views of one buffer, the flip changes both, as a corrupted buffer would.
* ``checkpoint-file``: the file of checkpoint S (holding theta_S), after it is written and its
  note recorded. Element I is a byte offset in the file; ``bit`` counts from that byte as in a
  little-endian word (bit 30 of a float32 at offset I is an exponent bit). ``rank`` is ignored:
  the rank that wrote the file flips it.

``bit`` counts from the least significant bit of the element's raw representation: for float32
31 is the sign, 30..23 the exponent, 22..0 the mantissa. Without ``element`` a deterministic
element is chosen from (location, step, rank), the same on every run and every rank.
"""

from __future__ import annotations

import dataclasses
import zipfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from sdc_forensics.errors import UsageError
from sdc_forensics.fingerprint import constants as C

LOCATIONS = ("grad", "allreduce", "allreduce-all", "weights", "update", "input", "checkpoint-file")
#: Locations whose flip is not one rank's: the collective's result on every rank, and the
#: checkpoint file (flipped by whichever rank saves it). ``rank`` is ignored for them.
EVERY_RANK_LOCATIONS = frozenset({"allreduce-all", "checkpoint-file"})
#: Where the FSDP2 drills flip (``recorder/fsdp_monitor.py``, ``recorder/fsdp_layout.py``): this
#: rank's local gradient before the reduce-scatter, its reduce-scatter output, its HSDP replica
#: all-reduce output, and (the recorder's only) its all-gathered copy of a parameter in the forward.
FSDP_LOCATIONS = ("local-gradient", "reduce-scatter-output", "all-reduce-output", "all-gather-output")
#: Where the TP demo's drill flips (``demo/tp.py``, not a recorder's): this rank's output of the
#: row-parallel MLP's reduce-scatter (sequence parallel) in the forward pass.
TP_LOCATIONS = ("tp-collective",)
#: Where the PP demo's drill flips (``demo/pp.py``): the activation a stage hands to the next, as a
#: faulty transfer would deliver it (this rank's output of its last block, in the forward).
PP_LOCATIONS = ("pp-activation",)
#: every location some recorder knows (a tool that reads specs of DDP and sharded runs alike)
ALL_LOCATIONS = LOCATIONS + FSDP_LOCATIONS
_SYNTAX = "LOCATION:step=S:rank=R:bit=B[:element=I]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One bit flip to inject.

    Attributes:
        location: one of :data:`LOCATIONS`.
        step: the optimizer step (for ``checkpoint-file``: the checkpoint number N).
        rank: the global rank whose value is corrupted (ignored for ``allreduce-all`` and
            ``checkpoint-file``).
        bit: bit index from the least significant bit of the element.
        element: element index (byte offset for ``checkpoint-file``); None = deterministic default.
    """

    location: str
    step: int
    rank: int
    bit: int
    element: int | None = None

    def __post_init__(self) -> None:
        if self.location not in LOCATIONS + FSDP_LOCATIONS + TP_LOCATIONS + PP_LOCATIONS:
            raise UsageError(
                f"unknown fault location {self.location!r}; use one of {', '.join(LOCATIONS + FSDP_LOCATIONS)}"
            )
        if self.step < 0:
            raise UsageError(f"fault step must be >= 0, got {self.step}")
        if self.rank < 0:
            raise UsageError(f"fault rank must be >= 0, got {self.rank}")
        if not 0 <= self.bit < 64:
            raise UsageError(f"fault bit must be in 0..63, got {self.bit}")
        if self.element is not None and self.element < 0:
            raise UsageError(f"fault element must be >= 0, got {self.element}")

    def __str__(self) -> str:
        text = f"{self.location}:step={self.step}:rank={self.rank}:bit={self.bit}"
        return text if self.element is None else f"{text}:element={self.element}"

    @property
    def every_rank(self) -> bool:
        """The flip is not one rank's (:data:`EVERY_RANK_LOCATIONS`): ``rank`` is ignored."""
        return self.location in EVERY_RANK_LOCATIONS

    def applies_to(self, rank: int) -> bool:
        """Whether ``rank`` performs this flip (checkpoint-file: decided by who saves)."""
        return self.every_rank or self.rank == rank

    def choose_element(self, numel: int) -> int:
        """The element to flip among ``numel`` (the given one, else a deterministic choice)."""
        if numel <= 0:
            raise UsageError(f"fault {self}: nothing to corrupt (0 elements)")
        if self.element is not None:
            if self.element >= numel:
                raise UsageError(f"fault {self}: element {self.element} is out of range (0..{numel - 1})")
            return self.element
        key = (LOCATIONS.index(self.location) << 48) ^ (self.step << 16) ^ (0 if self.every_rank else self.rank)
        return int(C.splitmix64(np.array([key], dtype=np.uint64))[0] % np.uint64(numel))


def parse_spec(text: str, locations: tuple[str, ...] = LOCATIONS) -> FaultSpec:
    """Parse ``LOCATION:step=S:rank=R:bit=B[:element=I]``; raises :class:`UsageError` if malformed.

    ``locations``: the ones allowed (the DDP recorder's by default; ``fsdp_monitor`` passes its own).
    """
    parts = [p.strip() for p in str(text).strip().split(":")]
    if len(parts) < 2 or not parts[0]:
        raise UsageError(f"fault spec {text!r} is not of the form {_SYNTAX} (e.g. grad:step=12:rank=1:bit=30)")
    location, fields = parts[0].lower(), {}
    if location not in locations:
        raise UsageError(f"fault spec {text!r}: unknown location {location!r}; use one of {', '.join(locations)}")
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("step", "rank", "bit", "element"):
            raise UsageError(f"fault spec {text!r}: {part!r} is not one of step=S, rank=R, bit=B, element=I")
        if key in fields:
            raise UsageError(f"fault spec {text!r}: {key} is given twice")
        try:
            fields[key] = int(value.strip(), 0)
        except ValueError:
            raise UsageError(f"fault spec {text!r}: {key}={value!r} is not an integer") from None
    optional_rank = location in EVERY_RANK_LOCATIONS
    missing = [k for k in ("step", "rank", "bit") if k not in fields and not (k == "rank" and optional_rank)]
    if missing:
        raise UsageError(f"fault spec {text!r} lacks {', '.join(missing)}; the form is {_SYNTAX}")
    return FaultSpec(
        location=location,
        step=fields["step"],
        rank=fields.get("rank", 0),
        bit=fields["bit"],
        element=fields.get("element"),
    )


def parse_specs(texts: Iterable[str]) -> tuple[FaultSpec, ...]:
    """Parse several specs; the single word ``none`` means no injection."""
    texts = [t for t in texts]
    if any(t.strip().lower() == "none" for t in texts):
        if len(texts) > 1:
            raise UsageError("--inject none cannot be combined with other fault specs")
        return ()
    return tuple(parse_spec(t) for t in texts)


def _int_view(flat):
    import torch

    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return flat.view(by_size[flat.element_size()])


def _element_view(tensor, element: int):
    """``(1-D view, index)`` of ``tensor``'s element ``element`` (row-major), in place: the flat view
    of a contiguous tensor, else a one-element view of that element (a microbatch sliced from a
    longer sequence is a strided view)."""
    if tensor.is_contiguous():
        return tensor.view(-1), element
    index = []
    for size in reversed(tensor.shape):
        index.append(element % size)
        element //= size
    return tensor[tuple(reversed(index))].unsqueeze(0), 0


def flip_bit_(flat, element: int, bit: int) -> tuple[float, float]:
    """Flip ``bit`` of ``flat[element]`` in place (a 1-D tensor); returns (old, new) values."""
    import torch

    width = 8 * flat.element_size()
    if bit >= width:
        raise UsageError(f"bit {bit} does not exist in a {width}-bit {flat.dtype} element (use 0..{width - 1})")
    with torch.no_grad():
        old = flat[element].item()
        ints = _int_view(flat)
        # the sign bit of a signed view
        mask = (1 << bit) if bit < width - 1 else -(1 << bit)
        ints[element] = ints[element] ^ mask
        new = flat[element].item()
    return float(old), float(new)


def flip_id_(flat, element: int, bit: int, largest: int) -> tuple[float, float]:
    """Flip one bit of the integer id ``flat[element]`` in place so that it stays a valid id: bit
    ``bit`` modulo the bit length of ``largest`` (the tensor's largest id, a stand-in for the
    vocabulary); if that makes it exceed ``largest``, its lowest set bit is cleared instead (an id
    of 0 becomes 1). A negative element is a label's ignore marker (cross entropy's -100), which
    any other negative value would turn into an index error: it becomes id 0, a masked position
    made a real target. Returns (old, new)."""
    import torch

    with torch.no_grad():
        old = int(flat[element].item())
        new = old ^ (1 << (bit % max(1, int(largest).bit_length())))
        if old < 0:
            new = 0
        elif new > largest:
            new = old & (old - 1) if old else 1
        flat[element] = new
    return float(old), float(new)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fired:
    """One flip that happened: where, which element, and the value before and after."""

    spec: str
    location: str
    step: int
    rank: int
    element: int
    bit: int
    old: float
    new: float
    detail: str = ""


class Injector:
    """Applies the specs that concern one rank; the recorder calls it at each location.

    Args:
        specs: the faults of the run (every rank gets the same list).
        rank: this process's global rank.
    """

    def __init__(self, specs: Iterable[FaultSpec], rank: int) -> None:
        self.specs = tuple(specs)
        self.rank = rank
        self.fired: list[Fired] = []

    def __bool__(self) -> bool:
        return bool(self.specs)

    def pending(self, location: str, step: int) -> list[FaultSpec]:
        """Specs for ``location`` at ``step`` that this rank applies."""
        return [s for s in self.specs if s.location == location and s.step == step and s.applies_to(self.rank)]

    def corrupt_segment(self, location: str, step: int, segment, start: int, total_numel: int) -> None:
        """Flip bits that fall in ``segment`` (1-D view) = elements ``start..`` of a vector of ``total_numel``."""
        for spec in self.pending(location, step):
            element = spec.choose_element(total_numel)
            if start <= element < start + segment.numel():
                old, new = flip_bit_(segment, element - start, spec.bit)
                self.fired.append(
                    Fired(
                        spec=str(spec),
                        location=location,
                        step=step,
                        rank=self.rank,
                        element=element,
                        bit=spec.bit,
                        old=old,
                        new=new,
                    )
                )

    def corrupt_tensors(self, location: str, step: int, tensors: list) -> None:
        """Flip bits in a list of tensors viewed as one concatenated vector (each contiguous)."""
        if not self.pending(location, step):
            return
        total = sum(t.numel() for t in tensors)
        start = 0
        for t in tensors:
            self.corrupt_segment(location, step, t.view(-1), start, total)
            start += t.numel()

    def corrupt_input(self, step: int, tensors: list, start: int) -> int:
        """Flip bits in one microbatch's floating-point tensors (its integer ones where it has none: token
        ids); returns how many elements it holds.

        ``start`` counts the elements of the step's earlier microbatches. Without an explicit
        element the choice is made among the first microbatch's elements.
        """
        flippable = [t for t in tensors if t.is_floating_point()]
        # token ids only (a language model's microbatch): the integer tensors, each flip a valid id
        ids = not flippable
        if ids:
            flippable = [t for t in tensors if not t.is_complex() and str(t.dtype) != "torch.bool"]
        numel = sum(t.numel() for t in flippable)
        for spec in self.pending("input", step):
            element = spec.element if spec.element is not None else (spec.choose_element(numel) if start == 0 else -1)
            offset = start
            for t in flippable:
                if offset <= element < offset + t.numel():
                    view = _element_view(t.detach(), element - offset)
                    old, new = flip_id_(*view, spec.bit, int(t.max())) if ids else flip_bit_(*view, spec.bit)
                    self.fired.append(
                        Fired(
                            spec=str(spec),
                            location="input",
                            step=step,
                            rank=self.rank,
                            element=element,
                            bit=spec.bit,
                            old=old,
                            new=new,
                        )
                    )
                offset += t.numel()
        return numel

    def corrupt_checkpoint_file(self, step: int, path: str | Path) -> None:
        """Flip bits of checkpoint file ``path`` (checkpoint ``step``) on disk."""
        for spec in [s for s in self.specs if s.location == "checkpoint-file" and s.step == step]:
            data = bytearray(Path(path).read_bytes())
            offset = spec.element if spec.element is not None else _default_file_offset(Path(path), len(data), spec)
            byte = offset + spec.bit // 8
            if byte >= len(data):
                raise UsageError(f"fault {spec}: byte {byte} is beyond the end of {path} ({len(data)} bytes)")
            old = data[byte]
            data[byte] ^= 1 << (spec.bit % 8)
            Path(path).write_bytes(bytes(data))
            self.fired.append(
                Fired(
                    spec=str(spec),
                    location=spec.location,
                    step=step,
                    rank=self.rank,
                    element=offset,
                    bit=spec.bit,
                    old=float(old),
                    new=float(data[byte]),
                    detail=f"byte {byte} of {Path(path).name}",
                )
            )


def _default_file_offset(path: Path, size: int, spec: FaultSpec) -> int:
    """A 4-aligned byte inside the largest tensor stored in a torch.save zip (else the file middle)."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = [i for i in archive.infolist() if "/data/" in i.filename and i.compress_type == zipfile.ZIP_STORED]
            if infos:
                info = max(infos, key=lambda i: i.file_size)
                with open(path, "rb") as handle:
                    handle.seek(info.header_offset + 26)
                    name_len, extra_len = np.frombuffer(handle.read(4), dtype="<u2")
                data_start = info.header_offset + 30 + int(name_len) + int(extra_len)
                words = max(1, info.file_size // 4)
                return data_start + 4 * spec.choose_element(words)
    except (zipfile.BadZipFile, OSError):
        pass
    return 4 * spec.choose_element(max(1, size // 4))
