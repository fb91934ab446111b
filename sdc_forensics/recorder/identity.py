"""Who and where each rank is: host, node, local rank, GPU, scheduler IDs, and the environment.

Gathered once per attempt (one ``all_gather_object``) and written into the manifest by rank 0,
so that a verdict can name the host and GPU of a suspect rank long after the job is gone.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

import torch

from sdc_forensics import numerics
from sdc_forensics.trace.manifest import Attempt, RankIdentity

#: Environment variables that name the Kubernetes node a pod runs on (set via the downward API).
K8S_NODE_VARS = ("K8S_NODE_NAME", "KUBERNETES_NODE_NAME", "NODE_NAME", "MY_NODE_NAME")


def _env_int(*names: str) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.strip().lstrip("-").isdigit():
            return int(value)
    return -1


def gpu_identity(device: torch.device) -> tuple[str, str]:
    """``(uuid, pci_bus_id)`` of a CUDA device; empty strings elsewhere or when unavailable."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "", ""
    try:
        props = torch.cuda.get_device_properties(device)
    # a broken driver must not stop training
    except (RuntimeError, AssertionError):
        return "", ""
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid and not uuid.startswith("GPU-"):
        uuid = f"GPU-{uuid}"
    pci = ""
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        domain = int(getattr(props, "pci_domain_id", 0) or 0)
        dev = int(getattr(props, "pci_device_id", 0) or 0)
        pci = f"{domain:08x}:{int(bus):02x}:{dev:02x}.0"
    return uuid, pci


def local_identity(rank: int, device: torch.device) -> RankIdentity:
    """This process's identity (node rank and local rank from the launcher's environment, if set)."""
    uuid, pci = gpu_identity(device)
    k8s = next((os.environ[v] for v in K8S_NODE_VARS if os.environ.get(v)), "")
    device_label = (
        str(device)
        if device.type != "cuda"
        else f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    )
    return RankIdentity(
        rank=rank,
        host=socket.gethostname(),
        node_rank=_env_int("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"),
        local_rank=_env_int("LOCAL_RANK", "SLURM_LOCALID"),
        gpu_uuid=uuid,
        pci_bus_id=pci,
        device=device_label,
        slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
        slurm_node=os.environ.get("SLURMD_NODENAME", ""),
        k8s_node=k8s,
    )


def complete_identities(identities: list[RankIdentity]) -> list[RankIdentity]:
    """Fill node and local ranks the launcher did not provide, from host names (in rank order)."""
    hosts: list[str] = []
    for ident in identities:
        if ident.host not in hosts:
            hosts.append(ident.host)
    seen: dict[str, int] = {}
    out = []
    for ident in sorted(identities, key=lambda i: i.rank):
        local = seen.get(ident.host, 0)
        seen[ident.host] = local + 1
        out.append(
            dataclasses.replace(
                ident,
                node_rank=ident.node_rank if ident.node_rank >= 0 else hosts.index(ident.host),
                local_rank=ident.local_rank if ident.local_rank >= 0 else local,
            )
        )
    return out


def node_map(identities: list[RankIdentity], override: tuple[int, ...] | None) -> tuple[int, ...]:
    """Node index of every rank: the override, else one node per distinct host (in rank order)."""
    if override is not None:
        return tuple(override)
    hosts: list[str] = []
    nodes = []
    for ident in sorted(identities, key=lambda i: i.rank):
        if ident.host not in hosts:
            hosts.append(ident.host)
        nodes.append(hosts.index(ident.host))
    return tuple(nodes)


def determinism_flags(
    device: torch.device | None = None, backend: str = "", reduction: str = "native", comm_hook: str = ""
) -> dict[str, Any]:
    """The settings that decide whether a replay can be bitwise exact (``sdc_forensics.numerics.record``)."""
    return numerics.record(device, backend, reduction, comm_hook)


def make_attempt(
    attempt: int,
    start_step: int,
    identities: list[RankIdentity],
    *,
    device: torch.device | None = None,
    backend: str = "",
    reduction: str = "native",
    comm_hook: str = "",
    layout_settings: dict | None = None,
) -> Attempt:
    """The manifest entry of this attempt: identities and the numerics contract (``sdc_forensics.numerics``)
    of this process (rank 0): its device, the process group's ``backend``, the all-reduce ``reduction``,
    and what the layout adds (``Layout.numerics``: DDP's ``broadcast_buffers``)."""
    return Attempt(
        attempt=attempt,
        start_step=start_step,
        started_ns=time.time_ns(),
        torch_version=torch.__version__,
        cuda_version=str(torch.version.cuda or ""),
        determinism={**determinism_flags(device, backend, reduction, comm_hook), **(layout_settings or {})},
        ranks=tuple(identities),
    )


def gather_identities(rank: int, device, group, problem: str | None, node_of_rank) -> tuple[tuple, tuple[int, ...]]:
    """Every rank's identity and what it found wrong, in one collective (all ranks refuse together):
    ``(identities, node of each rank)``."""
    import torch.distributed as dist

    from sdc_forensics.errors import UsageError

    world_size = dist.get_world_size(group)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (local_identity(rank, device), problem), group=group)
    refuse_together([found for _, found in gathered])
    identities = complete_identities([identity for identity, _ in gathered])
    nodes = node_map(identities, node_of_rank)
    if len(nodes) != world_size:
        raise UsageError(f"node_of_rank has {len(nodes)} entries for {world_size} ranks")
    return identities, nodes


def refuse_together(problems: list) -> None:
    """Raise the first rank's problem on every rank (each has the gathered list)."""
    first = next((p for p in problems if p), None)
    if first is not None:
        from sdc_forensics.errors import UsageError

        raise UsageError(first)
