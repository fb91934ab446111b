"""Triage: every piece of evidence the trace alone gives (numpy only, never torch).

``trace_only`` reads the trace's STEP records window by window into evidence (the vocabulary of
``sdc_forensics/evidence.py``, which every stage speaks) and the window a replay must examine
(``bisect --trace-only`` stops here); ``series`` reads the per-step values the report plots.
``evidence`` is that vocabulary's old import path, kept for code written before it moved.
"""
