"""shard_dataset under a real Prefect server: a storage outage is retried by the task, bad input is not."""

from __future__ import annotations

import asyncio
import time

import boto3
from prefect import flow
from support.data_helpers import config, make_corpus
from support.store_servers import free_port

from infra.tracking import Lineage, open_parent_run
from tasks.data import shard_dataset


def _lineage(mlflow_store) -> Lineage:
    uri, _ = mlflow_store
    parent = open_parent_run(uri, "shardline-test", "flow-x", "flow-x")
    return Lineage(tracking_uri=uri, experiment="shardline-test", parent_run_id=parent, flow_run_id="flow-x")


@flow
def _shard_flow(cfg, lineage) -> dict:
    state = shard_dataset(cfg, lineage, return_state=True)
    result = state.result(raise_on_failure=False)
    return {
        "completed": state.is_completed(),
        "message": state.message or "",
        "task_run_id": str(state.state_details.task_run_id),
        "uri": getattr(result, "uri", ""),
    }


def _run_count(task_run_id: str) -> int:
    from prefect.client.orchestration import get_client

    async def read() -> int:
        async with get_client() as client:
            return (await client.read_task_run(task_run_id)).run_count

    return asyncio.run(read())


def test_bad_input_fails_once_without_retries(prefect_server, mlflow_store, tmp_path):
    (tmp_path / "empty").mkdir()
    out = _shard_flow(config(tmp_path / "empty", tmp_path / "out"), _lineage(mlflow_store))
    assert not out["completed"] and "no files matching" in out["message"]
    assert _run_count(out["task_run_id"]) == 1


def test_outage_longer_than_storage_retries_is_retried_by_the_task(prefect_server, mlflow_store, tmp_path, monkeypatch):
    """The S3 endpoint is down for the task's whole first attempt (storage_retries=0), back before the retry."""
    from moto.server import ThreadedMotoServer

    from infra import storage

    port = free_port()
    for key, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    real_exists, started = storage.exists, []

    def exists_then_recover(uri, retries=None):  # the stage's first S3 call; the endpoint returns after it
        try:
            return real_exists(uri, retries)
        finally:
            if not started:
                started.append(time.monotonic())
                server.start()
                boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="late")

    monkeypatch.setattr(storage, "exists", exists_then_recover)
    try:
        out = _shard_flow(
            config(make_corpus(tmp_path / "c"), "s3://late/out", storage_retries=0), _lineage(mlflow_store)
        )
        assert out["completed"], out["message"]
        assert _run_count(out["task_run_id"]) == 2 and out["uri"].startswith("s3://late/out/")
    finally:
        if started:
            server.stop()
