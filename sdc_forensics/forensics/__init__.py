"""Forensics: triage of a trace, deterministic replay, bisection and verdicts (rendering is
``sdc_forensics.present``'s).

One module per stage: ``evidence`` (the vocabulary), ``triage`` (numpy only), ``replay`` and
``replay_env`` (torch), ``options`` (what the user chooses), ``bisect`` (the flow), ``decision`` (the one decision), ``verdict`` (the
result); ``certify``, ``verify_run``, ``replay_run`` and ``incident`` are what the commands call. The names below import without torch; import ``forensics.replay`` to replay by hand.
"""

from sdc_forensics.forensics.bisect import bisect
from sdc_forensics.forensics.evidence import Evidence, EvidenceKind, Location
from sdc_forensics.forensics.options import AnalysisOptions, BisectOptions
from sdc_forensics.forensics.triage import TriageOptions, TriageResult, triage_trace
from sdc_forensics.forensics.verdict import BisectResult, Verdict

__all__ = [
    "AnalysisOptions", "BisectOptions", "BisectResult", "Evidence", "EvidenceKind", "Location", "TriageOptions", "TriageResult", "Verdict",
    "bisect", "triage_trace",
]
