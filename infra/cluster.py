"""Ray cluster provisioning: start Ray on this machine (one or several nodes) or connect to a running cluster."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from infra.config import ClusterConfig
from infra.paths import quiet_telemetry


class ClusterError(RuntimeError):
    """Ray could not be started or reached; the message says which address and why."""


class ClusterInfo(BaseModel):
    """The Ray cluster a pipeline run uses, and whether this run owns it (and must stop it)."""

    address: str
    mode: str
    resources: dict[str, float]
    nodes: int
    started_here: bool
    # GCS address of nodes started as separate processes (mode=local-multinode), for `ray stop`.
    gcs_address: str = ""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _run_ray(args: list[str]) -> None:
    # Token authentication on (Ray's default for new local clusters), stated explicitly so that a node joining
    # with `ray start --address` uses the same token file as the head instead of connecting unauthenticated.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.setdefault("RAY_AUTH_MODE", "token")
    proc = subprocess.run([_ray_cli(), *args], capture_output=True, text=True, env=env, timeout=180)
    if proc.returncode != 0:
        # stderr only: stdout of `ray get-auth-token` is the token itself
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise ClusterError(f"`ray {' '.join(args[:2])}` failed: {tail[0]}")


def start_local_nodes(cfg: ClusterConfig) -> str:
    """Start a head and `cfg.worker_nodes` worker nodes as separate processes; return the GCS address."""
    port = free_port(cfg.host)
    gcs = f"{cfg.host}:{port}"
    common = ["--disable-usage-stats", f"--object-store-memory={cfg.object_store_mb * 1024 * 1024}"]
    try:
        _start_nodes(cfg, port, gcs, common)
    except ClusterError:
        stop_local_nodes(gcs)  # nothing half-started is left behind
        raise
    return gcs


def _start_nodes(cfg: ClusterConfig, port: int, gcs: str, common: list[str]) -> None:
    # A fresh machine has no ~/.ray/auth_token yet and `ray start --head` will not make one; this creates it only
    # when missing. It prints the token, which _run_ray captures and drops.
    _run_ray(["get-auth-token", "--generate"])
    _run_ray(
        ["start", "--head", f"--node-ip-address={cfg.host}", f"--port={port}", f"--num-cpus={cfg.num_cpus}",
         f"--num-gpus={cfg.num_gpus}", "--include-dashboard=false", *common]
    )
    for _ in range(cfg.worker_nodes):
        _run_ray(
            ["start", f"--address={gcs}", f"--node-ip-address={cfg.host}",
             f"--num-cpus={cfg.cpus_per_worker_node}", "--num-gpus=0", *common]
        )


def _node_processes(gcs_port: str) -> list[int]:
    """PIDs of the Ray processes of the cluster whose GCS listens on `gcs_port`, and their children (Linux /proc)."""
    marks = (f"--gcs_server_port={gcs_port}", f":{gcs_port}")
    parents: dict[int, int] = {}
    members: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if any(a.startswith(("--gcs-address=", "--address=", "--gcs_server_port=")) and a.endswith(marks) for a in args):
            members.add(int(entry.name))
    grew = True
    while grew:  # add children (dashboard/runtime-env agents, workers) of what we found
        extra = {pid for pid, ppid in parents.items() if ppid in members and pid not in members}
        members |= extra
        grew = bool(extra)
    members.discard(os.getpid())
    return sorted(members)


def stop_local_nodes(gcs_address: str) -> None:
    """Stop the Ray nodes `start_local_nodes` started, and only those: `ray stop` would stop every Ray on the host."""
    import signal

    port = gcs_address.rsplit(":", 1)[-1]
    _forget_current_cluster(port)
    pids = _node_processes(port)
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists() and _alive(p)]
            time.sleep(0.2)
        if not pids:
            return


def _forget_current_cluster(port: str) -> None:
    """`ray start --head` records its address for later `ray.init()` calls; drop the record when it is ours."""
    record = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    try:
        if record.read_text().strip().endswith(f":{port}"):
            record.unlink()
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def provision(cfg: ClusterConfig) -> ClusterInfo:
    """Start or connect to Ray per `cfg.mode`; this process becomes the driver.

    Raises:
        ClusterError: the remote address is empty or unreachable, or local nodes failed to start.
    """
    quiet_telemetry()
    import ray

    if ray.is_initialized():  # a retried task, or a caller that already connected
        return _describe(cfg.mode, started_here=False)
    gcs = ""
    if cfg.mode == "remote":
        if not cfg.address:
            raise ClusterError("cluster.address is empty; mode=remote needs e.g. 'ray://head:10001'")
        try:
            ray.init(address=cfg.address, log_to_driver=False)
        except Exception as e:  # noqa: BLE001 - Ray raises many types; the user needs the address and cause
            raise ClusterError(f"cannot reach Ray at cluster.address={cfg.address!r}: {e}") from None
        return _describe(cfg.mode, started_here=False)
    if cfg.mode == "local-multinode":
        gcs = start_local_nodes(cfg)
        _use_token_auth()
        try:
            ray.init(address=gcs, log_to_driver=False)
            _wait_for_nodes(1 + cfg.worker_nodes)
        except Exception as e:
            ray.shutdown()
            stop_local_nodes(gcs)
            raise ClusterError(f"local Ray nodes at {gcs} started but the driver could not join: {e}") from None
    else:
        ray.init(
            address="local",  # always a new cluster, never one a `ray start` left running on this host
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            include_dashboard=False,
            object_store_memory=cfg.object_store_mb * 1024 * 1024,
            _node_ip_address=cfg.host,
            log_to_driver=False,
        )
    info = _describe(cfg.mode, started_here=True)
    info.gcs_address = gcs
    return info


def _use_token_auth() -> None:
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
    """Disconnect; stop the cluster if this run started it. Safe to call twice and on failure paths."""
    import ray

    if ray.is_initialized():
        try:
            from ray import serve

            if info is not None and info.started_here:
                serve.shutdown()
        except Exception:  # noqa: BLE001 - Serve was never started, or already gone
            pass
        ray.shutdown()
    if info is not None and info.started_here and info.gcs_address:
        stop_local_nodes(info.gcs_address)
