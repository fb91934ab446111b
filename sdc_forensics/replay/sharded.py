"""A sharded job replayed at its size: the model ``fully_shard``-ed over the replay's ``k`` processes.

Chosen by :func:`dispatch` (called where ``replay_window`` starts a replay) when the trace is a
sharded job (FSDP2/HSDP), this process is one of ``k`` > 1 launched by torchrun, and either the
whole model does not fit one process (the memory plan, ``replay/memory.py``) or
``SDC_FORENSICS_REPLAY_SHARDED=1`` asks for it (``0`` switches it off); otherwise the replay is the
whole-model one (the whole model on each process), which every sharded layout certifies on. Before
either, the memory plan refuses (exit 2, one line) a replay whose processes cannot fit the budget,
naming the processes it needs; and a freed tensor's memory is given back to the system at once
(``memory.return_freed_memory``), so that the plan, which counts live tensors, holds.

The sharded replay (``replay/sharded_replayer.py``) reproduces FSDP and HSDP recorded with the
ordered reduction in the parameters' dtype (or in float32 under a ``MixedPrecisionPolicy``
``param_dtype``, the recorded policy reproduced), with clipping's total norm as the job's shards
computed it. A job reduced in a low-precision ``reduce_dtype`` or in gloo's native order is refused
sharded in one line naming the alternative: the whole-model replay, on a device with the
memory for it.
"""

from __future__ import annotations

import os

from sdc_forensics.replay import memory

SHARDED_ENV = "SDC_FORENSICS_REPLAY_SHARDED"


def wanted(trace) -> bool:
    """True when this replay should run sharded (a sharded trace, several processes, not switched off)."""
    from sdc_forensics.replay import distributed

    if trace.manifest.parallel is None or os.environ.get(SHARDED_ENV, "").strip() == "0":
        return False
    group = distributed.current()
    return group is not None and group.size > 1


def plan_of(trace, options, device, infos):
    """The memory plan of replaying from the start checkpoint (``memory.plan_from_infos``; None: unknown)."""
    names = next((n.param_names for n in trace.checkpoint_notes() if n.step == options.start_step), ())
    return memory.plan_from_infos(
        infos, trace.manifest, names, device=str(device), checkpoint=str(options.checkpoint_path)
    )


def dispatch(trace, options, device, infos):
    """Whether this replay runs sharded (``replay/sharded_replayer.py``), after the memory check.

    Args:
        trace: the open trace; options: ``ReplayOptions``; device: the torch device;
        infos: the start checkpoint's tensor metadata (``CheckpointReader.infos()``).

    Raises:
        MemoryRefused: the replay's processes cannot fit the budget (one line, exit 2).
    """
    from sdc_forensics.replay import distributed

    # a sharded job's plan counts live tensors: freed ones must not stay resident (glibc's heap); a DDP replay's
    # allocator is left as it was (the replay-speed figures of docs/benchmarks.md were measured with it)
    if trace.manifest.parallel is not None:
        memory.return_freed_memory()
    plan = plan_of(trace, options, device, infos)
    shard = wanted(trace)
    if shard and os.environ.get(SHARDED_ENV, "").strip() != "1" and (plan is None or plan.fits(1)):
        # the whole model fits each process: the replay every sharded layout certifies on today (HSDP, gloo's own order,
        # mixed precision, clipping's norm over the job's W shards); the sharded one is for what does not fit, or asked for
        shard = False
    if shard:
        from sdc_forensics.errors import UsageError
        from sdc_forensics.replay.sharded_replayer import supported

        why = supported(trace.manifest.parallel, trace)
        if why and os.environ.get(SHARDED_ENV, "").strip() == "1":
            raise UsageError(
                f"{SHARDED_ENV}=1 asks for a sharded replay, but {why}: unset it to replay the whole model on "
                "each process"
            )
        if why:
            raise UsageError(
                f"the model does not fit one replay process and {why}: replay on a device with more memory "
                f"(or raise {memory.BUDGET_ENV})"
            )
    group = distributed.current()
    processes = group.size if shard and group is not None else 1
    if plan is not None:
        refusal = plan.refusal(processes)
        if refusal:
            raise memory.MemoryRefused(refusal)
    return shard
