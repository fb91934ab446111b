"""The report's "actions ready to paste": cluster commands built from an :class:`Incident`.

One :class:`ActionBlock` per thing to do (resume, then per suspect node: Slurm, Kubernetes,
SageMaker HyperPod, the DCGM diagnostic; or the fabric check of a collective fault); the Markdown
and HTML renderers print the same blocks. Every value that comes from the trace (node names,
GPU UUIDs, paths) is shell-quoted with :func:`shlex.quote`: trace contents are hostile input, and
a pasted command must never run what a crafted manifest put in a host name.

Assumptions (docs/report.md, "Actions"): one GPU per rank; DCGM's GPU id is the NVML index that
``nvidia-smi -i UUID`` prints; the node name is the manifest's Slurm node, else its Kubernetes
node, else the host name. Storage damage points at the node's disk or file system, never its GPU.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from sdc_forensics.decide.decision import Status
from sdc_forensics.decide.incident import Implicates, Incident, Locality, NodeTarget
from sdc_forensics.decide.verdict import BisectResult, Verdict

_TAINT_KEY = "sdc-forensics/suspect"
_DCGM_WHY = {
    2: "level 2 (medium, ~2 min) includes the PCIe test: the rank's input bytes differed, which points at its host's "
    "memory or data path more than at its GPU",
    3: "level 3 (long hardware diagnostics, ~15 min) is DCGM's post-mortem level; one event calls for it before the GPU is reused",
    4: "level 4 (extended) because the fault recurred: two or more independent events on this GPU",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActionBlock:
    """One action: a title, sentences saying why and what to watch, and commands to paste."""

    title: str
    why: tuple[str, ...]
    commands: tuple[str, ...] = ()
    # resume | slurm | kubernetes | hyperpod | dcgm | host | storage | fabric | none
    platform: str = ""

    def to_json(self) -> dict:
        return {"title": self.title, "why": list(self.why), "commands": list(self.commands), "platform": self.platform}


def _q(value: object) -> str:
    return shlex.quote(str(value))


#: What a node name, host name, GPU UUID or PCI bus id looks like. A manifest string that does
#: not (a newline, a leading ``-`` that a command would read as an option, shell syntax) is never
#: pasted into a command: the placeholder goes there instead, and the prose says why.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,252}")


def _arg(value: object, placeholder: str = "NODE") -> str:
    """``value`` as one safe command-line argument, or ``placeholder`` when it does not look like a name."""
    text = str(value)
    return text if _NAME.fullmatch(text) else placeholder


def _gpu_label(target: NodeTarget) -> str:
    return (
        target.gpu_uuid
        or target.pci_bus_id
        or (f"local rank {target.local_rank}" if target.local_rank >= 0 else target.device)
    )


def drain_reason(target: NodeTarget, incident: Incident) -> str:
    """The reason a drain or replacement names: the incident's step, rank and GPU (or disk)."""
    step = (
        incident.first_divergent_step
        if incident.first_divergent_step is not None
        else target.steps[0]
        if target.steps
        else "?"
    )
    if target.implicates is Implicates.DISK:
        return f"sdc-forensics: checkpoint file damaged at rest (step {step}, rank {target.rank}): check disk"
    what = "recurring SDC" if target.recurring else "SDC"
    job = f" job {_arg(target.slurm_job_id, 'JOB')}" if target.slurm_job_id else ""
    named = target.gpu_uuid or target.pci_bus_id
    if not named and target.dcgm_level is None:
        # a rank that computed on the CPU: no GPU to name (the Slurm drill's reason read "GPU local rank 0")
        local = f" (local rank {target.local_rank})" if target.local_rank >= 0 else ""
        return f"sdc-forensics: {what} at step {step}, rank {target.rank}, {_arg(target.device or 'cpu', 'cpu')}{local}{job}"
    gpu = _arg(named, "unnamed") if named else _gpu_label(target)
    return f"sdc-forensics: {what} at step {step}, rank {target.rank}, GPU {gpu}{job}"


def _dcgm(target: NodeTarget) -> ActionBlock:
    level = target.dcgm_level
    if target.gpu_uuid or target.pci_bus_id:
        ident = target.gpu_uuid or target.pci_bus_id
        gpu = f'"$(nvidia-smi -i {_arg(ident, "GPU_UUID")} --query-gpu=index --format=csv,noheader)"'
        note = f"The GPU is found by its {'UUID' if target.gpu_uuid else 'PCI bus id'} ({ident}); DCGM's GPU id is its NVML index."
    else:
        gpu = _q(max(target.local_rank, 0))
        note = (
            f"The trace holds no GPU UUID or PCI bus id for rank {target.rank} (device {target.device}): the GPU id is assumed "
            f"to be its local rank {target.local_rank}; check with dcgmi discovery -l."
        )
    return ActionBlock(
        title=f"Run the DCGM diagnostic on {target.node} (level {level})",
        why=(_DCGM_WHY[level] + ".", note, "Run it on the node itself, with no job on the GPU."),
        commands=(f"ssh {_arg(target.node)}", f"dcgmi diag -r {level} -i {gpu}"),
        platform="dcgm",
    )


def _host_check(target: NodeTarget) -> ActionBlock:
    """A CPU rank's diagnostic: DCGM tests GPUs, so the host's machine-check and EDAC logs and a
    verifying CPU and memory stress stand in for it."""
    node = _arg(target.node)
    return ActionBlock(
        title=f"Check the CPU and memory of {target.node}",
        why=(
            f"Rank {target.rank} computed on the CPU (device {target.device or 'cpu'}): no GPU diagnostic applies. Look for "
            "machine-check and ECC (EDAC) errors, then run a stress test that verifies its results, on the node itself with no job "
            "on it.",
        ),
        commands=(
            f"ssh {node} 'dmesg -T | grep -iE \"mce|machine check|hardware error|edac\"'",
            f"ssh {node} 'stress-ng --cpu 0 --vm 2 --vm-bytes 75% --verify --timeout 15m --metrics-brief'",
        ),
        platform="host",
    )


def _node_blocks(target: NodeTarget, incident: Incident) -> list[ActionBlock]:
    node, reason = _arg(target.node), drain_reason(target, incident)
    named = {
        "slurm": "the manifest's Slurm node name",
        "kubernetes": "the manifest's Kubernetes node name",
        "host": "the host name (the manifest holds no Slurm or Kubernetes node name; use the scheduler's name if it differs)",
    }[target.node_source]
    if node != target.node:
        named += (
            "; that name does not look like a host name (a newline, a leading '-', shell syntax: a damaged or crafted "
            "manifest), so the commands say NODE: put the scheduler's name for the node of rank "
            f"{target.rank} there"
        )
    taint = f"{_TAINT_KEY}=step{incident.first_divergent_step if incident.first_divergent_step is not None else 'x'}-rank{target.rank}"
    if target.implicates is Implicates.DISK:
        blocks = [
            ActionBlock(
                title=f"Check the disk and file system of {target.node}",
                why=(
                    f"A checkpoint file written by rank {target.rank} on {target.host or target.node} no longer holds what was saved: "
                    "damage at rest. The GPU is not implicated.",
                    "Discard the damaged file(s) (marked corrupt in the checkpoint table) and look for I/O errors.",
                ),
                commands=(
                    f"ssh {node} 'dmesg -T | grep -iE \"i/o error|blk_update_request|nvme|xfs|ext4|critical medium\"'",
                ),
                platform="storage",
            )
        ]
        if incident.checkpoint_locality is Locality.NODE_LOCAL:
            blocks.append(
                ActionBlock(
                    title=f"Slurm: drain {target.node} until its disk is checked",
                    why=(
                        f"The checkpoint paths are node-local, so the damaged file sat on {target.node}'s own disk. Node name from {named}.",
                    ),
                    commands=(f"scontrol update nodename={node} state=drain reason={_q(reason)}",),
                    platform="slurm",
                )
            )
        return blocks
    return [
        ActionBlock(
            title=f"Slurm: drain {target.node}",
            why=(
                f"Stops new jobs on the node of rank {target.rank} (GPU {_gpu_label(target)}); running jobs finish. "
                f"Node name from {named}.",
                f"Return it with state=resume only after the {'DCGM' if target.dcgm_level is not None else 'host'} diagnostic passes"
                + (
                    " (the fault recurred: replace the GPU or the node instead)."
                    if target.recurring
                    else " and the event stays single."
                ),
            ),
            commands=(f"scontrol update nodename={node} state=drain reason={_q(reason)}",),
            platform="slurm",
        ),
        ActionBlock(
            title=f"Kubernetes: cordon and taint {target.node}",
            why=(
                "Cordon stops new pods; the NoSchedule taint keeps them off after an uncordon, until someone removes it.",
            ),
            commands=(f"kubectl cordon {node}", f"kubectl taint nodes {node} {taint}:NoSchedule --overwrite"),
            platform="kubernetes",
        ),
        ActionBlock(
            title=f"SageMaker HyperPod: replace {target.node}"
            + ("" if target.recurring else " if the diagnostic fails"),
            why=(
                'On a Slurm-orchestrated cluster, HyperPod replaces a node marked with reason "Action:Replace"; on an EKS cluster, '
                "with the node-health label; with the API, by the node's instance id (aws sagemaker list-cluster-nodes).",
                "A replacement destroys the instance's volumes: copy anything on its local disks (checkpoints) off first.",
            ),
            commands=(
                f'scontrol update nodename={node} state=fail reason="Action:Replace"',
                f"kubectl label node {node} sagemaker.amazonaws.com/node-health-status=UnschedulablePendingReplacement --overwrite",
                "aws sagemaker batch-replace-cluster-nodes --cluster-name CLUSTER --node-ids INSTANCE_ID",
            ),
            platform="hyperpod",
        ),
        _dcgm(target) if target.dcgm_level is not None else _host_check(target),
    ]


def _resume_block(result: BisectResult, incident: Incident) -> ActionBlock | None:
    last = result.last_clean_checkpoint
    nodes = sorted(
        {
            t.node
            for t in incident.nodes
            if t.implicates is not Implicates.DISK or incident.checkpoint_locality is Locality.NODE_LOCAL
        }
    )
    why: list[str] = []
    commands: list[str] = []
    if last is None:
        why.append(
            "No checkpoint could be certified clean: do not resume from this run's checkpoints without further "
            'verification (see "What could not be checked").'
        )
    else:
        why.append(
            f"Resume from checkpoint {last.step}, {last.path} (holds θ_{last.step}; certified {last.status.value}); the recorder "
            "starts a new attempt in the same trace directory."
        )
        bad = [c for c in result.checkpoints if c.status in (Status.TAINTED, Status.CORRUPT)]
        if bad:
            why.append(
                "Do not resume from checkpoint(s) " + ", ".join(str(c.step) for c in bad) + " (tainted or corrupt)."
            )
    if nodes:
        why.append("Keep the job off the suspect node(s): " + ", ".join(nodes) + ".")
        commands.append(
            f"sbatch --exclude={','.join(_arg(n) for n in nodes)} job.sbatch   # your job script, "
            + ("resuming from the checkpoint above" if last is not None else "once a resume point is settled")
        )
    if incident.nodes and incident.checkpoint_locality is Locality.NODE_LOCAL:
        where = incident.resume_host or "the node that wrote it"
        why.append(
            f"Checkpoint paths look node-local ({_paths(incident)}): keep checkpoints off the replaced node. Copy the resume "
            f"checkpoint from {where} to shared storage before the node is drained or replaced, and write new checkpoints "
            "to shared storage or another node."
        )
        if last is not None and incident.resume_host and incident.resume_job_path:
            host = _arg(incident.resume_host)
            source = _q(f"{host}:{incident.resume_job_path}")
            commands.append(f"rsync -a {source} SHARED_DIR/   # before draining or replacing {host}")
    elif incident.nodes and incident.checkpoint_locality is Locality.UNKNOWN and incident.checkpoint_paths:
        why.append(
            f"Whether checkpoint paths are node-local cannot be told from them ({_paths(incident)}): if they are, copy the "
            "resume checkpoint off the suspect node before it is replaced, and keep new checkpoints off it."
        )
    if incident.resume_on_suspect_node and last is not None:
        why.append(
            f"The resume checkpoint was written by rank {incident.resume_saved_by} on {incident.resume_host}, a suspect node: "
            "its content was verified against the replicas' majority, but the file lives there."
        )
    return ActionBlock(title="Resume", why=tuple(why), commands=tuple(commands), platform="resume")


def _paths(incident: Incident) -> str:
    shown = list(incident.checkpoint_paths[:2])
    return ", ".join(shown) + (", …" if len(incident.checkpoint_paths) > 2 else "")


def build_actions(result: BisectResult, incident: Incident, job_nodes: tuple[str, ...] = ()) -> tuple[ActionBlock, ...]:
    """The actions for ``result``, in the order to take them.

    Args:
        result: the analysis.
        incident: :func:`~sdc_forensics.decide.incident.build_incident` of it.
        job_nodes: every node of the job (for a collective fault's fabric check).
    """
    if result.verdict is Verdict.CLEAN:
        return (
            ActionBlock(
                title="No node action",
                why=("No corruption was found in the steps examined: nothing to drain, cordon or replace.",),
                platform="none",
            ),
        )
    blocks: list[ActionBlock] = []
    resume = _resume_block(result, incident)
    if resume is not None:
        blocks.append(resume)
    for target in incident.nodes:
        blocks += _node_blocks(target, incident)
    if incident.collective and not incident.on_gpu:
        blocks.append(
            ActionBlock(
                title="Collective fault: no single node to drain",
                why=(
                    "Every rank received the same wrong all-reduce result, so no rank is to blame. The ranks ran on CPUs (gloo over "
                    "the network): check the network interfaces of every node in the job for errors and drops "
                    "(ip -s link, ethtool -S) and the hosts' machine-check logs; no GPU diagnostic applies.",
                ),
                commands=(
                    "ip -s link; dmesg -T | grep -iE 'mce|machine check|hardware error|edac'   # on every node of the job",
                ),
                platform="fabric",
            )
        )
    elif incident.collective:
        nodes = ",".join(_arg(n) for n in job_nodes)
        blocks.append(
            ActionBlock(
                title="Collective fault: no single node to drain",
                why=(
                    "Every rank received the same wrong all-reduce result, so no rank is to blame: check the interconnect and the "
                    "collective library of every node in the job (DCGM level 2 includes PCIe and NVLink checks; NCCL's all_reduce_perf "
                    "from nccl-tests checks results across nodes).",
                ),
                commands=(f"srun --nodelist={nodes} --ntasks-per-node=1 dcgmi diag -r 2",)
                if nodes
                else ("dcgmi diag -r 2   # on every node of the job",),
                platform="fabric",
            )
        )
    if not incident.nodes and not incident.collective:
        shared = next((s for s in result.suspects if s.shared), None)
        if shared is not None:
            first = f"Every rank is named: {shared.recommendation}."
        elif result.verdict is Verdict.INCONCLUSIVE:
            first = "The evidence does not name a rank: nothing to drain until it is settled."
        else:
            first = "No suspect node was named."
        blocks.append(
            ActionBlock(
                title="No node action yet",
                why=(first,) + tuple(f"To settle: {line}" for line in result.settle),
                platform="none",
            )
        )
    return tuple(blocks)
