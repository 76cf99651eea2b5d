"""Multi-node for real: a Ray head and a worker node started as separate processes (`ray start`) on 127.0.0.1;
the training stage places one worker on each node and still checkpoints and resumes as one run."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from train_support import RECORD_DIR_ENV, ray_runtime_env, shard_set, worker_records
from training import checkpoint as ck
from training.config import TrainConfig

CFG = TrainConfig(workers=2, steps=12, checkpoint_every=6, log_every=3, seq_len=32, n_layer=2, n_head=2, d_model=32,
                  micro_batch=8, warmup_steps=2, model_factory="train_support:recording_gpt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _processes_of(temp_dir: str) -> list[int]:
    """Pids of the Ray daemons whose command line names our temp dir, and all their descendants."""
    parent: dict[int, int] = {}
    roots = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        if temp_dir in cmd:
            roots.append(int(entry.name))
    found, frontier = set(roots), list(roots)
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found.add(child)
                frontier.append(child)
    return sorted(found)


@pytest.fixture()
def two_node_cluster(tmp_path, monkeypatch):
    """Head (1 CPU) and worker (1 CPU) as separate `ray start` processes; stopped by pid afterwards (not `ray stop`,
    which would end every Ray process on the machine)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rmn", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    records = tmp_path / "workers"
    records.mkdir()
    # Ray 2.60 enables token authentication on a head; every node and the driver need the same token.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    gcs = f"127.0.0.1:{_free_port()}"
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=100000000", "--disable-usage-stats"]
    try:
        _ray("start", "--head", f"--port={gcs.split(':')[1]}", "--include-dashboard=false", f"--temp-dir={temp_dir}",
             *common, env=env)
        _ray("start", f"--address={gcs}", *common, env=env)
        from ray._raylet import Config

        Config.initialize("")  # Ray caches RAY_AUTH_MODE at import; make this driver see token mode
        ray.init(address=gcs, log_to_driver=False, runtime_env=ray_runtime_env(**{RECORD_DIR_ENV: str(records)}))
        deadline = time.monotonic() + 60
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline, "the worker node did not join"
            time.sleep(0.5)
        yield records
    finally:
        ray.shutdown()
        pids = _processes_of(temp_dir)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(2)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_workers_are_placed_on_both_nodes(two_node_cluster, tmp_path, monkeypatch):
    import ray

    from training.trainer import run_training

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    result = run_training(CFG, shard_set(tmp_path / "shards"), "", "", "two-nodes")

    placed = {r["rank"]: r["node_id"] for r in worker_records(two_node_cluster)}
    assert sorted(placed) == [0, 1]
    assert placed[0] != placed[1] and set(placed.values()) == nodes
    assert result.step == 12 and result.world_size == 2
    info = ck.verify_checkpoint(result.checkpoint_uri)
    assert (info.step, info.world_size) == (12, 2)
