"""`shardline up --backend postgresql://...`: MLflow's store and Prefect's database on one PostgreSQL server
(separate databases, created), and two pipeline runs at once against it. The session's stack (tests/stack/conftest)
is the one on PostgreSQL, so every stack test runs on it; this test checks where the state went."""

from __future__ import annotations

import json
import subprocess

import pytest
from support.requires import missing
from support.stack_support import REPO, SHARDLINE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_stack_on_postgresql_runs_two_pipelines_at_once(stack):
    import psycopg2

    postgres, env = stack["postgres"], stack["env"]
    if not postgres:
        missing("no PostgreSQL server binaries (make test installs them)")
    report = stack["status"]
    assert report["postgres"]["databases"] == "shardline_mlflow,shardline_prefect"
    assert report["prefect"]["database"].startswith("postgresql://shardline@127.0.0.1:")
    assert report["mlflow"]["backend"].endswith("/shardline_mlflow")
    # Two `shardline run`s at once: they find the stack and use its Prefect and MLflow servers. (Releases of
    # one model serialising is the release lock's test; these register two models side by side.) Two writers
    # are what makes SQLite answer "database is locked"; a third cost ~100 s on 2 cores and proved nothing more.
    cmd = [
        SHARDLINE,
        "run",
        "--config",
        str(REPO / "configs" / "debug.toml"),
        "--json",
        "--set",
        "train.steps=10",
        "--set",
        "train.checkpoint_every=5",
        "--set",
        "serve.enabled=false",
        "--set",
        "canary.enabled=false",
    ]
    models = [f"stack-pg-{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [*cmd, "--set", f"registry.model_name={model}"],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for model in models
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=False):
        assert p.returncode == 0, err[-3000:]
        assert "database is locked" not in err
    summaries = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted((s["model_name"], s["model_version"], s["decision"]) for s in summaries) == [
        (model, "1", "first-champion") for model in models
    ]

    # Everything is in PostgreSQL: the MLflow runs of each flow run, and the flow runs in Prefect's database.
    base = dict(host="127.0.0.1", port=int(postgres.rsplit(":", 1)[1].split("/")[0]), user="shardline")
    with psycopg2.connect(dbname="shardline_mlflow", **base) as conn, conn.cursor() as cur:
        cur.execute("SELECT value FROM tags WHERE key = 'shardline.prefect_flow_run_id'")
        mlflow_flow_runs = {row[0] for row in cur.fetchall()}
        cur.execute("SELECT name FROM model_versions WHERE name LIKE 'stack-pg-%' ORDER BY name")
        assert [row[0] for row in cur.fetchall()] == models
    with psycopg2.connect(dbname="shardline_prefect", **base) as conn, conn.cursor() as cur:
        cur.execute("SELECT id::text FROM flow_run WHERE state_type = 'COMPLETED'")
        prefect_flow_runs = {row[0] for row in cur.fetchall()}
    assert {s["flow_run_id"] for s in summaries} <= mlflow_flow_runs & prefect_flow_runs
