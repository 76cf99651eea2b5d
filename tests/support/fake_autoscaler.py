"""Ray's fake multi-node autoscaling cluster on 127.0.0.1, started and stopped by PID.

This is the cluster `ray.cluster_utils.AutoscalingCluster` starts: a head run with `RAY_FAKE_CLUSTER=1` and an
autoscaling config whose provider is `fake_multinode`, so Ray's real autoscaler (monitor process) launches and
terminates worker nodes as processes on this machine, from the cluster's real resource demand. It is not that class
itself: AutoscalingCluster begins and ends with Ray's host-wide `ray stop --force`, which would stop every Ray on the
host (other test sessions', a user's head), and in the Ray 2.60 wheel it cannot build its config (the
`fake_multi_node/example.yaml` it reads is not packaged). So this writes the same config, starts the head on its own
port, and stops exactly the processes of that port and their descendants (the fake worker nodes are children of the
head's autoscaler monitor).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infra.cluster import free_port
from infra.head import _alive, _descendants, _forget_current_cluster, _kill, _node_processes

MB = 1024 * 1024


class FakeAutoscalingCluster:
    """A head that advertises `head_resources` plus worker node types Ray's autoscaler may add and remove.

    Args:
        head_resources: logical resources of the head ("CPU", custom names); the head node type of the config.
        worker_node_types: autoscaler node types ({name: {"resources", "min_workers", "max_workers"}}).
        idle_timeout_minutes: how long a worker node may sit idle before the autoscaler removes it (fractions work).
        object_store_mb: object store size of the head and of every worker node.
    """

    def __init__(
        self,
        head_resources: dict[str, float],
        worker_node_types: dict[str, dict],
        idle_timeout_minutes: float = 0.1,
        object_store_mb: int = 80,
    ) -> None:
        self.head_resources = dict(head_resources)
        self.port = free_port()
        self.gcs_address = f"127.0.0.1:{self.port}"
        self.object_store_mb = object_store_mb
        types = {
            name: {
                "node_config": {},
                **spec,
                "resources": {**spec["resources"], "object_store_memory": object_store_mb * MB},
            }
            for name, spec in worker_node_types.items()
        }
        types["ray.head.default"] = {"resources": self.head_resources, "node_config": {}, "max_workers": 0}
        self.config = {
            "cluster_name": f"shardline-fake-{self.port}",
            "max_workers": sum(spec.get("max_workers", 0) for spec in worker_node_types.values()),
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": self.gcs_address,
            },
            "available_node_types": types,
            "head_node_type": "ray.head.default",
            "idle_timeout_minutes": idle_timeout_minutes,
            "upscaling_speed": 1.0,
            "auth": {},
            "docker": {},
            "file_mounts": {},
            "cluster_synced_files": [],
            "rsync_exclude": [],
            "rsync_filter": [],
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts_sync_continuously": False,
        }
        self.pids: list[int] = []
        self._config_file = ""

    def start(self) -> None:
        """Start the head (token auth, no dashboard) and wait until its GCS answers; PIDs go to `self.pids`."""
        fd, self._config_file = tempfile.mkstemp(prefix="shardline-fake-autoscaler-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.config, f)
        ray = str(Path(sys.executable).with_name("ray"))
        env = {
            **os.environ,
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            # Ray's node-IP fallback asks the default route (a LAN address); with the multi-node switch off it
            # answers 127.0.0.1, so the nodes the autoscaler launches listen on loopback only, like the head.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
        subprocess.run([ray, "get-auth-token", "--generate"], env=env, capture_output=True, check=True, timeout=60)
        custom = {k: v for k, v in self.head_resources.items() if k not in ("CPU", "GPU")}
        cmd = [
            ray,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={self.port}",
            f"--autoscaling-config={self._config_file}",
            f"--num-cpus={int(self.head_resources.get('CPU', 0))}",
            f"--num-gpus={int(self.head_resources.get('GPU', 0))}",
            f"--resources={json.dumps(custom)}",
            f"--object-store-memory={self.object_store_mb * MB}",
            "--include-dashboard=false",
            # ports of their own: Ray's fixed defaults would collide with other heads on this host
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
        ]
        try:
            subprocess.run(
                cmd,
                env=env,
                capture_output=True,
                check=True,
                timeout=120,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        finally:
            self.pids = _node_processes(str(self.port))
            _forget_current_cluster(str(self.port))  # a later plain ray.init() must not join this cluster

    def raylets(self) -> dict[str, bool]:
        """{node id: is the head} of every running node of this cluster: one raylet process per node.

        Read from the processes themselves (/proc), so the test can watch the cluster without becoming a driver.
        """
        nodes = {}
        for pid in _node_processes(str(self.port)):
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if not args[0].endswith("/raylet") or not _alive(pid):
                continue
            node_id = next((a.split("=", 1)[1] for a in args if a.startswith("--node_id=")), "")
            nodes[node_id] = "--head" in args
        return nodes

    def listening_addresses(self) -> set[str]:
        """IP addresses the TCP sockets of this cluster's processes listen on (/proc/net/tcp and tcp6)."""
        inodes = set()
        for pid in set(_descendants(self.pids)) | set(_node_processes(str(self.port))):
            try:
                links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
            except OSError:  # gone meanwhile
                continue
            inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
        found = set()
        for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    raw = bytes.fromhex(fields[1].split(":")[0])  # 32-bit words in host (little-endian) order
                    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add(socket.inet_ntop(family, raw))
        return found

    def wait_for(self, predicate, timeout_s: float, poll_s: float = 1.0) -> bool:
        """Poll `predicate()` until true or `timeout_s` passes; returns its last value."""
        deadline = time.monotonic() + timeout_s
        while not (ok := bool(predicate())) and time.monotonic() < deadline:
            time.sleep(poll_s)
        return ok

    def shutdown(self) -> list[int]:
        """Stop the head and every node the autoscaler launched (recorded PIDs, their descendants, and any
        process naming this cluster's GCS port); returns the PIDs still alive afterwards (none, normally)."""
        pids = sorted(set(_descendants(self.pids)) | set(_node_processes(str(self.port))))
        _kill(pids)
        if self._config_file:
            Path(self._config_file).unlink(missing_ok=True)
        return [p for p in pids if _alive(p)]
