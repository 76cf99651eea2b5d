"""Configuration of the Ray cluster that training and serving run on."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from infra.launch.config import LauncherConfig
from infra.network import Network


class ClusterConfig(BaseModel):
    """Which Ray cluster to use: one the pipeline starts on this machine, or an existing one."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["local", "local-multinode", "remote"] = Field(
        "local",
        description="local: the pipeline starts Ray in-process and stops it at the end; "
        "local-multinode: a head and worker nodes started as separate processes on this machine; "
        "remote: connect to `address` and leave the cluster running.",
    )
    address: str = Field(
        "", description="Ray address for mode=remote, e.g. 'ray://head:10001' or 'head:6379'."
    )
    num_cpus: int = Field(
        4,
        ge=1,
        description="Logical CPUs the local head advertises. Ray resources are logical: 4 lets 2 training "
        "workers and the Serve replicas be scheduled on a 2-core machine.",
    )
    num_gpus: int = Field(0, ge=0, description="GPUs the local head advertises (0 on CPU machines).")
    worker_nodes: int = Field(
        1, ge=0, description="Extra worker nodes started for mode=local-multinode."
    )
    cpus_per_worker_node: int = Field(
        2, ge=1, description="Logical CPUs each extra worker node advertises (mode=local-multinode)."
    )
    object_store_mb: int = Field(
        512, ge=80, description="Object store size of locally started nodes, in MiB."
    )
    host: str = Field(
        "127.0.0.1", description="Address locally started nodes bind to; 127.0.0.1 unless you mean otherwise."
    )
    network: Network = Field(
        "tcp",
        description="Fabric between training nodes, as NCCL/UCX settings of the training workers (infra/network.py): "
        "tcp (sockets only, safe anywhere), roce (RDMA over Ethernet), infiniband.",
    )
    network_env: dict[str, str] = Field(
        default_factory=dict,
        description="Per-variable overrides of the network profile, e.g. {NCCL_SOCKET_IFNAME = 'eth0'}; an empty "
        "value removes the profile's variable.",
    )
    launcher: LauncherConfig = Field(
        default_factory=LauncherConfig, description="What `shardline cluster` renders for AWS, Azure and KubeRay."
    )
