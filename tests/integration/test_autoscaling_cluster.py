"""Autoscaling for real, on this machine: Ray's fake multi-node provider (the one behind
ray.cluster_utils.AutoscalingCluster) runs Ray's real autoscaler, which launches and removes worker nodes as local
processes. The cluster starts as a head alone; the training stage's demand for workers that only the worker node
type can host makes the autoscaler add nodes, training runs on them (the run's lineage names them), and the idle
nodes are removed afterwards."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
from support.fake_autoscaler import FakeAutoscalingCluster

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRAINER = {"trainer": 1}  # the resource only the worker node type advertises: training cannot fit on the head


@pytest.fixture
def cluster():
    c = FakeAutoscalingCluster(
        head_resources={"CPU": 1},  # room for Ray Train's controller, none for a training worker
        worker_node_types={
            "ray.worker.train": {"resources": {"CPU": 1, **TRAINER}, "min_workers": 0, "max_workers": 2}
        },
        # idle nodes go after 30 s: long enough that the driver still sees them right after training on a slow,
        # shared 2-core machine (6 s was not: the nodes were gone before it looked), short enough for the test
        idle_timeout_minutes=0.5,
        object_store_mb=80,
    )
    try:
        c.start()
        yield c
    finally:
        assert c.shutdown() == [], "processes of the fake cluster survived its shutdown"


def _watch(
    cluster: FakeAutoscalingCluster, stop: threading.Event, seen: dict[str, bool], peak: list[int], listening: set[str]
) -> None:
    while not stop.is_set():
        nodes = cluster.raylets()
        seen.update(nodes)
        if len(nodes) > peak[0]:  # the cluster at its largest: where do its processes listen?
            listening |= cluster.listening_addresses()
        peak[0] = max(peak[0], len(nodes))
        time.sleep(0.5)


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


@pytest.mark.slow
def test_training_demand_scales_the_cluster_up_and_idle_nodes_are_removed(cluster, tmp_path):
    from mlflow import MlflowClient

    from training.checkpoint import verify_checkpoint
    from training.placement import TAG_TRAIN_NODE_IDS

    before = cluster.raylets()
    assert len(before) == 1 and list(before.values()) == [True], before  # a head alone
    head_id = next(iter(before))

    train = tomllib.loads((ROOT / "configs" / "debug.toml").read_text())["train"]
    train.update(
        init_from="",
        resources_per_worker={"CPU": 1, **TRAINER},
        placement_timeout_s=120,
        storage_path=str(tmp_path / "checkpoints"),
    )  # the nodes share this machine's disk
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = {"address": cluster.gcs_address, "tracking_uri": uri, "shards": str(tmp_path / "shards"), "train": train}
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token",
        "SHARDLINE_HOME": str(tmp_path / "home"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
        # as the CLI sets it (flows/cli/_utilities.py): Prefect's 20 s default timed out beside three Ray nodes
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    env.pop("PREFECT_API_URL", None)  # its own temporary Prefect server

    stop, seen, peak, listening = threading.Event(), {}, [0], set()
    watcher = threading.Thread(target=_watch, args=(cluster, stop, seen, peak, listening), daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "support" / "autoscaling_driver.py"), json.dumps(args)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop.set()
        watcher.join()
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    # provisioning connected to a cluster of one node: the head
    assert out["cluster_nodes"] == 1 and out["nodes_at_start"] == [head_id]
    # the training demand added worker nodes (Ray's autoscaler launched them; they were not there before)
    added = sorted(n for n, is_head in seen.items() if not is_head)
    assert len(added) == 2 and peak[0] == 3, (seen, peak)
    assert set(out["nodes_after_training"]) == {head_id, *added}
    # every node, the launched ones too, listens on loopback only
    assert listening and all(_loopback(a) for a in listening), listening
    # training finished on those nodes, with a complete checkpoint, and its lineage names them
    trained = out["trained"]
    assert trained["step"] == train["steps"] and trained["world_size"] == train["workers"]
    verify_checkpoint(trained["checkpoint_uri"])
    run = MlflowClient(uri).get_run(trained["train_run_id"])
    assert sorted(run.data.tags[TAG_TRAIN_NODE_IDS].split(",")) == added  # one worker per added node, none on the head
    assert run.data.metrics["train_nodes"] == 2.0
    assert run.data.params["train.resources_per_worker"] == str({"CPU": 1.0, "trainer": 1.0})
    # idle, the added nodes are removed: the cluster is the head alone again
    assert cluster.wait_for(lambda: list(cluster.raylets()) == [head_id], timeout_s=90), cluster.raylets()


@pytest.mark.timeout(240)
def test_a_demand_no_node_can_meet_fails_after_the_placement_timeout_naming_it(tmp_path):
    """Without an autoscaler that could add `trainer` nodes, the bounded wait ends in one clear error (Ray Train alone
    would retry the start forever)."""
    import ray
    from support.train_support import shard_set

    from training.config import TrainConfig
    from training.trainer import PlacementTimeout, run_training

    cfg = TrainConfig(
        workers=2,
        steps=2,
        seq_len=16,
        d_model=16,
        n_layer=1,
        n_head=1,
        micro_batch=2,
        resources_per_worker={"CPU": 1, **TRAINER},
        placement_timeout_s=3,
        storage_path=str(tmp_path / "checkpoints"),
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(PlacementTimeout) as err:
            run_training(cfg, shard_set(tmp_path / "shards"), "", "", "never-placed")
    finally:
        ray.shutdown()
    message = str(err.value)
    assert message.startswith(
        "train.placement_timeout_s=3: the cluster did not place 2 workers x "
        "{'CPU': 1.0, 'trainer': 1.0} in time (it has {"
    )
    assert "'CPU': 2.0" in message and "trainer" not in message.split("(it has", 1)[1]
    assert "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S" not in os.environ  # set for that fit() only
