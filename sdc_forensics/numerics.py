"""The numerics contract: what sets the bits of a training step, recorded and reproduced.

The recorder writes :func:`record` into each attempt of the manifest (``Attempt.determinism``);
the replay applies the recorded values with :func:`reproduce` for the window it replays (not
settings of its own: "Reproduce, don't impose", design brief) and restores the process's own
afterwards. What cannot be applied on the replay device (a GPU model, a library version, an NCCL
variable of a collective the replay does not run) is listed, and ``replay/preflight.py`` says
before any replay whether the replay can be exact.

Recorded keys (all optional: older traces hold a subset):

=============================================  ===============================================
``device_type``, ``device_name``                ``cpu`` / ``cuda``; the GPU model or the CPU
``compute_capability``                          ``"9.0"`` on CUDA
``cuda_version``, ``cudnn_version``,            library versions (``""`` where absent)
``nccl_version``
``backend``                                     the process group's backend (``gloo``, ``nccl``)
``reduction``                                   ``native`` or ``ordered`` (``sdc_forensics/reduction.py``)
``comm_hook``                                   the job's own DDP comm hook (``module.qualname``), ``""`` for none
``deterministic_algorithms``,                   ``torch.use_deterministic_algorithms``
``deterministic_warn_only``
``cudnn_deterministic``, ``cudnn_benchmark``    cuDNN flags
``cuda_matmul_allow_tf32``, ``cudnn_allow_tf32``  TF32
``float32_matmul_precision``                    ``highest`` / ``high`` / ``medium``
``fp16_reduced_precision_reduction``,           cuBLAS reduced-precision reductions
``bf16_reduced_precision_reduction``
``sdpa_backends``                               the scaled-dot-product attention backends enabled
``cublas_workspace_config``                     ``CUBLAS_WORKSPACE_CONFIG``
``nccl_env``                                    ``NCCL_ALGO``, ``NCCL_PROTO``, channel limits, NVLS
``num_threads``                                 intra-op threads (rank 0's first step; per step in STEP records)
``broadcast_buffers``                           DDP's ``broadcast_buffers`` (DDP jobs only): every rank starts a
                                                step from rank 0's module buffers
``autocast_dtype``                              the dtype ``torch.autocast`` computed in during rank 0's first
                                                forward (``bfloat16``, ``float16``); absent when autocast was off
=============================================  ===============================================
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from typing import Any

import torch

#: NCCL variables that change the summation order or the algorithm of a collective.
NCCL_VARS = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_NVLS_ENABLE",
    "NCCL_NVLSTREE_MAX_CHUNKSIZE",
    "NCCL_COLLNET_ENABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
)
_SDPA = ("flash", "mem_efficient", "math", "cudnn")


def _safe(fn, default: Any = "") -> Any:
    try:
        value = fn()
    except Exception:  # noqa: BLE001 - a missing backend or an old torch must never stop training
        return default
    return default if value is None else value


def _sdpa_backends() -> list[str]:
    enabled = []
    for name in _SDPA:
        probe = getattr(torch.backends.cuda, f"{name}_sdp_enabled", None)
        if probe is not None and _safe(probe, False):
            enabled.append(name)
    return enabled


def autocast_dtype(device_type: str) -> str:
    """The dtype ``torch.autocast`` computes in on ``device_type`` now, ``""`` when it is off
    (read inside a forward: the recorder's :class:`~sdc_forensics.recorder.threads.AutocastWatch`)."""
    enabled = getattr(torch, "is_autocast_enabled", None)
    get_dtype = getattr(torch, "get_autocast_dtype", None)
    try:
        on = bool(enabled(device_type))
        dtype = get_dtype(device_type) if on else None
    # torch < 2.4 has only the per-device functions
    except TypeError:
        on = bool(torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled())
        dtype = (
            (torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()) if on else None
        )
    return str(dtype).removeprefix("torch.") if on and dtype is not None else ""


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(_safe(lambda: torch.cuda.get_device_name(device), "cuda"))
    return f"cpu ({platform.machine() or 'unknown'})"


def record(
    device: torch.device | None = None, backend: str = "", reduction: str = "native", comm_hook: str = ""
) -> dict[str, Any]:
    """The settings that decide a step's bits, on this process (rank 0's, for the manifest);
    ``comm_hook``: the qualified name of the job's own DDP comm hook ("" for DDP's mean all-reduce)."""
    device = device or torch.device("cpu")
    matmul = torch.backends.cuda.matmul
    flags: dict[str, Any] = {
        "device_type": device.type,
        "device_name": _device_name(device),
        "compute_capability": ".".join(map(str, _safe(lambda: torch.cuda.get_device_capability(device), ())))
        if device.type == "cuda"
        else "",
        "cuda_version": str(torch.version.cuda or ""),
        "cudnn_version": str(_safe(torch.backends.cudnn.version, "")) if device.type == "cuda" else "",
        "nccl_version": ".".join(map(str, _safe(torch.cuda.nccl.version, ()))) if device.type == "cuda" else "",
        "backend": backend,
        "reduction": reduction,
        "comm_hook": comm_hook,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cuda_matmul_allow_tf32": bool(matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduced_precision_reduction": bool(getattr(matmul, "allow_fp16_reduced_precision_reduction", False)),
        "bf16_reduced_precision_reduction": bool(getattr(matmul, "allow_bf16_reduced_precision_reduction", False)),
        "sdpa_backends": _sdpa_backends(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
        "nccl_env": {name: os.environ[name] for name in NCCL_VARS if name in os.environ},
        "num_threads": torch.get_num_threads(),
    }
    return flags


def _current() -> dict[str, Any]:
    matmul = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cuda_matmul_allow_tf32": matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduced_precision_reduction": getattr(matmul, "allow_fp16_reduced_precision_reduction", False),
        "bf16_reduced_precision_reduction": getattr(matmul, "allow_bf16_reduced_precision_reduction", False),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "threads": torch.get_num_threads(),
    }


def _set(values: dict[str, Any]) -> None:
    """Set the process-wide flags in ``values`` (keys of :func:`_current`; absent keys untouched)."""
    matmul = torch.backends.cuda.matmul
    wanted = (bool(values.get("deterministic_algorithms")), bool(values.get("deterministic_warn_only", False)))
    now = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    # only a change: the call imports torch._inductor (about 1-2 s of every replay process's start)
    if "deterministic_algorithms" in values and wanted != now:
        torch.use_deterministic_algorithms(wanted[0], warn_only=wanted[1])
    for key, target, attr in (
        ("cudnn_deterministic", torch.backends.cudnn, "deterministic"),
        ("cudnn_benchmark", torch.backends.cudnn, "benchmark"),
        ("cuda_matmul_allow_tf32", matmul, "allow_tf32"),
        ("cudnn_allow_tf32", torch.backends.cudnn, "allow_tf32"),
        ("fp16_reduced_precision_reduction", matmul, "allow_fp16_reduced_precision_reduction"),
        ("bf16_reduced_precision_reduction", matmul, "allow_bf16_reduced_precision_reduction"),
    ):
        if key in values and hasattr(target, attr):
            setattr(target, attr, bool(values[key]))
    if values.get("float32_matmul_precision") in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(values["float32_matmul_precision"])
    if "cublas_workspace_config" in values:
        if values["cublas_workspace_config"]:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = str(values["cublas_workspace_config"])
        else:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if values.get("threads"):
        torch.set_num_threads(int(values["threads"]))


#: What the replay applies when a trace recorded none of the flags (traces before the contract).
_IMPOSED = {
    "deterministic_algorithms": True,
    "deterministic_warn_only": True,
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    "cuda_matmul_allow_tf32": False,
    "cudnn_allow_tf32": False,
    "cublas_workspace_config": ":4096:8",
}
_APPLIED_KEYS = tuple(k for k in _current() if k != "threads")


@contextlib.contextmanager
def reproduce(recorded: dict[str, Any], device: torch.device, num_threads: int | None) -> Iterator[dict[str, Any]]:
    """Apply the recorded settings for a replay on ``device``; restore this process's afterwards.

    Yields what was applied (for ``replayed.settings``), with ``not_reproduced``: sentences for
    each recorded setting the replay could not apply here (another device class or model, NCCL
    variables of a collective the replay does not run). A trace that recorded no flag at all gets
    the deterministic settings replays used before the contract (said in ``source``).
    """
    saved = _current()
    known = {k: recorded[k] for k in _APPLIED_KEYS if k in recorded}
    values = dict(known) if known else dict(_IMPOSED)
    if values.get("deterministic_algorithms") and device.type == "cuda" and not values.get("cublas_workspace_config"):
        # deterministic cuBLAS needs a fixed workspace
        values["cublas_workspace_config"] = ":4096:8"
    if num_threads:
        values["threads"] = int(num_threads)
    _set(values)
    try:
        yield {
            "source": "recorded" if known else "imposed (the trace recorded no numerics settings)",
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "num_threads": torch.get_num_threads(),
            "torch_version": torch.__version__,
            "device_type": device.type,
            "not_reproduced": not_reproduced(recorded, device),
        }
    finally:
        _set(saved)


def not_reproduced(recorded: dict[str, Any], device: torch.device) -> list[str]:
    """Recorded settings a replay on ``device`` cannot reproduce, one sentence each."""
    out = []
    trained_on = recorded.get("device_type")
    if trained_on and trained_on != device.type:
        out.append(f"trained on {recorded.get('device_name') or trained_on}, replaying on {device.type}")
    elif trained_on == "cuda" and device.type == "cuda":
        here = _device_name(device)
        if recorded.get("device_name") and recorded["device_name"] != here:
            out.append(f"trained on {recorded['device_name']}, replaying on {here}")
        for key, now in (
            ("cuda_version", str(torch.version.cuda or "")),
            ("cudnn_version", str(_safe(torch.backends.cudnn.version, ""))),
        ):
            if recorded.get(key) and str(recorded[key]) != now:
                out.append(f"{key.replace('_', ' ')} {recorded[key]} in training, {now or 'none'} here")
    if recorded.get("nccl_env") and recorded.get("reduction") != "ordered":
        shown = ", ".join(f"{k}={v}" for k, v in sorted(recorded["nccl_env"].items()))
        out.append(f"NCCL settings ({shown}) shape a collective the replay does not run")
    return out
