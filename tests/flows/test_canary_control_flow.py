"""The `canary-control` flow (the Prefect UI's way to `shardline canary ACTION`) under a real Prefect server and a
real MLflow registry: status reads the registry, a command with no canary running fails in one line, an unknown
action is refused."""

from __future__ import annotations

import pytest

from deployments.registry import client_for
from flows.canary_control import canary_control
from flows.config import ConfigError, PipelineConfig


@pytest.fixture
def registry(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    client.create_registered_model("m")
    source = tmp_path / "model"
    source.mkdir()
    for _ in range(2):
        client.create_model_version("m", source=str(source))
    client.set_registered_model_alias("m", "champion", "1")
    client.set_registered_model_alias("m", "challenger", "2")  # registered, no canary running for it
    return PipelineConfig.model_validate({"registry": {"model_name": "m", "tracking_uri": uri}})


def test_status_reads_the_registry(registry):
    status = canary_control(action="status", config=registry)
    assert (status["model"], status["state"], status["champion_version"], status["percent"]) == ("m", "none", "1", 0)


@pytest.mark.parametrize(
    "action, message",
    [
        ("pause", "ConfigError: canary pause: no canary of m is running; nothing to pause"),
        ("promote", "ConfigError: canary promote: no canary of m is running; nothing to promote"),
        ("frob", "ConfigError: action: 'frob' is not one of status, pause, resume, promote, abort"),
    ],
)
def test_a_command_that_does_not_apply_fails_the_run_in_one_line(registry, action, message):
    state = canary_control(action=action, reason="testing", config=registry, return_state=True)
    exc = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(exc, ConfigError)
    assert f"{type(exc).__name__}: {exc}" == message
