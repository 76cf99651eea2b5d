"""Helpers for the stack tests: run the `shardline` command, talk to the stack's Prefect REST API, wait for runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx

from infra.cluster import free_port

REPO = Path(__file__).resolve().parents[2]
SHARDLINE = str(Path(sys.executable).with_name("shardline"))
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def shardline(
    args: list[str], env: dict[str, str], timeout: float = 600, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run the shardline command with `env`; output captured."""
    return subprocess.run([SHARDLINE, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def stack_env(home: Path) -> dict[str, str]:
    """An environment whose $SHARDLINE_HOME is `home` and that points at no other Prefect or MLflow."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "PREFECT_HOME", "RAY_ADDRESS")
    }
    return {**env, "SHARDLINE_HOME": str(home)}


def status(env: dict[str, str]) -> dict:
    proc = shardline(["status", "--json"], env, timeout=60)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}


def up_args(model_name: str, extra: list[str] | None = None, prefect_port: int = 0, serve_port: int = 0) -> list[str]:
    """`shardline up` on free ports with the debug config, its endpoint serving `model_name`. Runs must use the
    same `serve.port` (one Serve HTTP proxy per Ray cluster). Here rather than in tests/stack/conftest.py: a test
    module's `from conftest import ...` gets whichever conftest pytest imported last, which depends on the paths
    a run was given."""
    return [
        "up",
        "--config",
        str(REPO / "configs" / "debug.toml"),
        "--prefect-port",
        str(prefect_port or free_port()),
        "--mlflow-port",
        str(free_port()),
        "--set",
        f"registry.model_name={model_name}",
        "--set",
        f"serve.port={serve_port or free_port()}",
        "--set",
        "stack.mlflow_workers=1",
        "--set",
        f"stack.prometheus_port={free_port()}",
        *(extra or []),
    ]


def small_config(model_name: str, steps: int = 10, **sections) -> dict:
    """configs/debug.toml at `steps` training steps, registering as `model_name`, as a flow `config` parameter."""
    cfg = tomllib.loads((REPO / "configs" / "debug.toml").read_text())
    cfg["train"].update(steps=steps, checkpoint_every=5, log_every=5, warmup_steps=2)
    cfg["registry"]["model_name"] = model_name
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def prefect_api(method: str, url: str, **kwargs) -> httpx.Response:
    """One call to the Prefect server's REST API, retried on 503 the way Prefect's own client retries it.

    The server answers 503 for errors a client may retry: a SQLite "database is locked" while the worker, the
    scheduler and the flow runs write. At most 5 tries, 1, 2, 4 and 8 s apart. Any other status returns at once,
    raised by raise_for_status.
    """
    for attempt in range(5):
        r = httpx.request(method, url, timeout=30, **kwargs)
        if r.status_code != 503 or attempt == 4:
            return r.raise_for_status()
        time.sleep(2**attempt)
    raise AssertionError("unreachable")


def deployment(api: str, name: str) -> dict:
    return prefect_api("GET", f"{api}/deployments/name/{name}").json()


def create_run(api: str, deployment_id: str, parameters: dict) -> dict:
    """Exactly the UI's "Custom run": POST /deployments/{id}/create_flow_run with the form's parameters."""
    return prefect_api(
        "POST", f"{api}/deployments/{deployment_id}/create_flow_run", json={"parameters": parameters}
    ).json()


def runs_of(api: str, deployment_id: str) -> list[dict]:
    body = {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 200}
    return prefect_api("POST", f"{api}/flow_runs/filter", json=body).json()


def wait_for_run(api: str, run_id: str, timeout_s: float, log: Path | None = None) -> dict:
    """Poll the flow run until it is final; return it. On timeout the assertion shows the worker's log tail."""
    deadline = time.monotonic() + timeout_s
    while True:
        run = prefect_api("GET", f"{api}/flow_runs/{run_id}").json()
        if run["state"]["type"] in FINAL:
            return run
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise AssertionError(f"flow run {run_id} still {run['state']['type']} after {timeout_s:.0f} s\n{tail}")
        time.sleep(3)


def assert_completed(run: dict, log: Path) -> None:
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    assert run["state"]["type"] == "COMPLETED", f"{run['state']['type']}: {run['state'].get('message')}\n{tail}"


def mlflow_runs_of_flow_run(tracking_uri: str, flow_run_id: str) -> list:
    """Every MLflow run tagged with this Prefect flow run id (the parent and its stage children)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri, registry_uri=tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, filter_string=f"tags.`shardline.prefect_flow_run_id` = '{flow_run_id}'")
