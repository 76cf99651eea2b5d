"""Runs of dead processes: a flow's parent run records its owner; the next flow on the host ends, as KILLED, the
RUNNING runs whose owner process is gone, and nothing else."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import mlflow

from infra.names import TAG_PARENT, TAG_STAGE
from infra.run_owner import TAG_ENDED_BY, TAG_OWNER, current_owner, owner_alive
from infra.tracking import open_parent_run

REPO = Path(__file__).resolve().parents[2]


def _dead_owner() -> str:
    """The owner string of a process that has exited (a real one: its pid and start time were real)."""
    out = subprocess.run(
        [sys.executable, "-c", "from infra.run_owner import current_owner; print(current_owner())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def _parent(client, experiment_id: str, name: str, owner: str | None) -> str:
    tags = {TAG_STAGE: "pipeline", **({TAG_OWNER: owner} if owner is not None else {})}
    return client.create_run(experiment_id, run_name=name, tags=tags).info.run_id


def _stage(client, experiment_id: str, parent: str, stage: str) -> str:
    return client.create_run(experiment_id, run_name=stage, tags={TAG_PARENT: parent, TAG_STAGE: stage}).info.run_id


def test_owner_identity_tells_live_dead_and_unknowable_processes():
    assert owner_alive(current_owner()) is True
    dead = _dead_owner()
    assert dead.split("/")[0] == socket.gethostname() and owner_alive(dead) is False
    host, boot, pid, start = current_owner().split("/")
    assert owner_alive(f"{host}/{boot}/{pid}/{int(start) + 1}") is False  # the pid, reused by another process
    assert owner_alive(f"{host}/another-boot/{pid}/{start}") is False  # the host rebooted since
    assert owner_alive(f"elsewhere.example/{boot}/{pid}/{start}") is None  # another host: cannot tell
    assert owner_alive("not an owner") is None


def test_next_flow_ends_the_runs_of_a_dead_process_and_only_those(mlflow_store):
    uri, experiment_id = mlflow_store
    client = mlflow.MlflowClient(uri)
    dead, here = _dead_owner(), current_owner()
    killed = _parent(client, experiment_id, "killed", dead)
    killed_train = _stage(client, experiment_id, killed, "train_fsdp")
    killed_data = _stage(client, experiment_id, killed, "shard_dataset")
    client.set_terminated(killed_data, "FINISHED")
    alive = _parent(client, experiment_id, "alive", here)  # e.g. a concurrent run of this host
    alive_stage = _stage(client, experiment_id, alive, "train_fsdp")
    host, boot, pid, start = dead.split("/")
    remote = _parent(client, experiment_id, "remote", f"elsewhere.example/{boot}/{pid}/{start}")
    unowned = _parent(client, experiment_id, "unowned", None)  # written before owners were recorded

    new = open_parent_run(uri, "shardline-test", "flow-run-next", "next")

    status = {
        r: client.get_run(r).info.status
        for r in (killed, killed_train, killed_data, alive, alive_stage, remote, unowned, new)
    }
    assert status == {
        killed: "KILLED",
        killed_train: "KILLED",
        killed_data: "FINISHED",
        alive: "RUNNING",
        alive_stage: "RUNNING",
        remote: "RUNNING",
        unowned: "RUNNING",
        new: "RUNNING",
    }
    for run in (killed, killed_train):
        assert client.get_run(run).data.tags[TAG_ENDED_BY] == f"run {new}: owner process {dead} is gone"
    assert TAG_ENDED_BY not in client.get_run(alive).data.tags
    assert client.get_run(new).data.tags[TAG_OWNER] == here


def test_a_retried_flow_run_takes_its_parent_run_over(mlflow_store):
    # Prefect retries a crashed flow run under the same id: its parent run is reopened, owned by the new process.
    uri, _ = mlflow_store
    client = mlflow.MlflowClient(uri)
    first = open_parent_run(uri, "shardline-test", "flow-run-r", "r")
    client.set_tag(first, TAG_OWNER, _dead_owner())
    client.set_terminated(first, "KILLED")  # as the next flow would have ended it
    again = open_parent_run(uri, "shardline-test", "flow-run-r", "r")
    run = client.get_run(again)
    assert again == first and run.info.status == "RUNNING" and run.data.tags[TAG_OWNER] == current_owner()
    assert os.getpid() == int(run.data.tags[TAG_OWNER].split("/")[2])


def test_a_run_taken_over_after_it_was_ended_as_killed_no_longer_says_it_was(mlflow_store):
    """The next flow ended the dead run and its running stage as KILLED, with shardline.ended_by; Prefect's retry
    of that flow run then resumed both and finished: FINISHED runs still said their owner process was gone."""
    from infra.tracking import Lineage, close_run, stage_run

    uri, experiment_id = mlflow_store
    client = mlflow.MlflowClient(uri)
    parent = open_parent_run(uri, "shardline-test", "flow-run-k", "k")
    train = _stage(client, experiment_id, parent, "train_fsdp")
    client.set_tag(parent, TAG_OWNER, _dead_owner())  # its process was SIGKILLed during training
    open_parent_run(uri, "shardline-test", "flow-run-other", "other")  # ends both as KILLED
    assert [client.get_run(r).data.tags.get(TAG_ENDED_BY, "") != "" for r in (parent, train)] == [True, True]

    assert open_parent_run(uri, "shardline-test", "flow-run-k", "k") == parent  # the retried flow run
    with stage_run(Lineage(tracking_uri=uri, experiment="shardline-test", parent_run_id=parent), "train_fsdp") as run:
        assert run == train
    close_run(uri, parent, True)
    for run_id in (parent, train):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and TAG_ENDED_BY not in run.data.tags


def test_a_dead_commands_parent_run_is_ended_whatever_its_stage_tag(mlflow_store):
    """`shardline shard` retags its parent's stage with the command's name; a SIGKILLed one stayed RUNNING for good,
    as only parents tagged 'pipeline' were looked at."""
    uri, experiment_id = mlflow_store
    client = mlflow.MlflowClient(uri)
    dead = _dead_owner()
    shard = client.create_run(
        experiment_id, run_name="shardline-shard", tags={TAG_STAGE: "shardline-shard", TAG_OWNER: dead}
    ).info.run_id
    shard_stage = _stage(client, experiment_id, shard, "shard_dataset")
    untagged = client.create_run(experiment_id, run_name="stageless", tags={TAG_OWNER: dead}).info.run_id
    unowned = client.create_run(experiment_id, run_name="x", tags={TAG_STAGE: "shardline-shard"}).info.run_id

    new = open_parent_run(uri, "shardline-test", "flow-run-after-shard", "after")

    status = {r: client.get_run(r).info.status for r in (shard, shard_stage, untagged, unowned, new)}
    assert status == {
        shard: "KILLED",
        shard_stage: "KILLED",
        untagged: "KILLED",
        unowned: "RUNNING",
        new: "RUNNING",
    }
    assert client.get_run(shard).data.tags[TAG_ENDED_BY] == f"run {new}: owner process {dead} is gone"
