"""Fingerprints: exact digest, linear sketch, stats (torch, on device) and their tolerance model.

``core`` needs torch; ``constants``, ``reference`` and ``tolerance`` are numpy only. Import
``sdc_forensics.fingerprint.core`` where tensors are touched.
"""
