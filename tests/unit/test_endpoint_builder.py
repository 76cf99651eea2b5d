"""The RayService's Serve builder: the registry's champion becomes the application `shardline serve` deploys."""

from __future__ import annotations

import pytest

from deployments.endpoint_builder import app
from deployments.registry import client_for


def _register(uri: str, exp: str, name: str) -> str:
    import mlflow

    client = client_for(uri)
    run = client.create_run(exp).info.run_id
    model = mlflow.initialize_logged_model(name="model", source_run_id=run, experiment_id=exp)
    client.create_registered_model(name)
    version = client.create_model_version(name, f"models:/{model.model_id}", run_id=run, model_id=model.model_id)
    return version.version


def test_builds_the_champion_application(mlflow_store, monkeypatch):
    uri, exp = mlflow_store
    monkeypatch.delenv("SHARDLINE_SERVE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="no champion"):
        app({"model_name": "tiny", "tracking_uri": uri})
    client_for(uri).set_registered_model_alias("tiny", "champion", _register(uri, exp, "tiny"))
    built = app({"model_name": "tiny", "tracking_uri": uri, "serve": {"replica_cpus": 0.5, "router_cpus": 0.1}})
    router = built._bound_deployment  # the router, bound to the per-version model deployments
    assert router.name == "router"
    assert router._deployment_config.user_config["champion"] == "1"
    assert router._deployment_config.user_config["model_name"] == "tiny"
    assert router.ray_actor_options["num_cpus"] == 0.1  # a router forwards; the model replicas get replica_cpus
    assert {m._bound_deployment.ray_actor_options["num_cpus"] for m in router.init_args[1].values()} == {0.5}


def test_model_name_is_required():
    with pytest.raises(ValueError, match="model_name is required"):
        app({})
