"""Ray cluster-launcher configs for AWS and Azure, built as data from `[cluster.launcher]` and checked by Ray.

Everything known on this machine is resolved here (image tags, the dependency list, the git URL, the token file),
so nothing is left for a node's shell to expand except Ray's own `$RAY_HEAD_IP`.
"""

from __future__ import annotations

import copy
import shlex
import tomllib
from pathlib import Path
from typing import Any

from infra.launch.config import PYTHON_TAG, RAY_VERSION, LauncherConfig, NodeType

REPO = Path(__file__).resolve().parents[2]
PROVIDERS = ("aws", "azure")

# Ports, all on the head unless said otherwise. Ray's security group (AWS) / network security group (Azure)
# admits SSH from anywhere and any traffic between cluster members; nothing below is opened to the internet.
PORTS = {
    "gcs": 6379,  # GCS: workers join here (ray start --address)
    "dashboard": 8265,  # dashboard and Jobs API (job submission), on launcher.dashboard_host
    "client": 10001,  # Ray Client server, started by default; shardline submits jobs instead
    "metrics": 8080,  # Prometheus metrics of every node (/metrics), for a scraper inside the network
    "object_manager": 8076,  # object transfers between nodes
    "serve": 8000,  # Ray Serve HTTP proxy: the live endpoint (serve.host / serve.port)
}


class LauncherError(ValueError):
    """A rendered launcher config that Ray refuses; the message names the provider and Ray's reason."""


def project_requirements() -> list[str]:
    """The runtime dependencies of pyproject.toml, with Ray pinned to the version the configs are written for."""
    from packaging.requirements import Requirement

    deps = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    out = []
    for dep in deps:
        req = Requirement(dep)
        if req.name == "ray":
            req.specifier = type(req.specifier)(f"=={RAY_VERSION}")
        out.append(str(req))
    return out


def image_for(cfg: LauncherConfig, gpu: bool) -> str:
    """The container image of a node: launcher.image, else Ray's image for this Ray and Python (GPU variant)."""
    return cfg.image or f"rayproject/ray:{RAY_VERSION}-{PYTHON_TAG}{'-gpu' if gpu else ''}"


def _resources(node: NodeType, schedulable: bool = True) -> dict[str, int]:
    """Explicit Ray resources: the autoscaler plans with these before a node exists (Azure never fills them in).
    The head advertises no CPU, so training and replicas go to workers and the head stays responsive."""
    res = {"CPU": node.cpus if schedulable else 0, "memory": int(node.memory_gib * 0.8) * 1024**3}
    if node.gpus:
        res["GPU"] = node.gpus
    return res


def _setup_commands(cfg: LauncherConfig) -> list[str]:
    commands = ["python -m pip install -q " + " ".join(shlex.quote(r) for r in project_requirements())]
    if cfg.git_url:  # the package itself; its dependencies came from the line above
        commands.append(
            "python -m pip install -q --no-deps " + shlex.quote(f"shardline @ git+{cfg.git_url}@{cfg.git_ref}")
        )
    return commands


def _ray_env() -> str:
    # Token auth on every node; the token is the file mounted at ~/.ray/auth_token (Ray's default path).
    return "export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0; ulimit -n 65536;"


def _start_commands(cfg: LauncherConfig) -> tuple[list[str], list[str]]:
    head = (
        f"{_ray_env()} ray start --head --port={PORTS['gcs']} --dashboard-host={shlex.quote(cfg.dashboard_host)} "
        f"--dashboard-port={PORTS['dashboard']} --metrics-export-port={PORTS['metrics']} "
        f"--object-manager-port={PORTS['object_manager']} --autoscaling-config=~/ray_bootstrap_config.yaml "
        "--disable-usage-stats"
    )
    worker = (
        f"{_ray_env()} ray start --address=$RAY_HEAD_IP:{PORTS['gcs']} "
        f"--metrics-export-port={PORTS['metrics']} --object-manager-port={PORTS['object_manager']} "
        "--disable-usage-stats"
    )
    # `ray stop` first, as Ray's own launcher templates do: these nodes are machines `ray up` created for this
    # cluster alone (a restarted node must not keep a half-started Ray); shardline never runs it anywhere else.
    return ["ray stop", head], ["ray stop", worker]


def _gpu_docker(cfg: LauncherConfig, rdma: bool) -> dict[str, Any]:
    # RDMA from a container needs the verbs devices and unlimited locked memory; NCCL wants a large /dev/shm.
    options = ["--shm-size=64g", "--ulimit", "memlock=-1:-1"]
    if rdma:
        options += ["--device=/dev/infiniband", "--cap-add=IPC_LOCK"]
    return {"worker_image": image_for(cfg, gpu=True), "worker_run_options": options}


def _common(
    cfg: LauncherConfig, provider: dict[str, Any], auth: dict[str, Any], head_setup: list[str]
) -> dict[str, Any]:
    head_start, worker_start = _start_commands(cfg)
    return {
        "cluster_name": cfg.cluster_name,
        "max_workers": 0,  # set from the node types below
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": cfg.idle_timeout_minutes,
        "docker": {
            "image": image_for(cfg, gpu=False),
            "container_name": "ray_container",
            "pull_before_run": True,
            "run_options": ["--ulimit", "nofile=65536:65536"],
        },
        "provider": provider,
        "auth": auth,
        "available_node_types": {},
        "head_node_type": "head",
        # Ray's defaults.yaml is merged under this config key by key: every list is given so none of its
        # (nightly-wheel, conda) commands run.
        "file_mounts": {"~/.ray/auth_token": cfg.token_file},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": ["**/.git", "**/.git/**", "**/.shardline", "**/.venv"],
        "rsync_filter": [".gitignore"],
        "initialization_commands": [],
        "setup_commands": _setup_commands(cfg),
        "head_setup_commands": head_setup,
        "worker_setup_commands": [],
        "head_start_ray_commands": head_start,
        "worker_start_ray_commands": worker_start,
    }


def _ray_head_setup(provider: str) -> list[str]:
    """The packages Ray's own defaults install on the head for its autoscaler to reach the cloud's API."""
    import ray.autoscaler
    import yaml

    defaults = Path(ray.autoscaler.__file__).parent / provider / "defaults.yaml"
    return list(yaml.safe_load(defaults.read_text(encoding="utf-8")).get("head_setup_commands", []))


def _node(node: NodeType, node_config: dict[str, Any], head: bool = False) -> dict[str, Any]:
    entry: dict[str, Any] = {"resources": _resources(node, schedulable=not head), "node_config": node_config}
    if not head:
        entry |= {"min_workers": node.min_workers, "max_workers": node.max_workers}
    return entry


def aws_config(cfg: LauncherConfig, rdma: bool = False) -> dict[str, Any]:
    """The `ray up` config for AWS: head, cpu_worker and gpu_worker node types (EFA/placement group on GPU)."""
    aws = cfg.aws
    # cache_stopped_nodes off: a stopped node restarts with the setup of its first start and bills for its disk
    provider: dict[str, Any] = {"type": "aws", "region": aws.region, "cache_stopped_nodes": False}
    if aws.availability_zone:
        provider["availability_zone"] = aws.availability_zone
    auth: dict[str, Any] = {"ssh_user": cfg.ssh_user}
    if cfg.ssh_private_key:
        auth["ssh_private_key"] = cfg.ssh_private_key
    out = _common(cfg, provider, auth, _ray_head_setup("aws"))

    def ec2(node: NodeType) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "InstanceType": node.instance_type,
            "ImageId": aws.image_id,
            "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 512, "VolumeType": "gp3"}}],
        }
        if aws.iam_instance_profile:
            conf["IamInstanceProfile"] = {"Name": aws.iam_instance_profile}
        return conf

    gpu = ec2(aws.gpu_worker)
    if aws.efa_interfaces:
        # One EFA interface per network card; only the first carries the node's IP (device index 0).
        gpu["NetworkInterfaces"] = [
            {
                "NetworkCardIndex": i,
                "DeviceIndex": 0 if i == 0 else 1,
                "InterfaceType": "efa",
                "SubnetId": aws.subnet_id,
                "Groups": [aws.security_group_id],
                "DeleteOnTermination": True,
            }
            for i in range(aws.efa_interfaces)
        ]
    if aws.placement_group:
        gpu["Placement"] = {"GroupName": aws.placement_group}
    gpu_node = _node(aws.gpu_worker, gpu)
    gpu_node["docker"] = _gpu_docker(cfg, rdma or aws.efa_interfaces > 0)
    out["available_node_types"] = {
        "head": _node(aws.head, ec2(aws.head), head=True),
        "cpu_worker": _node(aws.cpu_worker, ec2(aws.cpu_worker)),
        "gpu_worker": gpu_node,
    }
    out["max_workers"] = aws.cpu_worker.max_workers + aws.gpu_worker.max_workers
    return out


def azure_config(cfg: LauncherConfig, rdma: bool = False) -> dict[str, Any]:
    """The `ray up` config for Azure: head, cpu_worker and gpu_worker node types with explicit resources."""
    az = cfg.azure
    provider: dict[str, Any] = {
        "type": "azure",
        "location": az.location,
        "resource_group": az.resource_group,
        "cache_stopped_nodes": False,
    }
    if az.subscription_id:
        provider["subscription_id"] = az.subscription_id
    private = cfg.ssh_private_key or az.ssh_public_key.removesuffix(".pub")
    auth = {"ssh_user": cfg.ssh_user, "ssh_private_key": private, "ssh_public_key": az.ssh_public_key}
    out = _common(cfg, provider, auth, _ray_head_setup("azure"))

    def vm(node: NodeType) -> dict[str, Any]:
        params: dict[str, Any] = {
            "vmSize": node.instance_type,
            "imagePublisher": az.image_publisher,
            "imageOffer": az.image_offer,
            "imageSku": az.image_sku,
            "imageVersion": az.image_version,
        }
        return {"azure_arm_parameters": params}

    gpu_node = _node(az.gpu_worker, vm(az.gpu_worker))
    gpu_node["docker"] = _gpu_docker(cfg, rdma)
    out["available_node_types"] = {
        "head": _node(az.head, vm(az.head), head=True),
        "cpu_worker": _node(az.cpu_worker, vm(az.cpu_worker)),
        "gpu_worker": gpu_node,
    }
    out["max_workers"] = az.cpu_worker.max_workers + az.gpu_worker.max_workers
    return out


def launcher_config(cfg: LauncherConfig, provider: str, rdma: bool = False) -> dict[str, Any]:
    """The launcher config of `provider` ('aws' or 'azure'); `rdma` passes the RDMA devices into GPU containers."""
    if provider == "aws":
        return aws_config(cfg, rdma)
    if provider == "azure":
        return azure_config(cfg, rdma)
    raise ValueError(f"--provider {provider!r}: expected one of {', '.join(PROVIDERS)}")


def check_with_ray(config: dict[str, Any]) -> dict[str, Any]:
    """Ray's schema check and `prepare_config` (defaults merged, node types checked), as `ray up` does first.

    Returns the prepared config. Raises LauncherError with Ray's reason.
    """
    import logging

    from ray.autoscaler._private.util import prepare_config, validate_config

    logging.getLogger("ray.autoscaler._private.util").setLevel(logging.WARNING)  # "setting max workers..." noise
    provider = config.get("provider", {}).get("type", "?")
    try:
        validate_config(config)
        prepared = prepare_config(copy.deepcopy(config))
        validate_config(prepared)
    except Exception as e:  # noqa: BLE001 - jsonschema, ValueError, KeyError: the reason is what matters
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LauncherError(f"{provider} launcher config rejected by Ray: {reason}") from None
    return prepared


def write_yaml(config: dict[str, Any], path: Path, header: str) -> Path:
    """Write `config` as YAML under a comment header (no anchors, multi-line strings as blocks); returns the path."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # a shared list is written out each time, as a person would
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    path.write_text(comment + yaml.dump(config, Dumper=Dumper, sort_keys=False, width=120), encoding="utf-8")
    return path
