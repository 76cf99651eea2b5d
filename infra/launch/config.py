"""`[cluster.launcher]`: what `shardline cluster up|down|render` renders for AWS, Azure and KubeRay."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

RAY_VERSION = "2.60.0"
PYTHON_TAG = "py311"


class NodeType(BaseModel):
    """One kind of machine in the cluster, and the Ray resources it advertises (the autoscaler plans with these)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    instance_type: str = Field(description="The provider's machine type (EC2 instance type, Azure VM size).")
    cpus: int = Field(ge=0, description="vCPUs of the machine type: the node's Ray `CPU` resource.")
    gpus: int = Field(0, ge=0, description="GPUs of the machine type: the node's Ray `GPU` resource.")
    memory_gib: int = Field(ge=1, description="Memory of the machine type in GiB; Ray gets 80% as `memory`.")
    min_workers: int = Field(0, ge=0, description="Nodes of this type kept running (worker types only).")
    max_workers: int = Field(2, ge=0, description="Most nodes of this type the autoscaler starts (worker types).")


AWS_NODES = {
    "head": NodeType(instance_type="m7i.2xlarge", cpus=8, memory_gib=32),
    "cpu_worker": NodeType(instance_type="m7i.4xlarge", cpus=16, memory_gib=64, max_workers=4),
    "gpu_worker": NodeType(instance_type="p5.48xlarge", cpus=192, gpus=8, memory_gib=2048),  # 8x H100
}
AZURE_NODES = {
    "head": NodeType(instance_type="Standard_D8s_v5", cpus=8, memory_gib=32),
    "cpu_worker": NodeType(instance_type="Standard_D16s_v5", cpus=16, memory_gib=64, max_workers=4),
    # 8x H100 and 8x 400 Gb/s InfiniBand
    "gpu_worker": NodeType(instance_type="Standard_ND96isr_H100_v5", cpus=96, gpus=8, memory_gib=1900),
}


def _over_defaults(data: Any, defaults: dict[str, NodeType]) -> Any:
    """A node type given in part (`--set cluster.launcher.aws.gpu_worker.max_workers=8`) keeps the other fields of
    its default. Changing instance_type means giving its cpus, gpus and memory_gib too."""
    if isinstance(data, dict):
        for name, default in defaults.items():
            if isinstance(data.get(name), dict):
                data = {**data, name: {**default.model_dump(), **data[name]}}
    return data


class AwsLauncher(BaseModel):
    """Where and on what the AWS cluster runs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    region: str = Field("us-east-1", description="EC2 region.")
    availability_zone: str = Field(
        "", description="Zones to launch in, comma-separated; empty lets Ray pick. GPU capacity is often in one."
    )
    image_id: str = Field(
        "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
        description="AMI of every node. The default is AWS's SSM pointer to the current Deep Learning Base AMI "
        "(Ubuntu 22.04: NVIDIA driver, Docker with the NVIDIA runtime, EFA driver), resolved by EC2 at launch.",
    )
    iam_instance_profile: str = Field(
        "shardline-ray", description="Instance profile of the nodes: grants S3 access to shards and checkpoints."
    )
    head: NodeType = Field(
        default=AWS_NODES["head"], description="The head node: GCS, dashboard, job server, autoscaler, Serve proxy."
    )
    cpu_worker: NodeType = Field(
        default=AWS_NODES["cpu_worker"], description="CPU workers: sharding, evaluation, Serve replicas on CPU."
    )
    gpu_worker: NodeType = Field(
        default=AWS_NODES["gpu_worker"], description="GPU workers for FSDP training (8x H100 each by default)."
    )
    efa_interfaces: int = Field(
        0,
        ge=0,
        le=32,
        description="EFA network interfaces per GPU node (p5.48xlarge has 32; 0: no EFA, TCP between nodes). "
        "EFA gives NCCL OS-bypass RDMA through the aws-ofi-nccl plugin, which the node image must contain; "
        "needs subnet_id and security_group_id (the group must admit all traffic from itself).",
    )
    subnet_id: str = Field("", description="Subnet of the EFA interfaces (one subnet, one zone).")
    security_group_id: str = Field("", description="Security group of the EFA interfaces.")
    placement_group: str = Field(
        "",
        description="An existing EC2 placement group (strategy `cluster`) for the GPU nodes: all in one "
        "spine of the network, the lowest latency between them. Create it first: "
        "`aws ec2 create-placement-group --group-name NAME --strategy cluster`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _node_defaults(cls, data: Any) -> Any:
        return _over_defaults(data, AWS_NODES)

    @model_validator(mode="after")
    def _efa_needs_network(self) -> AwsLauncher:
        if self.efa_interfaces and not (self.subnet_id and self.security_group_id):
            raise ValueError(
                f"efa_interfaces={self.efa_interfaces} needs subnet_id and security_group_id "
                "(EC2 attaches EFA interfaces only with both given)"
            )
        return self


class AzureLauncher(BaseModel):
    """Where and on what the Azure cluster runs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    location: str = Field("eastus", description="Azure region.")
    resource_group: str = Field("shardline-ray", description="Resource group the cluster's VMs live in.")
    subscription_id: str = Field("", description="Subscription; empty: the Azure CLI's current one.")
    image_publisher: str = Field("microsoft-dsvm", description="VM image publisher.")
    image_offer: str = Field(
        "ubuntu-hpc",
        description="VM image offer: Ubuntu HPC has the NVIDIA driver, Docker, and the InfiniBand "
        "(MOFED) stack the ND-series GPU VMs need.",
    )
    image_sku: str = Field("2204", description="VM image SKU (Ubuntu 22.04).")
    image_version: str = Field("latest", description="VM image version.")
    ssh_public_key: str = Field("~/.ssh/id_rsa.pub", description="Public key Azure installs on the VMs.")
    head: NodeType = Field(
        default=AZURE_NODES["head"], description="The head node: GCS, dashboard, job server, autoscaler, Serve proxy."
    )
    cpu_worker: NodeType = Field(default=AZURE_NODES["cpu_worker"], description="CPU workers.")
    gpu_worker: NodeType = Field(
        default=AZURE_NODES["gpu_worker"],
        description="GPU workers for FSDP training (8x H100, InfiniBand, by default).",
    )

    @model_validator(mode="before")
    @classmethod
    def _node_defaults(cls, data: Any) -> Any:
        return _over_defaults(data, AZURE_NODES)


class KubeRayLauncher(BaseModel):
    """The RayJob (training) and RayService (live endpoint) manifests."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    # Kubernetes names: an RFC 1123 label (lowercase, digits, '-'); `name` leaves room for the suffixes it gets
    namespace: str = Field(
        "default", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", description="Kubernetes namespace of the manifests."
    )
    name: str = Field(
        "shardline",
        pattern=r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$",
        description="Prefix of the RayCluster/RayJob/RayService names.",
    )
    code: str = Field(
        "image",
        pattern="^(image|working_dir)$",
        description="How the project's code reaches the pods: `image` (installed in `image`, built from the "
        "repository's Dockerfile) or `working_dir` (a zip at working_dir_uri plus the dependencies as `pip` in the "
        "runtime environment, on Ray's own image).",
    )
    image: str = Field(
        "shardline:0.1.0",
        description="For code=image: the image built from the Dockerfile (push it to a "
        "registry your cluster pulls from and name it here).",
    )
    working_dir_uri: str = Field(
        "", description="For code=working_dir: a zip of the repository Ray can fetch (s3://, gs://, https://)."
    )
    pipeline_config: str = Field(
        "configs/demo.toml",
        description="The RayJob's pipeline config: a path inside the image or working_dir. "
        "It must name shared storage and a shared MLflow server (pods have no common disk).",
    )
    token_secret: str = Field(
        "shardline-ray-token", description="Kubernetes Secret holding the Ray auth token under key `auth_token`."
    )
    gpu_min_replicas: int = Field(0, ge=0, description="GPU worker pods kept running.")
    gpu_max_replicas: int = Field(4, ge=0, description="Most GPU worker pods the autoscaler starts.")
    gpus_per_pod: int = Field(8, ge=1, description="GPUs of each GPU worker pod.")
    gpu_pod_cpus: int = Field(32, ge=1, description="CPUs requested by each GPU worker pod.")
    gpu_pod_memory_gib: int = Field(256, ge=1, description="Memory of each GPU worker pod in GiB.")
    cpu_min_replicas: int = Field(0, ge=0, description="CPU worker pods kept running (Serve replicas).")
    cpu_max_replicas: int = Field(4, ge=0, description="Most CPU worker pods the autoscaler starts.")
    cpu_pod_cpus: int = Field(8, ge=1, description="CPUs of each CPU worker pod.")
    cpu_pod_memory_gib: int = Field(32, ge=1, description="Memory of each CPU worker pod in GiB.")
    head_cpus: int = Field(4, ge=1, description="CPUs of the head pod (it runs no training: num-cpus 0).")
    head_memory_gib: int = Field(16, ge=1, description="Memory of the head pod in GiB.")

    @model_validator(mode="after")
    def _min_within_max(self) -> KubeRayLauncher:
        for kind in ("gpu", "cpu"):
            low, high = getattr(self, f"{kind}_min_replicas"), getattr(self, f"{kind}_max_replicas")
            if low > high:
                raise ValueError(f"{kind}_min_replicas={low} > {kind}_max_replicas={high}")
        return self


class LauncherConfig(BaseModel):
    """Settings shared by every launcher, and one section per provider."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a NaN bound never fails a check

    cluster_name: str = Field(
        "shardline", pattern=r"^[a-z][a-z0-9-]{0,39}$", description="Name of the Ray cluster (tags, resource names)."
    )
    image: str = Field(
        "",
        description="Container image every Ray node runs; empty: rayproject/ray:2.60.0-py311 on CPU nodes and "
        "its -gpu variant on GPU nodes. Set it to an image with shardline installed to skip the pip step.",
    )
    git_url: str = Field(
        "",
        description="Git URL of shardline to pip-install on the nodes (no credentials in it); empty: the "
        "nodes get only the dependencies and the code arrives with each job's runtime environment.",
    )
    git_ref: str = Field("main", description="Branch, tag or commit of git_url to install.")
    token_file: str = Field(
        "~/.ray/auth_token",
        description="Ray auth token on this machine, copied to every node (token auth is "
        "on; create it with `ray get-auth-token --generate`).",
    )
    ssh_user: str = Field("ubuntu", description="Login user of the node image.")
    ssh_private_key: str = Field(
        "",
        description="Private key for SSH to the nodes; empty: Ray creates an EC2 key pair (AWS); Azure uses "
        "the private half of azure.ssh_public_key.",
    )
    idle_timeout_minutes: int = Field(10, ge=1, description="Idle workers are removed after this long.")
    dashboard_host: str = Field(
        "127.0.0.1",
        description="Address the head's dashboard and job server (8265) bind to. 127.0.0.1: reach "
        "them through `ray dashboard CONFIG` (an SSH tunnel). 0.0.0.0 opens them to the cluster's own network "
        "(Ray's security group / network security group admits SSH and traffic between members, nothing else), "
        "for a Prefect worker inside it; token auth guards them either way.",
    )
    aws: AwsLauncher = Field(default_factory=AwsLauncher, description="`--provider aws`.")
    azure: AzureLauncher = Field(default_factory=AzureLauncher, description="`--provider azure`.")
    kuberay: KubeRayLauncher = Field(default_factory=KubeRayLauncher, description="`--provider kuberay`.")
