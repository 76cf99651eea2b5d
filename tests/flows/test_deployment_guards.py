"""Every deployment in prefect.yaml (read here, so a new one is covered without touching this file) refuses a
credential in any of its parameter fields, as a UI run would send it: the flow run fails at once with one line
that masks it, before the MLflow run is opened, and the planted secret reaches no log (the run process's console,
the Prefect database's logs, the flow run's state message)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PLANTED = "PLANTED-ui-field-8f3a"
IN_CONFIG = ("data.output", f"s3://shardline/shards?X-Amz-Signature={PLANTED}")  # a presigned URL pasted in the form
IN_STRING = f"https://ops:{PLANTED}@shards.example.com/set"  # a password in a URI


def _deployments() -> list[dict]:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


def _cases(flow, parameters: dict) -> list[tuple[str, dict]]:
    """(field, flow parameters) per field a credential can be typed into: one config field, every str parameter.

    The other parameters are the deployment's own, or a harmless placeholder where the flow requires one.
    """
    from flows.config import PipelineConfig

    hints = typing.get_type_hints(flow.fn)
    plantable = [name for name in hints if name != "return"]
    unknown = [n for n in plantable if hints[n] not in (str, PipelineConfig)]
    if unknown:
        raise TypeError(f"{flow.name}: teach this test where a credential goes in parameters {unknown}")
    base = {n: "placeholder" for n in plantable if hints[n] is str} | parameters
    cases = []
    for name in plantable:
        if hints[name] is str:
            cases.append((name, {**base, name: IN_STRING}))
        else:
            section, key = IN_CONFIG[0].split(".")
            config = dict(base.get(name, {}))
            config[section] = {**config.get(section, {}), key: IN_CONFIG[1]}
            cases.append((IN_CONFIG[0], {**base, name: config}))
    return cases


def _run_cases(entrypoint: str, parameters: dict) -> list[dict]:
    """Run the flow once per case in this process, as a worker's flow-run process would; one result per case."""
    from prefect.flows import load_flow_from_entrypoint

    from flows.config import ConfigError

    flow = load_flow_from_entrypoint(entrypoint)  # what a worker's flow-run process loads
    out = []
    for field, params in _cases(flow, parameters):
        state = flow(**params, return_state=True)
        exc = state.result(raise_on_failure=False)
        out.append(
            {
                "field": field,
                "failed": state.is_failed(),
                "flow_run_id": str(state.state_details.flow_run_id),
                "refused": isinstance(exc, ConfigError),
                "error": str(exc),
            }
        )
    return out


@pytest.fixture
def deployment_env(prefect_server, tmp_path):
    """The environment of a flow-run process: this session's Prefect server, a fresh $SHARDLINE_HOME, no MLflow URI."""
    home = tmp_path / "home"
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "SHARDLINE_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env, home


def _flow_run_logs(flow_run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def read():
        async with get_client() as client:
            logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            return [log.message for log in logs], (await client.read_flow_run(flow_run_id)).state.message or ""

    messages, state_message = run_coro_as_sync(read())
    return [*messages, state_message]


@pytest.mark.parametrize("deployment", _deployments(), ids=lambda d: d["name"])
def test_a_credential_in_any_parameter_field_is_refused_in_one_line_and_logged_nowhere(deployment, deployment_env):
    env, home = deployment_env
    proc = subprocess.run(
        [sys.executable, __file__, deployment["entrypoint"], json.dumps(deployment.get("parameters") or {})],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert results, proc.stdout[-2000:]

    for result in results:
        field, error = result["field"], result["error"]
        assert result["failed"] and result["refused"], result
        assert f"flow parameter: {field}=" in error and "***" in error and len(error.splitlines()) == 1, error
        logs = _flow_run_logs(result["flow_run_id"])
        refusals = [m for m in logs if f"ConfigError: flow parameter: {field}=" in m]
        assert refusals and all(len(m.splitlines()) == 1 for m in refusals), logs  # the cause, in one line
        assert not [m for m in logs if PLANTED in m or "Traceback" in m], logs
    assert PLANTED not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (home / "mlflow.db").exists()  # refused before the MLflow parent run, so before any stage
    assert list((home / "runs").glob("*.json")) == []  # and the orphan record is dropped, as after any run


if __name__ == "__main__":  # the flow-run process: `python test_deployment_guards.py ENTRYPOINT PARAMETERS_JSON`
    sys.path.insert(0, str(REPO))
    for line in _run_cases(sys.argv[1], json.loads(sys.argv[2])):
        print(json.dumps(line), flush=True)
