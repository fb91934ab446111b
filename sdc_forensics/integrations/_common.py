"""What every framework adapter shares: the optimizer as data, batches as sample indices, and a
checkpoint folder the framework wrote, read back for its note.

**The optimizer as data.** Replay must rebuild the optimizer the framework built (its class, its
parameter groups and their options) or the update differs in the last bits. The adapter records
it from the live object, not from the framework's settings: :func:`optimizer_spec` gives a JSON
document (class reference, ``defaults``, each group's options and the names of its parameters)
that :func:`build_optimizer` turns back into the same optimizer over a fresh model.

**Microbatch IDs are sample indices.** A framework's microbatch is a collated batch of dataset
samples. A step's microbatch IDs in the trace are the sampler's indices, in the order consumed,
with two marks (int64, never negative)::

    bit 62 (END)   on the last index of each microbatch: the batch is complete, collate it
    bit 61 (META)  a step header, first in each rank-step: low 48 bits = the divisor training
                   applied to each microbatch's loss (gradient accumulation), 0 = none; with
    bit 60 (ITEMS) set, the low 48 bits are instead the step's item count (the Trainer's
                   ``num_items_in_batch``: label tokens over the accumulation window and ranks)
    bit 59 (RNG)   with META, a second header: low 48 bits = the rank-step's RNG seed (below)
    bits 0..47     the sample index (datasets up to 2^48 samples)

**Dropout replays.** The Trainer and Lightning adapters run each microbatch's forward with the
global RNG (CPU, and the model's GPU) seeded from ``(rank-step seed, microbatch number)``, inside
``torch.random.fork_rng`` (the job's own RNG stream is left where it was), and write the rank-step
seed in the RNG header (:func:`step_seed`: a hash of the fingerprint seed, the step and the
rank). The recipes seed their forward alike (:func:`seeded`), so dropout masks, and any other draw
the forward makes, are the ones training drew.

The replay recipe (:class:`SampleBatches`) groups the indices back into batches: ``fetch`` of an
index without END (or of a header) returns an empty tuple (no tensors: nothing to digest), and
``loss`` of it is a zero with no graph to the parameters (its ``backward()`` touches no
gradient); ``fetch`` of an END index returns the collated batch. The step's gradient and summed
loss are then exactly training's, and the trace stays self-contained (no side table to move).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from sdc_forensics.errors import RecipeError, SdcError, UsageError
from sdc_forensics.recorder.checkpointing import taken, unused_path  # noqa: F401 - the adapters' names for them

log = logging.getLogger(__name__)

END = 1 << 62
META = 1 << 61
ITEMS = 1 << 60
RNG = 1 << 59
INDEX_MASK = (1 << 48) - 1


class Refusal(UsageError, SystemExit):
    """What an adapter refuses inside the training script: a :class:`UsageError` (``except
    SdcError`` catches it) that is also a ``SystemExit`` with code 2 (``ExitCode.USAGE``), so that,
    left uncaught, every rank exits 2 without a traceback. :func:`refuse` prints the one line,
    on rank 0 only (a thousand ranks, one line)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = int(self.exit_code)


def refuse(message: str) -> Refusal:
    """The :class:`Refusal` of ``message``, printed once (rank 0) on stderr as the one line a user
    reads: ``raise refuse("...")``."""
    import sys

    if _global_rank() == 0:
        print(f"sdc-forensics: {message}", file=sys.stderr, flush=True)
    return Refusal(message)


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def framework_info(name: str, adapter: str) -> dict[str, str]:
    """The manifest's ``framework`` entry for an installed package ``name``."""
    try:
        from importlib.metadata import version

        found = version(name)
    except Exception:  # noqa: BLE001 - an uninstalled distribution name: say so, do not fail
        found = "unknown"
    return {"name": name, "version": found, "adapter": adapter}


def step_header(divisor: int, *, items: bool = False) -> int:
    """The META ID that opens a rank-step: ``divisor``, what each microbatch's loss was divided by,
    or with ``items`` the item count the loss was normalised by."""
    if not 0 <= int(divisor) <= INDEX_MASK:
        raise UsageError(f"loss divisor {divisor} does not fit a microbatch ID")
    return META | (ITEMS if items else 0) | int(divisor)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of a rank-step's forwards (48 bits): distinct per step and rank, the same in any replay."""
    import hashlib

    digest = hashlib.blake2b(f"sdc-forensics rng {int(seed)} {int(step)} {int(rank)}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little")


def rng_header(seed48: int) -> int:
    """The META|RNG ID that carries a rank-step's :func:`step_seed`."""
    return META | RNG | (int(seed48) & INDEX_MASK)


class seeded:  # noqa: N801 - used like a function: `with seeded(seed, m, device):`
    """Run a block with the global RNG of the CPU (and of ``device`` when it is a GPU) seeded from
    ``(seed48, microbatch)``, restored afterwards; ``seed48`` None: the block runs unchanged."""

    def __init__(self, seed48: int | None, microbatch: int, device: Any) -> None:
        self.value = None if seed48 is None else (int(seed48) << 16) | (int(microbatch) & 0xFFFF)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._fork = None

    def __enter__(self) -> "seeded":
        if self.value is None:
            return self
        cuda = self.device.type == "cuda"
        index = self.device.index if self.device.index is not None else (torch.cuda.current_device() if cuda else 0)
        self._fork = torch.random.fork_rng(devices=[index] if cuda else [])
        self._fork.__enter__()
        torch.random.default_generator.manual_seed(self.value)
        if cuda:
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(self.value)
        return self

    def __exit__(self, *exc) -> None:
        if self._fork is not None:
            self._fork.__exit__(*exc)
            self._fork = None


def batch_ids(indices) -> list[int]:
    """One microbatch's sample indices as IDs, the last one marked END.

    Raises:
        SdcError: an index outside ``0 .. 2^48-1`` (not a map-style dataset's index).
    """
    ids = [int(i) for i in indices]
    if not ids:
        raise SdcError("a microbatch with no samples reached the model: nothing to record")
    if any(not 0 <= i <= INDEX_MASK for i in ids):
        raise SdcError(f"sample index out of range for a microbatch ID: {min(ids)}..{max(ids)}")
    ids[-1] |= END
    return ids


def reference(obj: Any) -> str | None:
    """``module:qualname`` of a module-level function or class that imports back to ``obj``, else None.

    An object of the script being run (``torchrun mytrain.py``: module ``__main__``) is named by the
    script's module name (``mytrain:Classifier``), which is how replay imports it (with the
    script's directory on ``PYTHONPATH``), when that name finds the same file.
    """
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    if module == "__main__":
        import sys
        from importlib.util import find_spec

        script = getattr(sys.modules.get("__main__"), "__file__", None)
        if not script:
            return None
        stem = Path(script).stem
        try:
            spec = find_spec(stem)
        except (ImportError, ValueError):
            return None
        same = spec is not None and spec.origin is not None and Path(spec.origin).resolve() == Path(script).resolve()
        return (
            f"{stem}:{qualname}"
            if same and getattr(sys.modules["__main__"], qualname.split(".")[0], None) is not None
            else None
        )
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001
        return None
    return f"{module}:{qualname}" if found is obj else None


def _json_option(key: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise UsageError(
                f"optimizer option {key!r} is a tensor of {value.numel()} elements; the adapter records scalar options only"
            )
        return value.item()
    if isinstance(value, tuple):
        return [_json_option(key, v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    raise UsageError(
        f"optimizer option {key!r} = {value!r:.60} cannot be recorded for replay (not a number, string or None)"
    )


def optimizer_spec(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, Any]:
    """The optimizer as JSON: class reference, defaults, and per group its options and parameter names.

    Raises:
        UsageError: the class is not importable by reference, an option is not JSON, or a group
            holds a tensor that is not a parameter of ``module``.
    """
    ref = reference(type(optimizer))
    if ref is None:
        raise UsageError(
            f"the optimizer's class {type(optimizer).__qualname__} is not importable by module:name, so replay "
            "cannot rebuild it; define it at module level"
        )
    names = {id(p): n for n, p in module.named_parameters()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise UsageError(
                f"optimizer group {index} holds {len(missing)} tensor(s) that are not parameters of the model; "
                "replay rebuilds the optimizer over the model's parameters only"
            )
        options = {k: _json_option(k, v) for k, v in group.items() if k != "params"}
        if "initial_lr" in options:
            # under an LR scheduler the live rate is the schedule's (0.0 in a warmup's first step), restored with
            # the optimizer's state from every checkpoint; its base is the job's own, the same in every attempt
            # (the ledger reuses a record only for the same recipe arguments: a resume must not change them)
            options["lr"] = options["initial_lr"]
        groups.append({"params": [names[id(p)] for p in group["params"]], "options": options})
    defaults = {k: _json_option(k, v) for k, v in optimizer.defaults.items()}
    return {"class": ref, "defaults": defaults, "groups": groups}


def _python_option(key: str, value: Any) -> Any:
    return tuple(value) if key == "betas" and isinstance(value, list) else value


def build_optimizer(spec: dict[str, Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer :func:`optimizer_spec` recorded, over ``model``'s parameters.

    Raises:
        RecipeError: the class cannot be imported or a parameter name is not in the model.
    """
    from sdc_forensics.recipe import import_reference

    cls = import_reference(spec["class"], what="optimizer", subclass_of=torch.optim.Optimizer)
    params = dict(model.named_parameters())
    groups = []
    for group in spec["groups"]:
        unknown = [n for n in group["params"] if n not in params]
        if unknown:
            raise RecipeError(f"the recorded optimizer names parameter(s) the rebuilt model lacks: {unknown[:3]}")
        groups.append(
            {
                "params": [params[n] for n in group["params"]],
                **{k: _python_option(k, v) for k, v in group["options"].items()},
            }
        )
    # defaults the constructor takes (AdamW lists decoupled_weight_decay among its defaults, not its
    # arguments); every group carries all its options anyway, and the checkpoint restores them
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: _python_option(k, v) for k, v in spec["defaults"].items() if k in accepted}
    return cls(groups, **defaults)


class FolderPayload:
    """Every tensor of a checkpoint folder a framework wrote, keyed as ``verify-checkpoint`` keys
    them, read back by the rank that wrote it; a context manager (the tensors are views of the
    open files)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        from sdc_forensics.checkpoint.formats import open_checkpoint
        from sdc_forensics.checkpoint.limits import ReadLimits

        # numpy arrays: an RNG state file holds the numpy generator's; read as the CLI reads with --allow-numpy
        self._reader = open_checkpoint(Path(folder), limits=ReadLimits(allow_numpy=True))
        self.tensors = dict(self._reader.tensors())
        self.problems = [f"{i.file}: {i.detail}" for i in (*self._reader.file_issues(), *self._reader.unverifiable())]

    def __enter__(self) -> "FolderPayload":
        return self

    def __exit__(self, *exc) -> None:
        self._reader.close()


def note_folder(rec, step: int, folder: str | os.PathLike, module: torch.nn.Module, is_writer: bool) -> Any:
    """Note checkpoint ``step``, a folder the framework has already written, through
    ``rec.checkpoint`` (a collective: the replicas' vote, the note, the CHECKPOINT record).

    The writing rank (``is_writer``) reads the folder back and notes the digests of what is on disk;
    the others offer their own model's state, used only if the writer was outvoted (then the note
    holds a majority rank's weights and the folder, a diverged replica's, fails verification).
    A folder that cannot be read back, or holds a file ``verify-checkpoint`` cannot verify, fails
    the save on every rank (``SdcError``), through the recorder's own broadcast.
    """
    own = {k: v.detach() for k, v in module.state_dict().items()}
    if not is_writer:
        return rec.checkpoint(step, folder, state=own, save=_saved)
    try:
        payload = FolderPayload(folder)
    except SdcError as exc:
        return rec.checkpoint(step, folder, state=own, save=_refuse(f"it cannot be read back ({exc})"))
    with payload:
        save = (
            _saved
            if not payload.problems
            else _refuse(
                f"it holds what verify-checkpoint cannot verify ({payload.problems[0]}): keep such files out of the "
                "checkpoint folder, or it will never certify"
            )
        )
        return rec.checkpoint(step, folder, state=payload.tensors, save=save)


def compiled_parts(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s parts that ``torch.compile`` wrapped (an ``OptimizedModule``, whose
    state dict keys gain ``_orig_mod.``, or ``nn.Module.compile()`` in place): the replay runs
    eager kernels, and rebuilds the model without the wrapper."""
    found = []
    for name, part in module.named_modules():
        if (
            hasattr(part, "_orig_mod")
            or getattr(part, "_compiled_call_impl", None) is not None
            or getattr(getattr(part, "forward", None), "_torchdynamo_orig_callable", None) is not None
        ):
            found.append(name or "the model itself")
    return found


def compile_refusal(module: torch.nn.Module) -> list[str]:
    """The refusal line of a model with compiled parts (empty when none)."""
    parts = compiled_parts(module)
    if not parts:
        return []
    return [
        f"torch.compile wraps {parts[0]!r}{f' (and {len(parts) - 1} more)' if len(parts) > 1 else ''}: the replay rebuilds "
        "the model eagerly and cannot reproduce compiled kernels, nor load their '_orig_mod.' state; compile nothing in a "
        "recorded run"
    ]


def random_parts(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s dropout layers with ``p > 0``: they draw masks from the global RNG
    each step, which the trace does not hold."""
    return [
        name
        for name, part in module.named_modules()
        if isinstance(part, torch.nn.modules.dropout._DropoutNd) and float(part.p) > 0
    ]  # noqa: SLF001


def warn_unreplayable(module: torch.nn.Module) -> None:
    """Say at attach (rank 0, one line) that a model with dropout records steps no replay can
    reproduce, so nothing of the run will certify, and how to change it."""
    parts = random_parts(module)
    if parts and _global_rank() == 0:
        log.warning(
            "sdc-forensics: %d dropout layer(s) with p > 0 (%s...) draw random masks the replay cannot reproduce: the "
            "online checks still run, but no step replays exactly and no checkpoint of this run will certify; set "
            "dropout to 0 for a certified run (GPT-2: GPT2Config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))",
            len(parts),
            parts[0],
        )


def warn_rotation(setting: str) -> None:
    """Say at attach (rank 0, one line) that the job deletes old checkpoints (``setting``), so
    only a follower running beside it can certify the intervals before they are gone."""
    if _global_rank() == 0:
        log.warning(
            "sdc-forensics: %s deletes early checkpoints, and a replay starts from one: run `sdc-forensics certify "
            "--follow TRACE_DIR` beside the job to certify each interval before its checkpoint rotates away "
            "(docs/integrations.md)",
            setting,
        )


def close_on_error(rec: Any, exc: BaseException | None) -> None:
    """Close ``rec`` (a recorder, or None: nothing to close) as training leaves on ``exc`` (an
    exception, an alarm, KeyboardInterrupt): the END record says it ended on an exception, and no
    collective is waited on. For an :class:`~sdc_forensics.errors.SdcAlarm` the process is first
    braced for :func:`~sdc_forensics.recorder.exit_on_alarm` (SIGTERM ignored), as the recorder's
    own ``with`` block does: under torchrun a peer that exits 18 first must not get this rank
    killed while it closes its trace."""
    from sdc_forensics.errors import SdcAlarm
    from sdc_forensics.recorder.exit import brace_for_alarm_exit

    if isinstance(exc, SdcAlarm):
        brace_for_alarm_exit()
    if rec is not None:
        rec.close(on_error=True)


def refuse_existing(path: str | os.PathLike, is_taken: bool) -> None:
    """Refuse a checkpoint save at ``path`` when ``is_taken`` (:func:`taken`, decided by the
    writing rank and shared, so every rank refuses alike): the adapters never write over a file.

    Raises:
        UsageError: one line naming the path and what to do.
    """
    if is_taken:
        raise refuse(
            f"checkpoint {path} exists already, and sdc-forensics never lets a recorded job write over a checkpoint "
            "(its note, and the evidence of an earlier attempt, would be lost): save to a new path, or move the old "
            "one away first"
        )


def _saved(state: Any, path: Path) -> None:
    """The framework wrote the folder already: nothing to save."""


def _refuse(why: str) -> Callable[[Any, Path], None]:
    def save(state: Any, path: Path) -> None:
        raise SdcError(f"checkpoint folder {path}: {why}")

    return save


def _to_device(obj: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    # a dict, or a collator's BatchEncoding: a dict of the moved values
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


class SampleBatches:
    """The replay side of the ID layout above: groups a rank-step's indices back into batches.

    Args:
        sample: ``sample(index)`` -> the dataset's sample (``dataset[index]``).
        collate: the collator training used (a list of samples -> a batch).

    ``divisor`` is the current step header's value, ``items`` whether it is an item count (set
    by ``fetch`` of a META ID).
    """

    def __init__(self, sample: Callable[[int], Any], collate: Callable[[list], Any]) -> None:
        self.sample, self.collate = sample, collate
        self.pending: list[int] = []
        self.divisor = 0
        self.items = False
        # the rank-step's RNG seed (an RNG header), None: training did not seed
        self.rng: int | None = None
        # complete batches fetched in this rank-step; the last one's number is batches - 1
        self.batches = 0

    def fetch(self, microbatch_id: int, device: Any) -> Any:
        """``()`` for a header or an index inside a batch; the collated batch at its END index."""
        microbatch_id = int(microbatch_id)
        if microbatch_id & META:
            if microbatch_id & RNG:
                self.rng = microbatch_id & INDEX_MASK
                return ()
            self.pending, self.divisor, self.items = [], microbatch_id & INDEX_MASK, bool(microbatch_id & ITEMS)
            self.rng, self.batches = None, 0
            return ()
        self.pending.append(microbatch_id & INDEX_MASK)
        if not microbatch_id & END:
            return ()
        indices, self.pending = self.pending, []
        self.batches += 1
        return _to_device(self.collate([self.sample(i) for i in indices]), device)

    def seeded(self, device: Any) -> "seeded":
        """The RNG the forward of the batch just fetched ran with in training (:class:`seeded`)."""
        return seeded(self.rng, self.batches - 1, device)


def is_placeholder(batch: Any) -> bool:
    """Whether ``batch`` is what :meth:`SampleBatches.fetch` returns for a header or a batch not yet complete."""
    return isinstance(batch, tuple) and not batch


def zero_loss() -> torch.Tensor:
    """The loss of a placeholder: a zero whose ``backward()`` reaches no parameter."""
    return torch.zeros((), requires_grad=True)


def dataset_batches(dataset_ref: str, collator_ref: str | None) -> "SampleBatches":
    """The :class:`SampleBatches` of the dataset function ``dataset_ref`` names (it returns the
    dataset, or ``(dataset, collator)``), through ``collator_ref`` or torch's default collate."""
    from torch.utils.data import default_collate

    from sdc_forensics.recipe import import_reference

    made = import_reference(dataset_ref, what="dataset function")()
    dataset, collate = made if isinstance(made, tuple) else (made, None)
    if collate is None:
        collate = import_reference(collator_ref, what="collator") if collator_ref else default_collate
    return SampleBatches(lambda i: dataset[i], collate)
