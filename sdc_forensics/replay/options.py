"""What the user chooses about an analysis and its replays: one type, built once by the CLI.

``bisect``, ``certify``, ``verify-checkpoint --trace``, ``report`` and ``replay`` take the same
choices (``cli/common.py``, ``analysis_options``): where the checkpoints are, which recipe, which
device and how many threads, exact or tolerant comparison, how far to replay. The CLI builds one
:class:`AnalysisOptions` from its flags and hands it down; ``bisect`` reads it, ``replay`` carries
it in its ``ReplayRequest``, ``report`` writes the commands that rerun it from it, and each
replayed window's ``replay.replayer.ReplayOptions`` is built from it (``ReplayOptions.of``).

Torch-free: ``bisect --trace-only`` and ``inspect`` import it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnalysisOptions:
    """What an analysis (and every replay it runs) may use.

    Attributes:
        checkpoints_dir: where the checkpoint files are (None: found from the trace, ``checkpoint.locate.locate_checkpoint``).
        recipe: ``module:attribute`` overriding the manifest's recipe.
        device: replay device (``cpu``, ``cuda``, ``cuda:N``).
        force_device: replay even on a suspect's GPU.
        num_threads: replay CPU threads for every step (None: each step's recorded count, which
            makes a CPU replay of a CPU run bitwise exact).
        force_tolerant: compare within tolerance even where the replay is bitwise reproducible.
        trace_only: never replay, never read checkpoint files, never import torch.
        max_replay_steps: stop widening backwards after this many replayed steps (None: no limit);
            checkpoints whose earlier steps were not all replayed stay ``unverified``.
        scan_recurrence: also replay the intervals after the first divergence (from checkpoints all
            replicas agreed on): recurrences of the suspects.
        checkpoint_paths: ``{N: path}`` files to use for checkpoint N instead of the noted one
            (``verify-checkpoint PATH --trace``: the file being asked about).
        collective: all-reduce each replayed step with the replay's own process group (torchrun
            with one process per recorded rank, the recorded NCCL settings pinned) instead of
            modelling the sum; self-checked against the recorded reduced digest at every step
            (``replay.distributed.collective_mean``).
        ledger_path: the ledger of examined intervals (None: ``TRACE_DIR/ledger.jsonl``,
            ``ledger.store.ledger_path``).
        no_ledger: neither reuse nor append ledger records: replay everything the analysis needs.
    """

    checkpoints_dir: Path | None = None
    recipe: str | None = None
    device: str = "cpu"
    force_device: bool = False
    num_threads: int | None = None
    force_tolerant: bool = False
    trace_only: bool = False
    max_replay_steps: int | None = None
    scan_recurrence: bool = False
    checkpoint_paths: dict[int, Path] = dataclasses.field(default_factory=dict)
    collective: bool = False
    ledger_path: Path | None = None
    no_ledger: bool = False

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")


#: The name of the published API before ``report`` and ``replay`` shared it (``forensics.BisectOptions``,
#: docs/checkpoints.md): the same class.
BisectOptions = AnalysisOptions
