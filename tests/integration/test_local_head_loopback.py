"""The embedded default stays on loopback for real: the local head infra.cluster starts (mode=local) reports
127.0.0.1 as its node address to Ray, its driver and its workers run there, and its processes listen on loopback
only. That local-multinode, which Ray cannot keep on loopback, still comes up with its worker node is asserted by
tests/integration/test_train_multinode.py on its cluster (starting one more costs ~40 s on 2 cores)."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from infra.config import ClusterConfig


def _listening(pids: list[int]) -> set[str]:
    """Addresses the TCP sockets of `pids` listen on."""
    found = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:  # gone meanwhile
            continue
        found |= {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


@pytest.fixture()
def local_head(tmp_path, monkeypatch):
    from infra.cluster import provision, teardown
    from infra.head import stop_head

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))  # the head's record lives there
    info = provision(ClusterConfig(num_cpus=1, object_store_mb=100))
    try:
        yield info
    finally:
        teardown(info)
        assert stop_head()


def test_the_local_head_reports_and_listens_on_loopback(local_head):
    import ray

    from infra.head import _descendants, read_head

    assert local_head.gcs_address.startswith("127.0.0.1:") and local_head.dashboard_url.startswith("http://127.0.0.1:")
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]  # Ray's own default would be the LAN address
    assert ray.util.get_node_ip_address() == "127.0.0.1"  # the driver

    @ray.remote(num_cpus=0)
    def node_ip() -> str:
        return ray.util.get_node_ip_address()

    assert ray.get(node_ip.remote()) == "127.0.0.1"  # a worker process of the node
    head = read_head()
    assert head is not None and head.loopback
    listening = _listening(_descendants(head.pids))
    assert listening and all(_loopback(a) for a in listening), listening
