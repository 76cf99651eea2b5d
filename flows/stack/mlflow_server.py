"""The MLflow part: tracking server and UI on host:port, backend SQLite or PostgreSQL, artifacts proxied."""

from __future__ import annotations

from pathlib import Path

from flows.stack.config import StackConfig
from flows.stack.postgres import Backend
from flows.stack.service import bin_path, ensure_service, service_env
from flows.stack.state import PartState


def tracking_url(cfg: StackConfig) -> str:
    return f"http://{cfg.host}:{cfg.mlflow_port}"


def start(cfg: StackConfig, home: Path, recorded: PartState | None, backend: Backend | None) -> PartState:
    """Start (or keep) `mlflow server` and wait until /health answers.

    The SQLite default is $SHARDLINE_HOME/mlflow.db, the same store `shardline run` uses without a stack, so runs
    made before the stack came up show in its UI too.
    """
    store = backend.url("psycopg2", backend.databases["mlflow"]) if backend else f"sqlite:///{home / 'mlflow.db'}"
    artifacts = cfg.artifacts or str(home / "mlartifacts")
    argv = [
        bin_path("mlflow"),
        "server",
        "--host",
        cfg.host,
        "--port",
        str(cfg.mlflow_port),
        "--backend-store-uri",
        store,
        "--artifacts-destination",
        artifacts,
        "--workers",
        str(cfg.mlflow_workers),
    ]
    detail = {"backend": backend.display + "_mlflow" if backend else store, "artifacts": artifacts}
    env = service_env(backend.env() if backend else {})
    return ensure_service(
        "mlflow",
        recorded,
        tracking_url(cfg),
        f"{tracking_url(cfg)}/health",
        cfg.host,
        cfg.mlflow_port,
        argv,
        env,
        home / "stack" / "logs",
        cfg.start_timeout_s,
        detail,
    )
