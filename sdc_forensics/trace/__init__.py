"""The trace: a run manifest, one append-only file per rank and attempt, and checkpoint notes.

numpy only; never imports torch.
"""
