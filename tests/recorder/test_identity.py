"""Rank identity and environment facts that go into the manifest (no processes)."""

from __future__ import annotations

import torch

from sdc_forensics.recorder.identity import determinism_flags, gpu_identity, local_identity


def test_identity_from_scheduler_environment(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-17")
    monkeypatch.setenv("K8S_NODE_NAME", "k8s-worker-3")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("GROUP_RANK", "2")
    ident = local_identity(21, torch.device("cpu"))
    assert (ident.rank, ident.slurm_job_id, ident.slurm_node, ident.k8s_node) == (
        21,
        "4242",
        "gpu-node-17",
        "k8s-worker-3",
    )
    assert (ident.local_rank, ident.node_rank, ident.device) == (5, 2, "cpu")
    assert ident.host and ident.gpu_uuid == "" and ident.gpu == "cpu"


def test_identity_without_launcher_environment(monkeypatch):
    for name in (
        "LOCAL_RANK",
        "GROUP_RANK",
        "NODE_RANK",
        "SLURM_NODEID",
        "SLURM_LOCALID",
        "K8S_NODE_NAME",
        "KUBERNETES_NODE_NAME",
        "NODE_NAME",
        "MY_NODE_NAME",
        "SLURM_JOB_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    ident = local_identity(0, torch.device("cpu"))
    assert (ident.local_rank, ident.node_rank, ident.k8s_node, ident.slurm_job_id) == (-1, -1, "", "")


def test_gpu_identity_is_empty_off_cuda():
    assert gpu_identity(torch.device("cpu")) == ("", "")


def test_determinism_flags_name_threads_and_algorithms():
    flags = determinism_flags()
    assert flags["num_threads"] == torch.get_num_threads()
    assert {
        "deterministic_algorithms",
        "cudnn_deterministic",
        "cuda_matmul_allow_tf32",
        "cublas_workspace_config",
    } <= set(flags)
