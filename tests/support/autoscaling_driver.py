"""Driver of the autoscaling test: shardline's provision_cluster and train_fsdp stages, as Prefect tasks in a flow,
against the Ray cluster named in the JSON argument. Prints one JSON line: the alive Ray nodes provisioning saw, those
alive right after training, and what training returned.

It runs as its own process because Ray rewrites a 127.0.0.1 address to the host's LAN address unless the process
starts with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which Ray reads once at import; the test sets it for this process only.

Usage: python autoscaling_driver.py '{"address": ..., "tracking_uri": ..., "shards": DIR, "train": {...}}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    args = json.loads(sys.argv[1])
    from prefect import flow

    from infra.cluster import teardown
    from infra.config import ClusterConfig
    from infra.tracking import Lineage, open_parent_run, setup_tracking
    from support.train_support import shard_set
    from tasks.cluster import provision_cluster
    from tasks.train import train_fsdp
    from training.config import TrainConfig

    uri, experiment = args["tracking_uri"], "autoscaling"
    setup_tracking(uri, experiment)
    lineage = Lineage(
        tracking_uri=uri,
        experiment=experiment,
        flow_run_id="autoscaling-1",
        parent_run_id=open_parent_run(uri, experiment, "autoscaling-1", "autoscaling"),
    )
    shards = shard_set(Path(args["shards"]))
    cfg = TrainConfig(**args["train"])

    def alive() -> list[str]:
        import ray

        return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])

    @flow(name="autoscaling-training")
    def stages() -> dict:
        cluster = provision_cluster(ClusterConfig(mode="remote", address=args["address"]), lineage)
        try:
            at_start = alive()
            trained = train_fsdp(cfg, shards, cluster, lineage)
            return {
                "nodes_at_start": at_start,
                "nodes_after_training": alive(),
                "cluster_nodes": cluster.nodes,
                "trained": trained.model_dump(),
            }
        finally:
            teardown(cluster)

    print(json.dumps(stages()), flush=True)


if __name__ == "__main__":
    main()
