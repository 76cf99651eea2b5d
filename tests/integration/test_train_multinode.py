"""Multi-node for real: infra.cluster's local-multinode mode starts a Ray head and a worker node as separate
`ray start` processes on 127.0.0.1; the training stage places one worker on each node and checkpoints as one run."""

from __future__ import annotations

import os

import pytest
from support.train_support import RECORD_DIR_ENV, REPO, TESTS, shard_set, worker_records

from training import checkpoint as ck
from training.config import TrainConfig

CFG = TrainConfig(
    workers=2,
    steps=12,
    checkpoint_every=6,
    log_every=3,
    seq_len=32,
    n_layer=2,
    n_head=2,
    d_model=32,
    micro_batch=8,
    warmup_steps=2,
    model_factory="support.train_support:recording_gpt",
)


@pytest.fixture()
def two_node_cluster(tmp_path, monkeypatch):
    """Head (1 CPU) + worker node (1 CPU); stopped by recorded pid by infra.head.stop_head (never a host-wide stop)."""
    from infra.cluster import provision, teardown
    from infra.config import ClusterConfig

    records = tmp_path / "workers"
    records.mkdir()
    # The nodes' processes (and so the Ray workers) inherit this environment: the plug-in model's module and
    # where it records each worker's node.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), str(REPO), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv(RECORD_DIR_ENV, str(records))
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))  # the head's record lives there
    info = provision(
        ClusterConfig(mode="local-multinode", num_cpus=1, worker_nodes=1, cpus_per_worker_node=1, object_store_mb=100)
    )
    try:
        yield records
    finally:
        from infra.head import stop_head

        teardown(info)
        assert stop_head()


def test_workers_are_placed_on_both_nodes(two_node_cluster, tmp_path, monkeypatch):
    import ray

    from infra.head import read_head
    from training.trainer import run_training

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    assert not read_head().loopback  # Ray's multi-node switch stays on: `ray start --address` needs it
    result = run_training(CFG, shard_set(tmp_path / "shards"), "", "", "two-nodes")

    placed = {r["rank"]: r["node_id"] for r in worker_records(two_node_cluster)}
    assert sorted(placed) == [0, 1]
    assert placed[0] != placed[1] and set(placed.values()) == nodes
    assert result.step == 12 and result.world_size == 2
    info = ck.verify_checkpoint(result.checkpoint_uri)
    assert (info.step, info.world_size) == (12, 2)
