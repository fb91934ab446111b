"""What certification needs from a trace: notes, the first divergent step, majority digests.

The first divergent step comes from ``sdc_forensics.forensics.triage.triage_trace`` (trace-only
evidence); ``certify`` replaces it with ``bisect``'s (replay-confirmed) step unless asked for
the trace alone.

Step numbering (design brief): the STEP record of step ``s`` holds ``θ_{s+1}``'s digest, so the
majority digest of checkpoint ``N`` is read from the STEP records of step ``N - 1``, and a
divergence seen in the records of step ``s`` makes ``s`` the first divergent step.
"""

from __future__ import annotations

import dataclasses
import os

from sdc_forensics.trace.checkpoints import CheckpointNote, read_checkpoint_notes
from sdc_forensics.trace.consensus import majority_weights_digests
from sdc_forensics.trace.reader import UNTRUSTED_DAMAGE, Trace



@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceContext:
    """The trace facts certification uses.

    Attributes:
        trace_dir: the trace directory.
        notes: checkpoint notes, by step (latest attempt).
        first_divergent_step: ``s*`` or None.
        divergence_source: ``triage``, ``replay`` (set by ``certify``) or ``none``.
        majority_digests: ``{N: hex}`` strict-majority weights digest of ``θ_N``.
        consistent: False when the trace has damage that makes its evidence untrustworthy.
        damage: one line per such damage.
        seed: the fingerprint seed of the trace.
    """

    trace_dir: str
    notes: tuple[CheckpointNote, ...]
    first_divergent_step: int | None
    divergence_source: str
    majority_digests: dict[int, str]
    consistent: bool
    damage: tuple[str, ...]
    seed: int


def load_trace_context(trace_dir: str | os.PathLike, divergence: tuple[int | None, str] | None = None) -> TraceContext:
    """Open the trace and gather the facts (raises ``TraceError`` when it is not a trace).

    Args:
        trace_dir: the trace directory.
        divergence: ``(s*, source)`` when the caller already knows it (``certify`` after
            ``bisect``); otherwise the trace is triaged for it.
    """
    trace = Trace.open(trace_dir)
    notes = tuple(read_checkpoint_notes(trace_dir))
    step, source = divergence if divergence is not None else first_divergent_step(trace)
    damage = tuple(f"{d.kind}: {d.detail}" for d in trace.damage() if d.kind in UNTRUSTED_DAMAGE)
    return TraceContext(
        trace_dir=str(trace_dir),
        notes=notes,
        first_divergent_step=step,
        divergence_source=source,
        majority_digests=majority_weights_digests(trace, [n.step for n in notes]),
        consistent=not damage,
        damage=damage,
        seed=int(trace.manifest.fingerprint.seed),
    )


def first_divergent_step(trace: Trace) -> tuple[int | None, str]:
    """``(s*, "triage")`` from the trace's own evidence, or ``(None, "none")``."""
    from sdc_forensics.forensics.triage import triage_trace

    step = triage_trace(trace).first_suspect_step
    return (int(step), "triage") if step is not None else (None, "none")
