"""Network profiles: profile name -> NCCL/UCX environment of the training workers (infra/network.py)."""

from __future__ import annotations

import pytest

from infra.config import ClusterConfig
from infra.network import network_env


def test_tcp_is_the_default_and_turns_rdma_off():
    env = network_env(ClusterConfig().network)
    assert env["NCCL_IB_DISABLE"] == "1" and env["NCCL_NET"] == "Socket"
    assert env["UCX_TLS"] == "tcp,sm,self"
    assert not any(k.startswith("NCCL_IB_") and k != "NCCL_IB_DISABLE" for k in env)


def test_roce_sets_hca_and_gid_index():
    env = network_env("roce")
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_NET"] == "IB"
    assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_IB_GID_INDEX"] == "3" and env["UCX_IB_GID_INDEX"] == "3"
    assert env["NCCL_IB_TIMEOUT"] == "22"


def test_infiniband_has_no_gid_index():
    env = network_env("infiniband")
    assert env["NCCL_IB_DISABLE"] == "0" and env["UCX_TLS"] == "rc,ud,sm,self"
    assert "NCCL_IB_GID_INDEX" not in env


def test_overrides_set_and_remove_single_variables():
    env = network_env("roce", {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_DEBUG": ""})
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert "NCCL_DEBUG" not in env
    assert env["NCCL_IB_GID_INDEX"] == "3"  # untouched


def test_unknown_profile_is_rejected_by_config_and_function():
    with pytest.raises(ValueError, match="cluster.network='ethernet'"):
        network_env("ethernet")
    with pytest.raises(ValueError):
        ClusterConfig(network="ethernet")


def test_only_a_single_node_loopback_head_turns_rays_multi_node_switch_off():
    from infra.cluster import RAY_MULTI_NODE_SWITCH, is_loopback, node_env

    assert node_env(ClusterConfig()) == {RAY_MULTI_NODE_SWITCH: "0"}  # the embedded default: Ray reports 127.0.0.1
    assert node_env(ClusterConfig(host="::1")) == {RAY_MULTI_NODE_SWITCH: "0"}
    assert node_env(ClusterConfig(mode="local-multinode")) == {}  # `ray start --address` refuses with it off
    assert node_env(ClusterConfig(host="10.0.0.5")) == {}  # a configured LAN address stays Ray's business
    assert node_env(ClusterConfig(mode="remote", address="http://head:8265")) == {}
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "localhost", "::1", "0.0.0.0", "head")] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]
