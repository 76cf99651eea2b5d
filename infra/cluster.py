"""Ray cluster provisioning: start Ray on this machine (one or several nodes) or connect to a running cluster."""
from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from infra.config import ClusterConfig
from infra.paths import quiet_telemetry


class ClusterError(RuntimeError):
    """Ray could not be started or reached; the message says which address and why."""


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


# Ray (2.60, services.resolve_ip_for_localhost) replaces a loopback node address, given as --node-ip-address,
# _node_ip_address or the host of a GCS address, by the address of the default route: a head started on 127.0.0.1
# reports the LAN address for its node, and its drivers and workers dial that. With its multi-node switch off Ray
# answers 127.0.0.1 instead; the switch off also makes `ray start --address` refuse, so only a single-node head
# (mode=local) is kept on loopback. local-multinode and remote keep Ray's own choice.
RAY_MULTI_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach: 127.0.0.0/8, ::1 or localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_node(cfg: ClusterConfig) -> bool:
    """True when the local head is a single node on a loopback `cfg.host`: Ray must then report that address."""
    return cfg.mode == "local" and is_loopback(cfg.host)


def node_env(cfg: ClusterConfig) -> dict[str, str]:
    """Environment of the `ray start` that starts the local head, so that Ray reports `cfg.host` for its node."""
    return {RAY_MULTI_NODE_SWITCH: "0"} if loopback_node(cfg) else {}


@contextmanager
def driver_on_loopback(on: bool) -> Iterator[None]:
    """While `on`, this process's `ray.init` dials a loopback GCS address as given and takes the node's loopback
    address, as the head started with node_env does; Ray reads the switch once, at import, so it is set on the
    imported module for the call and put back after."""
    from ray._private import ray_constants

    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if not on or before is None:  # another Ray without the switch: its own behaviour
        yield
        return
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _run_ray(args: list[str], new_session: bool = False, extra_env: dict[str, str] | None = None) -> None:
    # Token authentication on (Ray's default for new local clusters), stated explicitly so that a node joining
    # with `ray start --address` uses the same token file as the head instead of connecting unauthenticated.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(extra_env or {})}
    if new_session:  # a long-lived node outlives this run: it gets none of this run's secrets (infra.credentials)
        from infra.credentials import split_secrets

        plain, secret = split_secrets(env)
        env = {**plain, **{k: v for k, v in secret.items() if k.startswith("RAY_")}}  # Ray's own auth stays
    env.setdefault("RAY_AUTH_MODE", "token")
    proc = subprocess.run([ray_cli(), *args], capture_output=True, text=True, env=env, timeout=180,
                          start_new_session=new_session, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        # stderr only: stdout of `ray get-auth-token` is the token itself
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise ClusterError(f"`ray {' '.join(args[:2])}` failed: {tail[0]}")


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
    except Exception as e:  # noqa: BLE001
        ray.shutdown()
        raise ClusterError(f"the local Ray head at {head.gcs_address} runs but the driver could not join: {e}") from None
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
    return ClusterInfo(address=cfg.address, mode=cfg.mode, resources=resources, nodes=nodes, started_here=False,
                       dashboard_url=cfg.address, config=cfg)


# What a run's job on the long-lived local head needs from the driver's environment: the head's own processes were
# started by an earlier run and have that run's environment, not this one's.
_FORWARDED = ("AWS_", "AZURE_", "SHARDLINE_", "MLFLOW_", "PREFECT_API_", "PYTHONPATH", "OMP_NUM_THREADS",
              "NCCL_", "GLOO_", "TORCH_")


PACKAGES = ("flows", "tasks", "training", "deployments", "infra")


def code_runtime_env() -> dict:
    """The project's packages shipped to the job's workers as Ray `py_modules` (content-addressed uploads), for
    clusters whose nodes may not have shardline installed. Bytecode caches stay behind: they would change the
    upload's hash, and so every Serve replica's options, from run to run."""
    root = Path(__file__).resolve().parent.parent
    return {"py_modules": [str(root / p) for p in PACKAGES], "excludes": ["__pycache__", "*.pyc"]}


def forwarded_env() -> dict[str, str]:
    """The driver's storage, tracking and framework settings (credentials included) for its Ray job's workers.

    Plain settings travel in the job's runtime env, secrets in a 0600 file (infra.credentials), on this machine's
    own head; a remote cluster gets none of them (its nodes have their own identity).
    """
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED)}


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


def use_token_auth() -> None:
    """Authenticate this driver with the token file the nodes were started with.

    ray.init(address=...) with an explicit address does not turn token auth on by itself (Ray 2.60), and setting
    RAY_AUTH_MODE after `import ray` is not seen by Ray's cached config; Ray's own helper sets both.
    """
    if os.environ.get("RAY_AUTH_MODE"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray version: no token auth, or it handles this itself
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


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


def teardown(info: ClusterInfo | None) -> None:
    """Disconnect this driver. The cluster and the Serve app on it keep running: the endpoint outlives the run.

    Safe to call twice and on failure paths. `shardline serve --stop` stops what shardline started.
    """
    global _secrets_file
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if _secrets_file:
        Path(_secrets_file).unlink(missing_ok=True)
        _secrets_file = ""
