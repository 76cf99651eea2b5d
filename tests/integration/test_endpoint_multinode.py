"""The live endpoint and a canary on a local multi-node Ray (head + worker node as separate processes), with the
project's code shipped to the replicas as Ray `py_modules`, the way a remote cluster gets it."""

from __future__ import annotations

import pytest
from support.load import Load
from support.serve_support import NAME, bigram_logits, corpus, log_model, register

from deployments import endpoint, serve_build
from deployments.config import CanaryConfig, ServeConfig
from deployments.registry import client_for, read_aliases
from deployments.rollout import run_rollout
from deployments.serving import replica_runtime_env
from infra.cluster import free_port
from infra.tracking import setup_tracking

pytestmark = pytest.mark.slow


def test_serve_and_canary_on_local_multinode(tmp_path, monkeypatch):
    from infra.cluster import provision, teardown
    from infra.config import ClusterConfig
    from infra.head import stop_head

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = setup_tracking(uri, "multinode-serve")
    client = client_for(uri)
    fit, heldout = corpus()
    register(client, *log_model(bigram_logits(fit, 50.0), "weak", exp, client))
    register(client, *log_model(bigram_logits(fit, 0.05), "good", exp, client))
    teardown(None)  # a driver an earlier module left connected, its Serve handles stopped first
    info = provision(
        ClusterConfig(mode="local-multinode", num_cpus=1, worker_nodes=1, cpus_per_worker_node=2, object_store_mb=100)
    )
    serve = ServeConfig(port=free_port())
    try:
        import ray

        env = replica_runtime_env("local-multinode")  # the packages this driver's job uploaded
        assert (
            env is not None and len(env["py_modules"]) == 5 and all(u.startswith("gcs://") for u in env["py_modules"])
        )

        assert sum(1 for n in ray.nodes() if n["Alive"]) == 2
        url = endpoint.reconcile(serve, NAME, uri, runtime_env=env).url
        cfg = CanaryConfig(
            steps=[50, 100], min_requests=5, min_paired=4, bake_seconds=1.0, probe_rps=6.0, latency_floor_ms=25.0
        )
        texts = [t.decode("utf-8", "ignore")[:400] for t in heldout]
        with Load(url, texts, rps=4.0, max_seconds=300) as load:
            result = run_rollout(cfg, serve, NAME, "1", "2", uri, heldout, runtime_env=env)
        assert result.decision == "promoted", result.reason
        assert read_aliases(client, NAME)["champion"] == "2"
        assert not load.failed and {a.version for a in load.answers} <= {"1", "2"}
        assert endpoint.served_versions(serve_build.app_name_for(serve, NAME)) == ["2"]
        endpoint.remove(serve, NAME)
    finally:
        teardown(info)
        assert stop_head()
