"""Replay: re-execute recorded steps from a checkpoint and compare them with the trace (torch).

``options`` (what the user chooses, built once by the CLI), ``preflight`` (can this replay be
exact, said before it starts), ``env`` (the numerics, device, bucket layouts and reductions a
replay runs with), ``replayer`` (one window, step by step), ``compare`` (one step against the
trace), ``distributed`` (the same replay fanned out over torchrun processes).
"""
