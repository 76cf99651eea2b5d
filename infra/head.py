"""The long-lived local Ray head of the embedded default: started detached once, reused by every later run.

`ensure_head` starts `ray start --head` on 127.0.0.1 (token auth, dashboard on 127.0.0.1) in its own session, so a
killed `shardline run` does not take the served model down with it, and records the head's address and PIDs in
`$SHARDLINE_HOME/ray/head.json`. `stop_head` signals exactly those PIDs (and their descendants), never Ray's host-wide stop command,
which would stop every Ray on the host.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from pydantic import BaseModel

from infra.cluster import ClusterError, _run_ray, free_port
from infra.config import ClusterConfig
from infra.paths import shardline_home


class HeadInfo(BaseModel):
    """A Ray head shardline started (and its worker nodes, for local-multinode): where it listens, its PIDs."""

    gcs_address: str
    dashboard_url: str
    pids: list[int]
    host: str
    num_cpus: int
    worker_nodes: int = 0
    started_at: float

    @property
    def nodes(self) -> int:
        return 1 + self.worker_nodes


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _node_processes(gcs_port: str) -> list[int]:
    """PIDs of the Ray processes whose command line names GCS port `gcs_port` (head and joined nodes)."""
    marks = (f"--gcs_server_port={gcs_port}", f":{gcs_port}")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a.startswith(("--gcs-address=", "--address=", "--gcs_server_port=")) and a.endswith(marks)
               for a in args):
            found.append(int(entry.name))
    return _descendants(found)


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
    if any(_alive(pid) for pid in info.pids) and _answers(info.gcs_address):
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
    _run_ray(["get-auth-token", "--generate"])  # a fresh machine has no token file yet; output is dropped
    args = [
        "start", "--head", f"--node-ip-address={cfg.host}", f"--port={port}", f"--num-cpus={cfg.num_cpus}",
        f"--num-gpus={cfg.num_gpus}", "--include-dashboard=true", f"--dashboard-host={cfg.host}",
        f"--dashboard-port={dash_port}", "--disable-usage-stats",
        f"--object-store-memory={cfg.object_store_mb * 1024 * 1024}",
    ]
    workers = cfg.worker_nodes if cfg.mode == "local-multinode" else 0
    try:
        _run_ray(args, new_session=True)  # its own session: a SIGKILLed process group of the run spares it
        deadline = time.monotonic() + 60
        while not _answers(gcs):
            if time.monotonic() > deadline:
                raise ClusterError(f"Ray head at {gcs} did not answer within 60 s")
            time.sleep(0.3)
        for _ in range(workers):
            _run_ray(["start", f"--address={gcs}", f"--node-ip-address={cfg.host}",
                      f"--num-cpus={cfg.cpus_per_worker_node}", "--num-gpus=0", "--disable-usage-stats",
                      f"--object-store-memory={cfg.object_store_mb * 1024 * 1024}"], new_session=True)
    except ClusterError:
        _kill(_node_processes(str(port)))
        _forget_current_cluster(str(port))
        raise
    _forget_current_cluster(str(port))  # later plain ray.init() calls must not silently join our head
    info = HeadInfo(gcs_address=gcs, dashboard_url=f"http://{cfg.host}:{dash_port}", pids=_node_processes(str(port)),
                    host=cfg.host, num_cpus=cfg.num_cpus, worker_nodes=workers, started_at=time.time())
    path = _record()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(info.model_dump_json(indent=1))
    os.replace(tmp, path)
    return info


def _descendants(pids: list[int]) -> list[int]:
    """`pids` and every live process below them (workers the raylet forked after the record was written)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    members = {p for p in pids if p in parents}
    grew = True
    while grew:
        extra = {pid for pid, ppid in parents.items() if ppid in members and pid not in members}
        members |= extra
        grew = bool(extra)
    members.discard(os.getpid())
    return sorted(members)


def _kill(pids: list[int]) -> None:
    from infra.orphans import terminate

    terminate(pids, _alive, wait_s=10.0)


def stop_head() -> bool:
    """Stop the head this $SHARDLINE_HOME recorded (its recorded PIDs and their children); False if none ran."""
    path = _record()
    try:
        info = HeadInfo.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return False
    _kill(_descendants(info.pids))
    _forget_current_cluster(info.gcs_address.rsplit(":", 1)[-1])
    path.unlink(missing_ok=True)
    return True


def head_status() -> dict:
    """{"up", "gcs_address", "dashboard_url", "pids"} of this $SHARDLINE_HOME's head, for `shardline status`."""
    info = read_head()
    if info is None:
        return {"up": False, "gcs_address": "", "dashboard_url": "", "pids": []}
    return {"up": True, **json.loads(info.model_dump_json(include={"gcs_address", "dashboard_url", "pids"}))}
