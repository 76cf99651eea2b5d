"""Deployments that really run: the stack's worker executes runs started the ways users start them (the schedule, a
dataset event; the UI's "Custom run" is tests/stack/test_stack_browser.py's, with what such a run leaves in the stack's
MLflow server and $SHARDLINE_HOME) and they write to the stack's MLflow server."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from support.stack_support import (
    assert_completed,
    deployment,
    mlflow_runs_of_flow_run,
    prefect_api,
    runs_of,
    shardline,
    wait_for_run,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
RUN_TIMEOUT_S = 420


def test_nightly_schedule_creates_cron_runs_and_the_worker_runs_one_moved_near(stack):
    api = stack["api"]
    nightly = deployment(api, "shardline/nightly")
    deadline = time.monotonic() + 90  # the scheduler service fills the schedule when the deployment is created
    while not (scheduled := [r for r in runs_of(api, nightly["id"]) if r["state"]["type"] == "SCHEDULED"]):
        assert time.monotonic() < deadline, "the server created no scheduled run for the nightly deployment"
        time.sleep(3)
    times = [dt.datetime.fromisoformat(r["expected_start_time"]) for r in scheduled]
    assert all((t.hour, t.minute, t.second) == (3, 0, 0) and t.utcoffset() == dt.timedelta(0) for t in times)
    assert len({t.date() for t in times}) == len(times)  # one per night

    first = scheduled[0]
    prefect_api(
        "PATCH", f"{api}/flow_runs/{first['id']}", json={"parameters": {"config": stack["config"]("stack-nightly")}}
    )
    now = dt.datetime.now(dt.UTC).isoformat()
    prefect_api(
        "POST",
        f"{api}/flow_runs/{first['id']}/set_state",
        json={
            "state": {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": now}},
            "force": True,
        },
    )
    done = wait_for_run(api, first["id"], RUN_TIMEOUT_S, stack["log"])
    assert_completed(done, stack["log"])
    assert done["deployment_id"] == nightly["id"]
    assert {
        r.data.tags.get("shardline.stage") for r in mlflow_runs_of_flow_run(stack["tracking_uri"], first["id"])
    } >= {"pipeline", "train_fsdp", "promote_model"}


def test_notify_dataset_starts_a_run_on_that_source_and_a_sourceless_event_starts_none(stack, tmp_path):
    from support.data_helpers import make_corpus

    api = stack["api"]
    on_new_data = deployment(api, "shardline/on-new-data")
    assert runs_of(api, on_new_data["id"]) == []

    # An event without a source must not start anything (and never the demo corpus).
    from prefect.events import Event
    from prefect.events.clients import get_events_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def emit_sourceless():
        async with get_events_client() as client:
            await client.emit(
                Event(event="shardline.dataset.updated", resource={"prefect.resource.id": "shardline.dataset.nosource"})
            )

    with temporary_settings({PREFECT_API_URL: api}):
        run_coro_as_sync(emit_sourceless())

    corpus = make_corpus(tmp_path / "new-corpus", n=120)
    proc = shardline(
        [
            "notify-dataset",
            str(corpus),
            "--config",
            "configs/debug.toml",
            "--set",
            "train.steps=10",
            "--set",
            "train.checkpoint_every=5",
            "--set",
            "registry.model_name=stack-event",
            "--set",
            f"serve.port={stack['serve_port']}",
        ],
        stack["env"],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"for {corpus}" in proc.stdout

    deadline = time.monotonic() + 60
    while not (runs := runs_of(api, on_new_data["id"])):
        assert time.monotonic() < deadline, "the automation started no run for the dataset event"
        time.sleep(2)
    time.sleep(5)  # both events were emitted before this one was seen; give a stray run time to show up
    runs = runs_of(api, on_new_data["id"])
    assert len(runs) == 1, [r["parameters"] for r in runs]
    assert runs[0]["parameters"]["config"]["data"]["source"] == str(corpus)
    assert runs[0]["parameters"]["config"]["train"]["steps"] == 10
    done = wait_for_run(api, runs[0]["id"], RUN_TIMEOUT_S, stack["log"])
    assert_completed(done, stack["log"])
    shard_run = next(
        r
        for r in mlflow_runs_of_flow_run(stack["tracking_uri"], runs[0]["id"])
        if r.data.tags.get("shardline.stage") == "shard_dataset"
    )
    assert shard_run.data.params["data.source"] == str(corpus)
