"""The commands' flows: each reads the trace once and runs the stages in order
(record -> trace -> triage -> replay -> decide -> present), one module per command.

* ``bisect``: triage, replay windows, decide (``sdc-forensics bisect``; ``report`` builds on it).
* ``certify``: bisect's analysis read as "where do I resume?" (``sdc-forensics certify``).
* ``verify_run``: one checkpoint file against the trace (``verify-checkpoint --trace``).
* ``replay``: one window of a recorded run (``sdc-forensics replay``).

The stages live in their own packages: ``sdc_forensics.triage`` (evidence from the trace alone,
numpy only), ``sdc_forensics.replay`` (re-execution and comparison, torch), ``sdc_forensics.decide``
(the one decision, verdicts, certificates, incidents), ``sdc_forensics.present`` (rendering).
The names below import without torch; import ``sdc_forensics.replay.replayer`` to replay by hand.
"""

from sdc_forensics.decide.verdict import BisectResult, Verdict
from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.replay.options import AnalysisOptions, BisectOptions
from sdc_forensics.triage.evidence import Evidence, EvidenceKind, Location
from sdc_forensics.triage.trace_only import TriageOptions, TriageResult, triage_trace

__all__ = [
    "AnalysisOptions", "BisectOptions", "BisectResult", "Evidence", "EvidenceKind", "Location", "TriageOptions", "TriageResult", "Verdict",
    "bisect", "triage_trace",
]
