"""The network profile's variables reach the Ray Train workers (a real local Ray cluster, one CPU worker)."""

from __future__ import annotations

import os

import pytest
from support.train_support import ray_runtime_env, report_worker_env

from infra.network import network_env
from training.config import TrainConfig
from training.trainer import run_config

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    env = ray_runtime_env()
    # the job's own environment says otherwise: the profile, set per worker, must win; the rest must stay
    env["env_vars"] = {**env.get("env_vars", {}), "NCCL_IB_DISABLE": "0", "SHARDLINE_PROBE": "from-job"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=env, log_to_driver=False)
    yield
    ray.shutdown()


def test_training_workers_see_the_tcp_profile(ray_cluster, tmp_path):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    env = network_env("tcp", {"NCCL_SOCKET_IFNAME": "lo"})
    trainer = TorchTrainer(
        report_worker_env,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=run_config(TrainConfig(), "network-env", str(tmp_path), worker_env=env),
    )
    seen = trainer.fit().metrics
    assert seen["NCCL_IB_DISABLE"] == "1" and seen["NCCL_NET"] == "Socket" and seen["UCX_TLS"] == "tcp,sm,self"
    assert seen["NCCL_SOCKET_IFNAME"] == "lo"  # a per-variable override from cluster.network_env
    assert seen["SHARDLINE_PROBE"] == "from-job"  # merged with, not instead of, the job's environment
