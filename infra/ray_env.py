"""Ray on this machine, below provisioning: the `ray` command, node addresses, token auth and what a job inherits.

infra.head (the long-lived local head) and infra.jobs (Ray Jobs) build on these; infra.cluster (provisioning)
builds on all three and re-exports these names for its callers.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from infra.config import ClusterConfig


class ClusterError(RuntimeError):
    """Ray could not be started or reached; the message says which address and why."""


def token_file(env: Mapping[str, str] = os.environ) -> Path:
    """The file Ray reads its auth token from when $RAY_AUTH_TOKEN is not set: $RAY_AUTH_TOKEN_PATH, else
    ~/.ray/auth_token (Ray's token-auth docs)."""
    return Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()


def has_token(path: Path, env: Mapping[str, str] = os.environ) -> bool:
    """True when Ray already has a token where its loader looks: a non-blank $RAY_AUTH_TOKEN, else a non-empty
    file at `path` (token_file)."""
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return True
    try:
        return bool(path.read_text().strip())
    except OSError:
        return False


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


def _run_ray(
    args: list[str], new_session: bool = False, extra_env: dict[str, str] | None = None, umask: int = -1
) -> None:
    # Token authentication on (Ray's default for new local clusters), stated explicitly so that a node joining
    # with `ray start --address` uses the same token file as the head instead of connecting unauthenticated.
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(extra_env or {})}
    if new_session:  # a long-lived node outlives this run: it gets none of this run's secrets (infra.credentials)
        from infra.credentials import split_secrets

        plain, secret = split_secrets(env)
        env = {**plain, **{k: v for k, v in secret.items() if k.startswith("RAY_")}}  # Ray's own auth stays
    env.setdefault("RAY_AUTH_MODE", "token")
    proc = subprocess.run(
        [ray_cli(), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        start_new_session=new_session,
        stdin=subprocess.DEVNULL,
        umask=umask,  # -1: this process's
    )
    if proc.returncode != 0:
        # stderr only: stdout of `ray get-auth-token` is the token itself
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise ClusterError(f"`ray {' '.join(args[:2])}` failed: {tail[0]}")


# What a run's job on the long-lived local head needs from the driver's environment: the head's own processes were
# started by an earlier run and have that run's environment, not this one's.
_FORWARDED = (
    "AWS_",
    "AZURE_",
    "SHARDLINE_",
    "MLFLOW_",
    "PREFECT_API_",
    "PYTHONPATH",
    "OMP_NUM_THREADS",
    "NCCL_",
    "GLOO_",
    "TORCH_",
)


def forwarded_env() -> dict[str, str]:
    """The driver's storage, tracking and framework settings (credentials included) for its Ray job's workers.

    Plain settings travel in the job's runtime env, secrets in a 0600 file (infra.credentials), on this machine's
    own head; a remote cluster gets none of them (its nodes have their own identity).
    """
    return {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED)}


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
