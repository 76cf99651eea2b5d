"""The long-lived local Ray head of the embedded default: started detached once, reused by every later run.

`ensure_head` starts `ray start --head` on 127.0.0.1 (token auth, dashboard on 127.0.0.1, and for mode=local the
node address Ray reports too: infra.cluster.node_env) in its own session, so a killed `shardline run` does not take
the served model down with it, and records the head's address and PIDs in `$SHARDLINE_HOME/ray/head.json`.
`stop_head` signals exactly those processes (and their descendants), never Ray's host-wide stop command, which
would stop every Ray on the host; a recorded PID counts only while its start time is the recorded one
(infra.process), so a PID reused after the head died is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Collection
from pathlib import Path

from pydantic import BaseModel, Field

from infra import process
from infra.config import ClusterConfig
from infra.paths import shardline_home
from infra.ray_env import ClusterError, _run_ray, free_port, has_token, loopback_node, node_env, token_file


class HeadInfo(BaseModel):
    """A Ray head shardline started (and its worker nodes, for local-multinode): where it listens, its PIDs."""

    gcs_address: str
    dashboard_url: str
    pids: list[int]
    # start times (clock ticks since boot) of `pids`, in the same order; empty in records of older versions
    start_ticks: list[int] = Field(default_factory=list)
    host: str
    num_cpus: int
    worker_nodes: int = 0
    started_at: float
    # Ray reports `host` (loopback) for the node: drivers must dial it so (infra.cluster.driver_on_loopback). False in
    # records of older versions, whose heads report the LAN address.
    loopback: bool = False

    @property
    def nodes(self) -> int:
        return 1 + self.worker_nodes


def _alive(pid: int) -> bool:
    return process.inspect(pid) is not None


def _node_processes(gcs_port: str) -> list[int]:
    """PIDs of the Ray processes whose command line names GCS port `gcs_port` (head and joined nodes)."""
    marks = (f"--gcs_server_port={gcs_port}", f":{gcs_port}")
    found = [
        p.pid
        for p in process.processes()
        if any(
            a.startswith(("--gcs-address=", "--address=", "--gcs_server_port=")) and a.endswith(marks)
            for a in p.cmdline
        )
    ]
    return _descendants(found)


def _recorded_alive(info: HeadInfo) -> list[int]:
    """The recorded PIDs that are still the head's processes: same start time or, in a record written before start
    times were kept, a Ray process of this head's GCS port (or below one)."""
    if info.start_ticks:
        return [pid for pid, ticks in zip(info.pids, info.start_ticks, strict=False) if process.is_same(pid, ticks)]
    ours = set(_node_processes(info.gcs_address.rsplit(":", 1)[-1]))
    return [pid for pid in info.pids if pid in ours]


def _forget_current_cluster(port: str) -> None:
    """`ray start --head` records its address for later `ray.init()` calls; drop the record when it is ours."""
    record = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    try:
        if record.read_text().strip().endswith(f":{port}"):
            record.unlink()
    except OSError:
        pass


def _record() -> Path:
    return shardline_home() / "ray" / "head.json"


def _answers(address: str, timeout_s: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def read_head() -> HeadInfo | None:
    """The recorded head when it is still alive and its GCS answers; None otherwise (a stale record is removed)."""
    path = _record()
    try:
        info = HeadInfo.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None
    if _recorded_alive(info) and _answers(info.gcs_address):
        return info
    path.unlink(missing_ok=True)
    return None


def ensure_head(cfg: ClusterConfig) -> HeadInfo:
    """The running head of this $SHARDLINE_HOME, started now if there is none.

    Raises:
        ClusterError: `ray start` failed (the message names the command and Ray's last line).
    """
    found = read_head()
    if found is not None:  # reused as it is, also when cfg asks for another size: `shardline serve --stop` first
        return found
    port, dash_port = free_port(cfg.host), free_port(cfg.host)
    gcs = f"{cfg.host}:{port}"
    token = token_file()
    if not has_token(token):  # a fresh machine has none yet; the `ray` process costs 1.8 s, its output is dropped
        _run_ray(["get-auth-token", "--generate"], umask=0o077)  # the token file is never readable by others
    _owner_only(token)
    args = [
        "start",
        "--head",
        f"--node-ip-address={cfg.host}",
        f"--port={port}",
        f"--num-cpus={cfg.num_cpus}",
        f"--num-gpus={cfg.num_gpus}",
        "--include-dashboard=true",
        f"--dashboard-host={cfg.host}",
        f"--dashboard-port={dash_port}",
        "--disable-usage-stats",
        f"--object-store-memory={cfg.object_store_mb * 1024 * 1024}",
    ]
    workers = cfg.worker_nodes if cfg.mode == "local-multinode" else 0
    try:
        # its own session: a SIGKILLed process group of the run spares it
        _run_ray(args, new_session=True, extra_env=node_env(cfg))
        deadline = time.monotonic() + 60
        while not _answers(gcs):
            if time.monotonic() > deadline:
                raise ClusterError(f"Ray head at {gcs} did not answer within 60 s")
            time.sleep(0.3)
        for _ in range(workers):
            _run_ray(
                [
                    "start",
                    f"--address={gcs}",
                    f"--node-ip-address={cfg.host}",
                    f"--num-cpus={cfg.cpus_per_worker_node}",
                    "--num-gpus=0",
                    "--disable-usage-stats",
                    f"--object-store-memory={cfg.object_store_mb * 1024 * 1024}",
                ],
                new_session=True,
            )
    except ClusterError:
        _kill(_node_processes(str(port)))
        _forget_current_cluster(str(port))
        raise
    _forget_current_cluster(str(port))  # later plain ray.init() calls must not silently join our head
    procs = [p for pid in _node_processes(str(port)) if (p := process.inspect(pid)) is not None]
    info = HeadInfo(
        gcs_address=gcs,
        dashboard_url=f"http://{cfg.host}:{dash_port}",
        pids=[p.pid for p in procs],
        start_ticks=[p.start_ticks for p in procs],
        host=cfg.host,
        num_cpus=cfg.num_cpus,
        worker_nodes=workers,
        started_at=time.time(),
        loopback=loopback_node(cfg),
    )
    path = _record()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(info.model_dump_json(indent=1))
    os.replace(tmp, path)
    return info


def _descendants(pids: list[int]) -> list[int]:
    """`pids` and every live process below them (workers the raylet forked after the record was written)."""
    return process.descendants(pids)


# Measured on Ray 2.60 (`shardline down` of a local head): its Python processes and workers exit within 0.3 s of
# SIGTERM, the raylet takes ~10 s to drain, and the GCS server and the autoscaler monitor do not exit at all. The
# whole head goes (only the PIDs this home recorded), so what is left after a short grace gets SIGKILL.
STOP_GRACE_S = 2.0


def _kill(pids: list[int]) -> None:
    process.terminate(pids, wait_s=STOP_GRACE_S)


def stop_head(owned: Collection[int] | None = None) -> bool:
    """Stop the head this $SHARDLINE_HOME recorded (its recorded PIDs and their children); False if none ran.

    With `owned` (PIDs the caller knows it started), only when one of them is still a live process of the recorded
    head: a head started later by another command, after the caller's died, is left running and recorded.
    """
    path = _record()
    try:
        info = HeadInfo.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return False
    alive = _recorded_alive(info)
    if owned is not None and not set(owned) & set(alive):
        return False
    _kill(_descendants(alive))
    _forget_current_cluster(info.gcs_address.rsplit(":", 1)[-1])
    path.unlink(missing_ok=True)
    return True


def head_status() -> dict:
    """{"up", "gcs_address", "dashboard_url", "pids"} of this $SHARDLINE_HOME's head, for `shardline status`."""
    info = read_head()
    if info is None:
        return {"up": False, "gcs_address": "", "dashboard_url": "", "pids": []}
    return {"up": True, **json.loads(info.model_dump_json(include={"gcs_address", "dashboard_url", "pids"}))}


def _owner_only(token_file: Path) -> None:
    """Ray writes its token file with the default umask (0644 here): anyone on the host could then read the
    credential of the cluster's gRPC and dashboard. Its owner only, as for shardline's own secrets."""
    with contextlib.suppress(OSError):
        if token_file.exists():
            token_file.chmod(0o600)
