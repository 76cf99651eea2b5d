"""Configuration of the Ray cluster that training and serving run on."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from infra.launch.config import LauncherConfig
from infra.network import Network


class ClusterConfig(BaseModel):
    """Which Ray cluster to use: one the pipeline starts on this machine, or an existing one."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    mode: Literal["local", "local-multinode", "remote"] = Field(
        "local",
        description="local: the pipeline starts Ray in-process and stops it at the end; "
        "local-multinode: a head and worker nodes started as separate processes on this machine; "
        "remote: use the running cluster at `address` and leave it running.",
    )
    address: str = Field(
        "",
        description="mode=remote: a job-server URL 'http://head:8265' (training is submitted as a Ray Job "
        "that survives this process), or a GCS address 'head:6379' (this process is a driver on the cluster). "
        "Ray Client ('ray://') is refused: a dropped connection kills a long training.",
    )
    shared_paths: list[str] = Field(
        default_factory=list,
        description="mode=remote: local path prefixes every node of the cluster mounts at the same place (NFS, "
        "a shared volume); train.storage_path and data.output must be s3://, az:// or under one of these.",
    )
    job_pip: list[str] = Field(
        default_factory=list,
        description="Job-server mode: pip requirements installed into the training job's runtime env, only for "
        "what the cluster's image lacks (empty: the cluster already has torch, ray, mlflow, ...).",
    )
    job_secrets_file: str = Field(
        "",
        description="Job-server mode: path, on the cluster's nodes, of a JSON file of credentials the training "
        "workers read (the values never travel in the job's runtime env); empty: the nodes' own environment/IAM.",
    )
    num_cpus: int = Field(
        4,
        ge=1,
        description="Logical CPUs the local head advertises. Ray resources are logical: 4 lets 2 training "
        "workers and the Serve replicas be scheduled on a 2-core machine.",
    )
    num_gpus: int = Field(0, ge=0, description="GPUs the local head advertises (0 on CPU machines).")
    worker_nodes: int = Field(1, ge=0, description="Extra worker nodes started for mode=local-multinode.")
    cpus_per_worker_node: int = Field(
        2, ge=1, description="Logical CPUs each extra worker node advertises (mode=local-multinode)."
    )
    object_store_mb: int = Field(512, ge=80, description="Object store size of locally started nodes, in MiB.")
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

    @field_validator("address")
    @classmethod
    def _no_ray_client(cls, value: str) -> str:
        if value.startswith("ray://"):
            raise ValueError(
                "Ray Client (ray://) is not supported: a dropped connection kills a long training; "
                "give the job-server URL instead, e.g. 'http://head:8265'"
            )
        return value

    @property
    def job_server(self) -> bool:
        """True when training goes to the cluster as a Ray Job (mode=remote with an http(s):// address)."""
        return self.mode == "remote" and self.address.startswith(("http://", "https://"))
