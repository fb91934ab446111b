"""Decide: evidence -> first divergent step -> suspects -> verdict -> checkpoint statuses.

``decision`` is the one decision every command takes its answer from; ``common_mode`` reads what
every rank shows at one step as one event; ``verdict`` is bisect's result; ``certificate`` the
record of a certification; ``incident`` what the verdict means for the job (times, nodes to act on).
Data only: no torch, no formatting (that is ``sdc_forensics.present``'s).
"""
