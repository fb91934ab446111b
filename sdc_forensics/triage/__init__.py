"""Triage: every piece of evidence the trace alone gives (numpy only, never torch).

``evidence`` is the vocabulary every later stage speaks (replay, decide, present);
``trace_only`` reads the trace's STEP records window by window into evidence and the window a
replay must examine (``bisect --trace-only`` stops here).
"""
