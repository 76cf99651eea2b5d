"""Fixtures of the stack tests: a `shardline up` stack on free ports for the module, always brought down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.postgres_server import PostgresServer, pg_bin
from support.stack_support import shardline, small_config, stack_env, status, up_args

from infra.cluster import free_port


def serve_of(model_name: str, serve_port: int) -> dict:
    """A run's [serve] on the stack: its one Serve proxy and the stack's gateway on '/', which routes by the request's
    `model` (every model of the stack is an application behind it)."""
    return {"port": serve_port, "route_prefix": "/"}


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL server for the session (its URL), stopped and removed afterwards; "" on a developer's
    machine without PostgreSQL's binaries (the stack then runs on SQLite and test_stack_postgres skips; under CI it
    fails instead, support.requires)."""
    if pg_bin() is None:
        yield ""
        return
    server = PostgresServer()
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres_url: str) -> Iterator[dict]:
    """One running stack for the stack tests (session-wide: starting one takes ~50 s), on PostgreSQL as a team runs
    it (`shardline up --backend`: MLflow's store and Prefect's database; SQLite where no PostgreSQL is installed):
    {'env', 'home', 'api', 'tracking_uri', 'status', 'log', 'postgres', ...}; `shardline down` afterwards."""
    home = tmp_path_factory.mktemp("stack-home")
    env = stack_env(home)
    serve_port = free_port()
    backend = ["--backend", postgres_url] if postgres_url else []
    proc = shardline(up_args("stack-test", backend, serve_port=serve_port), env, timeout=600)
    try:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = status(env)
        yield {
            "env": env,
            "home": home,
            "api": report["prefect"]["url"],
            "tracking_uri": report["mlflow"]["url"],
            "status": report,
            "log": Path(report["worker"]["log"]),
            "up_output": proc.stdout,
            "serve_port": serve_port,
            "postgres": postgres_url,
            "config": lambda name, steps=10: small_config(name, steps, serve=serve_of(name, serve_port)),
        }
    finally:
        down = shardline(["down"], env, timeout=300)
        print(down.stdout, down.stderr)
