"""Forensics: triage of a trace, deterministic replay, bisection, verdicts and their rendering.

One module per stage: ``evidence`` (the vocabulary), ``triage`` (numpy only), ``replay``
(torch), ``bisect`` (the flow), ``verdict`` (the result), ``render`` (text and JSON). Import
the stage you need; this package imports nothing heavy on its own.
"""
