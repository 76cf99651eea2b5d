"""provision_cluster: start or connect to Ray and record what the run got."""

from __future__ import annotations

import mlflow
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from infra.cluster import ClusterInfo, provision, teardown
from infra.config import ClusterConfig
from infra.names import TAG_CLUSTER_ADDRESS
from infra.network import network_env
from infra.tracking import Lineage, flat_params, safe_tags, stage_run
from tasks.retry import TIMEOUT_S


@task(
    name="provision_cluster",
    timeout_seconds=TIMEOUT_S["provision_cluster"],
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    cache_policy=NO_CACHE,
)
def provision_cluster(cfg: ClusterConfig, lineage: Lineage) -> ClusterInfo:
    """Start (or connect to) the Ray cluster the rest of the run uses.

    Args:
        cfg: which cluster: local, local-multinode or remote.
        lineage: the flow run's MLflow run tree.

    Returns:
        The cluster's address and resources; the flow tears it down at the end, also on failure.
    """
    with stage_run(lineage, "provision_cluster"):
        try:
            info = provision(cfg)
        except Exception:
            teardown(None)  # a half-started local cluster must not leak into the retry
            raise
        info.network, info.network_env = cfg.network, network_env(cfg.network, cfg.network_env)
        mlflow.log_params(flat_params("cluster", cfg))
        mlflow.log_metrics({f"ray.{k}": v for k, v in info.resources.items()} | {"ray.nodes": info.nodes})
        mlflow.set_tags(safe_tags({TAG_CLUSTER_ADDRESS: info.address, "shardline.ray_mode": info.mode}))
        return info
