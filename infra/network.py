"""Network profiles: the NCCL/UCX environment training workers get for the fabric between their nodes."""

from __future__ import annotations

from typing import Literal

Network = Literal["tcp", "roce", "infiniband"]

# Settings every profile shares: collectives that hang fail with an error instead (Ray sets this too, but only
# when nothing else did), and NCCL says what it chose without flooding the logs.
_COMMON = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN"}

# tcp: sockets only, safe on any machine (a laptop, a VM without RDMA NICs, a container without /dev/infiniband).
# NCCL_NET=Socket stops NCCL from loading an RDMA net plugin it may find; the socket interface is left to NCCL's
# own choice (it skips lo and docker* when anything else exists), set NCCL_SOCKET_IFNAME to pin it.
_TCP = {"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "UCX_TLS": "tcp,sm,self"}

# RDMA profiles. NCCL_IB_TIMEOUT 22 (about 17 s per retry instead of ~4 s) and 7 retries: large jobs on a busy
# fabric otherwise abort on a transient stall. NCCL_IB_HCA=mlx5 takes every Mellanox/NVIDIA port (prefix match).
_RDMA = {
    "NCCL_IB_DISABLE": "0",
    "NCCL_NET": "IB",
    "NCCL_IB_HCA": "mlx5",
    "NCCL_IB_TIMEOUT": "22",
    "NCCL_IB_RETRY_CNT": "7",
}

# roce: RDMA over Ethernet needs the GID of RoCE v2 on IPv4, which is index 3 on the usual mlx5 set-up
# (0/1 are RoCE v1/v2 link-local IPv6, 2/3 v1/v2 IPv4); UCX is told the same.
_ROCE = {**_RDMA, "NCCL_IB_GID_INDEX": "3", "UCX_IB_GID_INDEX": "3", "UCX_TLS": "rc,ud,sm,self"}

# infiniband: native IB addresses ports by LID, no GID index; UCX uses reliable connections over it.
_INFINIBAND = {**_RDMA, "UCX_TLS": "rc,ud,sm,self"}

PROFILES: dict[str, dict[str, str]] = {"tcp": _TCP, "roce": _ROCE, "infiniband": _INFINIBAND}


def network_env(profile: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables of a network profile with `overrides` applied (an empty value removes one).

    Raises:
        ValueError: `profile` is not one of PROFILES.
    """
    if profile not in PROFILES:
        raise ValueError(f"cluster.network={profile!r}: expected one of {', '.join(PROFILES)}")
    env = {**_COMMON, **PROFILES[profile]}
    for key, value in (overrides or {}).items():
        if value == "":
            env.pop(key, None)
        else:
            env[key] = value
    return dict(sorted(env.items()))
