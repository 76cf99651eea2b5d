"""The Prefect server part: API and UI on host:port; SQLite under $SHARDLINE_HOME/prefect or PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from flows.stack.config import StackConfig
from flows.stack.postgres import Backend
from flows.stack.service import bin_path, ensure_service, service_env
from flows.stack.state import PartState


def api_url(cfg: StackConfig) -> str:
    return f"http://{cfg.host}:{cfg.prefect_port}/api"


def server_env(cfg: StackConfig, home: Path, backend: Backend | None) -> dict[str, str]:
    """The server's settings: its own PREFECT_HOME and API URL, whatever this shell points at."""
    extra = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": api_url(cfg),
        "PREFECT_SERVER_API_HOST": cfg.host,
        "PREFECT_SERVER_API_PORT": str(cfg.prefect_port),
        "PREFECT_UI_API_URL": api_url(cfg),
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    if backend is not None:
        extra["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = backend.url("asyncpg", backend.databases["prefect"])
        extra.update(backend.env())
    return service_env(extra)


def start(cfg: StackConfig, home: Path, recorded: PartState | None, backend: Backend | None) -> PartState:
    """Start (or keep) the Prefect server and wait until /api/health answers."""
    argv = [
        bin_path("prefect"),
        "server",
        "start",
        "--host",
        cfg.host,
        "--port",
        str(cfg.prefect_port),
        "--analytics-off",
    ]
    detail = {
        "ui": f"http://{cfg.host}:{cfg.prefect_port}",
        "database": backend.display + "_prefect" if backend else "sqlite",
    }
    return ensure_service(
        "prefect",
        recorded,
        api_url(cfg),
        f"{api_url(cfg)}/health",
        cfg.host,
        cfg.prefect_port,
        argv,
        server_env(cfg, home, backend),
        home / "stack" / "logs",
        cfg.start_timeout_s,
        detail,
    )
