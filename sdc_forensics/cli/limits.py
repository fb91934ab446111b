"""The read-limit options of every command that reads checkpoint files.

``verify-checkpoint``, ``certify``, ``bisect`` and ``report`` take the same four options; this decorator adds
them, builds one :class:`~sdc_forensics.checkpoint.limits.ReadLimits` and runs the command under
it (``using_limits``), so every checkpoint the command opens, directly or through the analysis,
is read under the user's limits without each call passing them on:

  --max-inflate-bytes SIZE   bytes processed beyond a file's own (default 256MiB; env SDC_FORENSICS_MAX_INFLATE_BYTES)
  --max-tensors N            tensors one file may list (default 1000000; env SDC_FORENSICS_MAX_TENSORS)
  --allow-root DIR           a directory symbolic links may lead into (repeatable; env SDC_FORENSICS_ALLOW_ROOTS, ':'-separated)
  --allow-numpy              load numpy arrays and scalars from torch.save files (weights-only unpickler)

``sdc_forensics.checkpoint`` (and so torch) is imported only when a command runs: ``bisect
--trace-only`` starts without torch.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import click

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)


class ByteSize(click.ParamType):
    """A byte count: ``1073741824``, ``512MiB``, ``1G`` (SI: 10^9), ``2GiB`` (2^30)."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        match = _SIZE.match(str(value))
        if match is None:
            self.fail(f"{value!r} is not a size: use bytes (1073741824) or a unit (512MiB, 1GiB, 2G)", param, ctx)
        return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def read_limit_options(func):
    """Add ``--max-inflate-bytes``, ``--max-tensors``, ``--allow-root``, ``--allow-numpy`` to a
    click command callback (place it above ``@click.pass_context``) and run it under their limits."""

    @functools.wraps(func)
    def run(
        *args,
        max_inflate_bytes: int | None,
        max_tensors: int | None,
        allow_roots: tuple[Path, ...],
        allow_numpy: bool,
        **kwargs,
    ):
        from sdc_forensics.checkpoint.limits import ReadLimits, using_limits

        given = {"max_inflate_bytes": max_inflate_bytes, "max_tensors": max_tensors}
        limits = ReadLimits(
            **{k: v for k, v in given.items() if v is not None}, allow_roots=allow_roots, allow_numpy=allow_numpy
        )
        with using_limits(limits):
            return func(*args, **kwargs)

    run = click.option(
        "--allow-numpy",
        is_flag=True,
        help="Load numpy arrays and scalars (the numpy RNG state of rng_state.pth) from torch.save files, with torch's "
        "weights-only unpickler; nothing else is ever unpickled.",
    )(run)
    run = click.option(
        "--allow-root",
        "allow_roots",
        multiple=True,
        envvar="SDC_FORENSICS_ALLOW_ROOTS",
        show_envvar=True,
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help="A directory that symbolic links in a checkpoint may lead into, besides the checkpoint itself (repeatable).",
    )(run)
    run = click.option(
        "--max-tensors",
        type=click.IntRange(min=1),
        show_default="1000000",  # checkpoint.limits.DEFAULT_MAX_TENSORS
        envvar="SDC_FORENSICS_MAX_TENSORS",
        show_envvar=True,
        help="Tensors one file may list (a safetensors header, a torch.save payload, a DCP .metadata).",
    )(run)
    return click.option(
        "--max-inflate-bytes",
        type=ByteSize(),
        show_default="256MiB",  # checkpoint.limits.DEFAULT_MAX_INFLATE_BYTES
        envvar="SDC_FORENSICS_MAX_INFLATE_BYTES",
        show_envvar=True,
        help="Bytes verification may process beyond a file's own: compressed zip members, tensor views that repeat stored bytes.",
    )(run)
