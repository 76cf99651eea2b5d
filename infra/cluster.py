"""Ray cluster provisioning: start Ray on this machine (one or several nodes) or connect to a running cluster."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from pydantic import BaseModel, Field

from infra.config import ClusterConfig
from infra.paths import quiet_telemetry
from infra.ray_env import (  # noqa: F401 - re-exported: the names callers have always imported from here
    RAY_MULTI_NODE_SWITCH,
    ClusterError,
    _run_ray,
    driver_on_loopback,
    forwarded_env,
    free_port,
    is_loopback,
    loopback_node,
    node_env,
    ray_cli,
    use_token_auth,
)


class ClusterInfo(BaseModel):
    """The Ray cluster a pipeline run uses. No run owns it: the local head outlives runs (infra/head.py)."""

    address: str
    mode: str
    resources: dict[str, float]
    nodes: int
    started_here: bool
    # GCS address of the long-lived local head (modes local and local-multinode); empty for remote.
    gcs_address: str = ""
    dashboard_url: str = ""
    # cluster.network and the NCCL/UCX variables it sets in the training workers (infra.network)
    network: str = "tcp"
    network_env: dict[str, str] = {}
    # mode=remote with a job-server address: training is submitted as a Ray Job with these settings (infra.jobs)
    config: ClusterConfig = Field(default_factory=ClusterConfig)


def provision(cfg: ClusterConfig) -> ClusterInfo:
    """Start or connect to Ray per `cfg.mode`; this process becomes the driver.

    Raises:
        ClusterError: the remote address is empty or unreachable, or local nodes failed to start.
    """
    quiet_telemetry()
    import ray

    if ray.is_initialized():  # a retried task, or a caller that already connected
        return _describe(cfg.mode, started_here=False)
    if cfg.job_server:  # no driver here: training goes to the cluster as a Ray Job that outlives this process
        return _job_server(cfg)
    if cfg.mode == "remote":
        if not cfg.address:
            raise ClusterError("cluster.address is empty; mode=remote needs e.g. 'http://head:8265'")
        try:
            ray.init(address=cfg.address, log_to_driver=False, runtime_env=code_runtime_env())
        except Exception as e:  # noqa: BLE001 - Ray raises many types; the user needs the address and cause
            raise ClusterError(f"cannot reach Ray at cluster.address={cfg.address!r}: {e}") from None
        return _describe(cfg.mode, started_here=False)
    from infra.head import ensure_head

    head = ensure_head(cfg)
    use_token_auth()
    try:
        runtime_env = {"env_vars": _job_env(), **(code_runtime_env() if cfg.mode == "local-multinode" else {})}
        with driver_on_loopback(head.loopback):
            ray.init(address=head.gcs_address, log_to_driver=False, runtime_env=runtime_env)
        _wait_for_nodes(head.nodes)
    except Exception as e:  # noqa: BLE001 - whatever stops the join becomes one ClusterError line
        ray.shutdown()
        raise ClusterError(
            f"the local Ray head at {head.gcs_address} runs but the driver could not join: {e}"
        ) from None
    info = _describe(cfg.mode, started_here=False)
    info.gcs_address = head.gcs_address
    info.dashboard_url = head.dashboard_url
    return info


def _job_server(cfg: ClusterConfig) -> ClusterInfo:
    """The cluster behind a job server: checked reachable (with token auth), its nodes and resources listed."""
    from infra.jobs import job_client

    job_client(cfg.address)  # ClusterError when it does not answer
    resources: dict[str, float] = {}
    nodes = 0
    try:
        from ray.util.state import list_nodes

        for node in list_nodes(address=cfg.address, filters=[("state", "=", "ALIVE")]):
            nodes += 1
            for key, value in (node.resources_total or {}).items():
                if not key.startswith("node:"):
                    resources[key] = resources.get(key, 0.0) + float(value)
    except Exception:  # noqa: BLE001 - the listing is informational; the job server answered
        pass
    return ClusterInfo(
        address=cfg.address,
        mode=cfg.mode,
        resources=resources,
        nodes=nodes,
        started_here=False,
        dashboard_url=cfg.address,
        config=cfg,
    )


PACKAGES = ("flows", "tasks", "training", "deployments", "infra")


def code_runtime_env() -> dict:
    """The project's packages shipped to the job's workers as Ray `py_modules` (content-addressed uploads), for
    clusters whose nodes may not have shardline installed. Bytecode caches stay behind: they would change the
    upload's hash, and so every Serve replica's options, from run to run."""
    root = Path(__file__).resolve().parent.parent
    return {"py_modules": [str(root / p) for p in PACKAGES], "excludes": ["__pycache__", "*.pyc"]}


_secrets_file = ""  # this driver's worker-secrets file (infra.credentials), removed by teardown


def _job_env() -> dict[str, str]:
    """forwarded_env() for the job's runtime env, its secrets replaced by the path of a 0600 file holding them."""
    global _secrets_file
    from infra.credentials import WORKER_SECRETS_ENV, split_secrets, write_worker_secrets

    plain, secret = split_secrets(forwarded_env())
    if secret:
        _secrets_file = write_worker_secrets(secret)
        plain[WORKER_SECRETS_ENV] = _secrets_file
    return plain


def _wait_for_nodes(expected: int, timeout_s: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while sum(1 for n in ray.nodes() if n["Alive"]) < expected:
        if time.monotonic() > deadline:
            raise ClusterError(f"only {sum(1 for n in ray.nodes() if n['Alive'])} of {expected} Ray nodes came up")
        time.sleep(0.5)


def _describe(mode: str, started_here: bool) -> ClusterInfo:
    import ray

    ctx = ray.get_runtime_context()
    address = getattr(ctx, "gcs_address", "") or ""
    return ClusterInfo(
        address=address,
        mode=mode,
        resources={k: float(v) for k, v in ray.cluster_resources().items() if not k.startswith("node:")},
        nodes=sum(1 for n in ray.nodes() if n["Alive"]),
        started_here=started_here,
    )


def release_serve_handles() -> None:
    """Stop this driver's Serve handles and forget its Serve client; nothing on the cluster changes.

    Each handle's router pushes autoscaling metrics from a background thread. After `ray.shutdown()` that thread's
    next Ray call connects the process again (Ray's auto-init, to whatever cluster it finds), which races the
    driver's next `ray.init` ("called ray.init twice") or leaves it on the wrong cluster. Shutting the handles
    down first stops the threads; Serve is only imported when this process used it.
    """
    if "ray.serve" not in sys.modules:
        return
    from ray.serve import context

    client = context._global_client
    if client is not None:
        try:
            client.shutdown_cached_handles()
        except Exception as e:  # noqa: BLE001 - best effort on a teardown path: a dead controller, a closed loop
            logging.getLogger(__name__).debug("could not shut down Serve handles: %s", e)
        context._disconnect()


def teardown(info: ClusterInfo | None) -> None:
    """Disconnect this driver. The cluster and the Serve app on it keep running: the endpoint outlives the run.

    Safe to call twice and on failure paths. `shardline serve --stop` stops what shardline started.
    """
    global _secrets_file
    import ray

    release_serve_handles()
    if ray.is_initialized():
        ray.shutdown()
    if _secrets_file:
        Path(_secrets_file).unlink(missing_ok=True)
        _secrets_file = ""
