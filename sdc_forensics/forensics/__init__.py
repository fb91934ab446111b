"""The commands' flows: each reads the trace once and runs the stages in order
(record -> trace -> triage -> replay -> decide -> present), one module per command.

* ``bisect``: triage, the backward walk over checkpoint intervals, decide (``sdc-forensics bisect``).
* ``certify``: bisect's analysis read as "where do I resume?" (``sdc-forensics certify``).
* ``follow``: ``certify --follow``, one closed interval at a time while training runs.
* ``review``: bisect's analysis gathered into what the post-incident review states (``report``).
* ``verify_run``: one checkpoint file against the trace (``verify-checkpoint --trace``).
* ``replay``: one window of a recorded run (``sdc-forensics replay``).

What the flows share: ``intervals`` (the interval runner: replays one checkpoint interval at a
time, and the one owner of the ledger's answers, through ``ledger_use``), ``files`` (which file
is checkpoint N, and reading it against its note) and ``ledger_coverage`` (``inspect``'s coverage
from the ledger alone).

The stages live in their own packages: ``sdc_forensics.triage`` (evidence from the trace alone,
numpy only), ``sdc_forensics.replay`` (re-execution and comparison, torch), ``sdc_forensics.decide``
(the one decision, verdicts, certificates, incidents), ``sdc_forensics.present`` (rendering); the
evidence vocabulary they all speak is ``sdc_forensics.evidence``.
The names below import without torch; import ``sdc_forensics.replay.replayer`` to replay by hand.
"""

from sdc_forensics.decide.verdict import BisectResult, Verdict
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.replay.options import AnalysisOptions, BisectOptions
from sdc_forensics.evidence import Evidence, EvidenceKind, Location
from sdc_forensics.triage.trace_only import TriageOptions, TriageResult, triage_trace

__all__ = [
    "AnalysisOptions",
    "BisectOptions",
    "BisectResult",
    "Evidence",
    "EvidenceKind",
    "Location",
    "TriageOptions",
    "TriageResult",
    "Verdict",
    "bisect",
    "triage_trace",
]
