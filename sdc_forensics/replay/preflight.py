"""The exactness preflight: before any replay, can this replay be bit for bit, and if not, why.

Only a bitwise-exact replay certifies a checkpoint (docs/bisect.md), so a replay that cannot be
exact must say so in its first lines, not after hours of work, together with the one thing to
change. The answer comes from the trace's numerics contract (``sdc_forensics.numerics``: what
each attempt recorded) and the replay's request (device, ``--threads``, ``--tolerant``). torch-free:
``inspect`` calls it too.

Blockers (any one makes an exact replay impossible): another device class or GPU model than the
training's; ``cudnn.benchmark`` on in training (autotuned kernels differ run to run); a collective
whose summation order the replay cannot reproduce (anything but gloo's ring, unless the run used
the ordered reduction); ``--threads`` other than the recorded counts on CPU; ``--tolerant``.
Caveats (exactness possible, not guaranteed; the per-step digests decide): non-deterministic
algorithms allowed on CUDA, NCCL variables of a native collective.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: The fix for every GPU-side blocker: what makes the next run certifiable (docs/recorder.md).
REPLAYABLE = "record the next run with sdc_forensics.recorder.replayable() (ordered reduction, cuDNN benchmark off, deterministic algorithms)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preflight:
    """Whether a replay can be exact here, and why not.

    Attributes:
        exact: True when nothing known stands in the way of a bitwise replay.
        device: the replay device asked for.
        trained_on: the device(s) training recorded.
        mechanism: what will make the reduced gradient exact: ``gloo-ring`` (modelled),
            ``ordered`` (recorded ordered reduction) or ``unknown`` (the collective's own order).
        blockers: why an exact replay is impossible (empty when ``exact``).
        caveats: what may still break exactness (the per-step digests will tell).
        fix: the one change that would make it exact ("" when exact).
    """

    exact: bool
    device: str
    trained_on: str
    mechanism: str
    blockers: tuple[str, ...] = ()
    caveats: tuple[str, ...] = ()
    fix: str = ""
    # replay.memory.MemoryPlan, when the trace's checkpoint could be sized (check(trace_dir=...))
    memory: Any = None

    def lines(self) -> list[str]:
        """Sentences for people, first the verdict."""
        if self.exact:
            head = (
                f"exact replay possible on {self.device}: trained on {self.trained_on}, all-reduce reproduced by "
                f"{self.mechanism}; a clean replay certifies"
            )
        else:
            head = (
                f"no exact replay on {self.device}: {'; '.join(self.blockers)}; steps can only be compared within "
                f"tolerance and nothing can be certified; to make it exact: {self.fix}"
            )
        return (
            [head] + [f"caveat: {c}" for c in self.caveats] + (self.memory.lines() if self.memory is not None else [])
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "device": self.device,
            "trained_on": self.trained_on,
            "mechanism": self.mechanism,
            "blockers": list(self.blockers),
            "caveats": list(self.caveats),
            "fix": self.fix,
            **({"memory": self.memory.to_json()} if self.memory is not None else {}),
        }


def _trained_type(attempt) -> str:
    recorded = attempt.determinism.get("device_type")
    if recorded:
        return str(recorded)
    devices = {str(r.device).split(":")[0] for r in attempt.ranks if r.device}
    return "cuda" if "cuda" in devices else "cpu"


def check(
    manifest,
    *,
    device: str = "cpu",
    device_name: str | None = None,
    num_threads: int | None = None,
    force_tolerant: bool = False,
    collective: bool = False,
    trace_dir=None,
    memory=None,
) -> Preflight:
    """The preflight of a replay of ``manifest``'s run on ``device``.

    Args:
        manifest: the trace's ``Manifest``.
        device: the replay device spec (``cpu``, ``cuda``, ``cuda:N``).
        device_name: the replay GPU's model, when known (None: not compared).
        num_threads: ``--threads`` (None: the recorded counts).
        force_tolerant: ``--tolerant``.
        collective: ``--collective``: the replay all-reduces with its own process group, checked
            against the recorded digest at every step, instead of reproducing a known order.
        trace_dir: the trace's directory: the memory plan (``replay/memory.py``: bytes per process,
            the processes needed on ``device`` under its budget) is sized from its latest checkpoint
            found. None: no memory line (``manifest`` alone holds no sizes).
        memory: a ``MemoryPlan`` already made (it takes the place of ``trace_dir``'s).
    """
    if memory is None and trace_dir is not None:
        # imports torch to read the checkpoint's metadata
        from sdc_forensics.replay import memory as memory_mod

        memory = memory_mod.plan_trace(trace_dir, manifest, device=device)
    replay_type = device.split(":")[0]
    blockers: list[str] = []
    caveats: list[str] = []
    fixes: list[str] = []
    trained, mechanisms = [], []
    for attempt in sorted(manifest.attempts, key=lambda a: a.attempt):
        det = attempt.determinism
        kind = _trained_type(attempt)
        name = str(det.get("device_name") or kind)
        trained.append(name)
        if kind != replay_type:
            blockers.append(
                f"trained on {name}, replaying on {replay_type}: local gradients are not bitwise the same across "
                "device classes"
            )
            fixes.append(f"replay with --device {kind}" + (f" on an {name}" if kind == "cuda" else ""))
        elif kind == "cuda" and device_name and det.get("device_name") and det["device_name"] != device_name:
            blockers.append(f"trained on {det['device_name']}, replaying on {device_name}: other kernels")
            fixes.append(f"replay on an {det['device_name']}")
        if kind == "cuda" and det.get("cudnn_benchmark"):
            blockers.append("training ran with cudnn.benchmark=True: the autotuner may pick other kernels on every run")
            fixes.append(REPLAYABLE)
        if kind == "cuda" and det.get("deterministic_algorithms") is False:
            caveats.append(
                "training allowed non-deterministic algorithms (torch.use_deterministic_algorithms(False)): some "
                "kernels (atomics) may not reproduce; the per-step digests will tell"
            )
        reduction = str(det.get("reduction") or "native")
        backend = str(det.get("backend") or ("nccl" if kind == "cuda" else "gloo"))
        if reduction == "ordered":
            mechanisms.append("ordered")
        elif collective:
            mechanisms.append("collective")
            caveats.append(
                f"--collective: the replay's own {backend if backend == 'gloo' else 'process group'} all-reduce stands in "
                "for the job's; each step's result is checked against the recorded reduced digest, and a step it "
                "does not reproduce is compared within tolerance from there, naming the setting most likely at fault"
                + (
                    f" (the job's own comm hook {det['comm_hook']} is the first suspect)"
                    if det.get("comm_hook")
                    else ""
                )
            )
        elif backend == "gloo" and kind == "cpu":
            mechanisms.append("gloo-ring")
            hook = str(det.get("comm_hook") or "")
            if hook.startswith("deepspeed.zero"):
                # at 2 ranks ZeRO's sum is the pre-divided ring's, measured; above, its own order, and the
                # ordered reduction is refused under DeepSpeed: the advice below would lead nowhere
                # (docs/integrations.md)
                if manifest.world_size > 2:
                    blockers.append(
                        f"the job reduced through DeepSpeed's {hook} at {manifest.world_size} ranks, in an order the "
                        "replay does not know above 2 ranks: the reduced gradient is compared within tolerance, so a "
                        "clean replay answers inconclusive, never a certificate"
                    )
                    fixes.append("none yet for ZeRO above 2 ranks (docs/integrations.md, DeepSpeed)")
            elif hook:
                caveats.append(
                    f"the job reduced through its own comm hook ({det['comm_hook']}): gloo's ring is reproduced only if "
                    "the hook all-reduces the bucket scaled by 1/W, divided by W (as torch's allreduce_hook does) or as it is "
                    "and divides the sum by W or scales it by 1/W; "
                    "record with RecorderOptions(reduction='ordered') to be sure"
                )
        else:
            mechanisms.append("unknown")
            blockers.append(
                f"the all-reduce ran on {backend} in its own summation order, which the replay cannot reproduce: "
                "from the first replayed step on, the reduced gradient and the weights are compared within tolerance"
            )
            fixes.append(REPLAYABLE)
            if det.get("nccl_env"):
                caveats.append(
                    "NCCL variables were set ("
                    + ", ".join(f"{k}={v}" for k, v in sorted(det["nccl_env"].items()))
                    + "): they change its order further"
                )
        recorded_threads = det.get("num_threads")
        if (
            num_threads
            and kind == "cpu"
            and replay_type == "cpu"
            and recorded_threads
            and int(recorded_threads) != int(num_threads)
        ):
            blockers.append(
                f"--threads {num_threads}: training ran at {recorded_threads} intra-op thread(s), and a CPU replay is "
                "bitwise only at the recorded counts"
            )
            fixes.append("replay without --threads")
    if force_tolerant:
        blockers.append("--tolerant asks for a comparison within tolerance")
        fixes.append("replay without --tolerant")
    unique = lambda items: tuple(dict.fromkeys(items))  # noqa: E731 - keep the first of each, in order
    mechanism = "unknown" if "unknown" in mechanisms else (mechanisms[-1] if mechanisms else "unknown")
    return Preflight(
        exact=not blockers,
        device=device,
        trained_on=", ".join(unique(trained)) or "an unknown device",
        mechanism=mechanism,
        blockers=unique(blockers),
        caveats=unique(caveats),
        fix=(unique(fixes) or ("",))[0],
        memory=memory,
    )
