"""KubeRay manifests from `[cluster.launcher.kuberay]`: a RayCluster, a RayJob that trains, a RayService that serves.

All three share one cluster spec: Ray 2.60 on Python 3.11, in-tree autoscaling between min and max replicas,
token auth from a Kubernetes Secret, every Ray port named on the head, requests equal to limits (Guaranteed QoS:
a training pod is not the first evicted), a GPU worker group with the network profile's NCCL/UCX variables.
"""

from __future__ import annotations

import shlex
from typing import Any

from infra.launch.config import RAY_VERSION, LauncherConfig
from infra.launch.render import PORTS, image_for, project_requirements

API_VERSION = "ray.io/v1"
APP_DIR = "/app"  # where the Dockerfile installs the repository (configs included)


def pod_image(cfg: LauncherConfig, gpu: bool) -> str:
    """code=image: the shardline image (one for CPU and GPU pods); code=working_dir: Ray's own image."""
    return cfg.kuberay.image if cfg.kuberay.code == "image" else image_for(cfg, gpu)


def _auth_env(secret: str) -> list[dict[str, Any]]:
    """Token auth on, the token read from the Secret (key `auth_token`); never a literal value in a manifest."""
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "auth_token"}}},
        {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"},
    ]


def _resources(cpus: int, memory_gib: int, gpus: int = 0) -> dict[str, Any]:
    amount: dict[str, Any] = {"cpu": str(cpus), "memory": f"{memory_gib}Gi"}
    if gpus:
        amount["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amount), "limits": dict(amount)}


def _container(
    name: str, image: str, env: list[dict[str, Any]], resources: dict[str, Any], ports: dict[str, int]
) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "env": env,
        "resources": resources,
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
    }


def _worker_group(
    name: str,
    cfg: LauncherConfig,
    min_replicas: int,
    max_replicas: int,
    cpus: int,
    memory_gib: int,
    gpus: int,
    env: list[dict[str, Any]],
) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "containers": [
            _container(
                "ray-worker",
                pod_image(cfg, gpus > 0),
                env,
                _resources(cpus, memory_gib, gpus),
                {"metrics": PORTS["metrics"]},
            )
        ]
    }
    if gpus:  # GPU nodes are usually tainted so that only GPU work lands there
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # NCCL needs a large /dev/shm
        pod["containers"][0]["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    return {
        "groupName": name,
        "replicas": min_replicas,
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "rayStartParams": {"metrics-export-port": str(PORTS["metrics"])},
        "template": {"spec": pod},
    }


def ray_cluster_spec(cfg: LauncherConfig, network_env: dict[str, str]) -> dict[str, Any]:
    """The RayCluster `spec` the three manifests share."""
    kr = cfg.kuberay
    auth = _auth_env(kr.token_secret)
    gpu_env = auth + [{"name": k, "value": v} for k, v in network_env.items()]
    head = _container(
        "ray-head",
        pod_image(cfg, False),
        auth,
        _resources(kr.head_cpus, kr.head_memory_gib),
        {
            "gcs-server": PORTS["gcs"],
            "dashboard": PORTS["dashboard"],
            "client": PORTS["client"],
            "metrics": PORTS["metrics"],
            "serve": PORTS["serve"],
        },
    )
    return {
        "rayVersion": RAY_VERSION,
        # The operator also puts the token on the autoscaler sidecar and the job submitter (KubeRay >= 1.5.1).
        "authOptions": {"mode": "token", "secretName": kr.token_secret},
        "enableInTreeAutoscaling": True,  # without it min/maxReplicas are never acted on
        "autoscalerOptions": {
            "upscalingMode": "Default",
            "idleTimeoutSeconds": cfg.idle_timeout_minutes * 60,
            "resources": _resources(1, 1),
            "env": auth,
        },
        "headGroupSpec": {
            "serviceType": "ClusterIP",  # reachable inside the Kubernetes cluster only
            # 0.0.0.0 inside the pod is what lets the head Service reach the dashboard and job server;
            # num-cpus 0 keeps training and replicas off the head.
            "rayStartParams": {
                "dashboard-host": "0.0.0.0",
                "num-cpus": "0",
                "metrics-export-port": str(PORTS["metrics"]),
            },
            "template": {"spec": {"containers": [head]}},
        },
        "workerGroupSpecs": [
            _worker_group(
                "cpu", cfg, kr.cpu_min_replicas, kr.cpu_max_replicas, kr.cpu_pod_cpus, kr.cpu_pod_memory_gib, 0, auth
            ),
            _worker_group(
                "gpu",
                cfg,
                kr.gpu_min_replicas,
                kr.gpu_max_replicas,
                kr.gpu_pod_cpus,
                kr.gpu_pod_memory_gib,
                kr.gpus_per_pod,
                gpu_env,
            ),
        ],
    }


def _runtime_env(cfg: LauncherConfig, network_env: dict[str, str]) -> dict[str, Any]:
    env: dict[str, Any] = {"env_vars": dict(network_env)}
    if cfg.kuberay.code == "working_dir":
        if not cfg.kuberay.working_dir_uri:
            raise ValueError("cluster.launcher.kuberay.code='working_dir' needs working_dir_uri (a zip Ray can fetch)")
        env["working_dir"] = cfg.kuberay.working_dir_uri
        env["pip"] = [r for r in project_requirements() if not r.startswith("ray")]  # the image has Ray
    return env


def _meta(cfg: LauncherConfig, suffix: str) -> dict[str, str]:
    return {"name": f"{cfg.kuberay.name}-{suffix}", "namespace": cfg.kuberay.namespace}


def ray_cluster(cfg: LauncherConfig, network_env: dict[str, str]) -> dict[str, Any]:
    """A long-lived RayCluster (the target of `cluster.mode = "remote"`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "RayCluster",
        "metadata": _meta(cfg, "cluster"),
        "spec": ray_cluster_spec(cfg, network_env),
    }


def ray_job(cfg: LauncherConfig, network_env: dict[str, str], pipeline_config: str) -> dict[str, Any]:
    """A RayJob that runs the pipeline's training on a cluster of its own, deleted when the job ends."""
    import yaml

    if cfg.kuberay.code == "image" and not pipeline_config.startswith("/"):
        pipeline_config = f"{APP_DIR}/{pipeline_config}"  # the job's working directory is not the image's
    entrypoint = shlex.join(
        [
            "python",
            "-m",
            "flows.cli",
            "run",
            "--config",
            pipeline_config,
            "--set",
            "cluster.mode=remote",
            "--set",
            "cluster.address=auto",
        ]
    )
    return {
        "apiVersion": API_VERSION,
        "kind": "RayJob",
        "metadata": _meta(cfg, "train"),
        "spec": {
            "entrypoint": entrypoint,
            "runtimeEnvYAML": yaml.safe_dump(_runtime_env(cfg, network_env), sort_keys=False),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "submissionMode": "K8sJobMode",
            "backoffLimit": 0,
            "rayClusterSpec": ray_cluster_spec(cfg, network_env),
        },
    }


def ray_service(cfg: LauncherConfig, network_env: dict[str, str], serve_config: dict[str, Any]) -> dict[str, Any]:
    """A RayService that runs the live endpoint's Serve application(s) given as `serve_config` (applications)."""
    import yaml

    spec = ray_cluster_spec(cfg, network_env)
    return {
        "apiVersion": API_VERSION,
        "kind": "RayService",
        "metadata": _meta(cfg, "serve"),
        "spec": {"serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False), "rayClusterConfig": spec},
    }


def serve_config(
    cfg: LauncherConfig,
    app_name: str,
    model_name: str,
    tracking_uri: str,
    serve: dict[str, Any],
    port: int = PORTS["serve"],
) -> dict[str, Any]:
    """The Serve config of the endpoint: shardline's application builder serving the registry's champion, the
    proxy on 0.0.0.0 inside the pods (the RayService's serve Service is what exposes it)."""
    app: dict[str, Any] = {
        "name": app_name,
        "route_prefix": serve.get("route_prefix", "/"),
        "import_path": "deployments.endpoint_builder:app",
        "args": {"model_name": model_name, "tracking_uri": tracking_uri, "serve": serve},
    }
    if cfg.kuberay.code == "working_dir":
        app["runtime_env"] = _runtime_env(cfg, {})
    return {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": port}, "applications": [app]}
