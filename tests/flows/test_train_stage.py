"""train_fsdp and validate_checkpoint as real Prefect tasks on real Ray and MLflow, with a plug-in model (a GRU, which
torch.export cannot capture, so it is served eagerly) and batch format defined in the test package: the progress
artifact advances, the loss curve lands in MLflow, lineage tags are set, the logged model serves, and a failed gate is
not retried."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from support.train_support import shard_set

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _progress_values(stop: threading.Event, seen: list[float]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        while not stop.is_set():
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["train-progress"])))
            seen += [float(a.data) for a in arts if a.data is not None]
            time.sleep(0.2)


def test_plugin_model_through_train_and_validate_tasks(prefect_server, ray_cluster, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from prefect import flow

    import tasks.train
    from infra.names import (
        TAG_CHECKPOINT_URI,
        TAG_DATA_RUN_ID,
        TAG_DATASET_DIGEST,
        TAG_MANIFEST_URI,
        TAG_MODEL_URI,
        TAG_TRAIN_RUN_ID,
    )
    from infra.tracking import Lineage, open_parent_run
    from tasks.train import train_fsdp
    from tasks.validate import validate_checkpoint
    from training.config import TrainConfig, ValidationConfig

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tasks.train, "POLL_S", 0.3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lineage = Lineage(
        tracking_uri=uri,
        experiment="train-stage",
        flow_run_id="fr-1",
        parent_run_id=open_parent_run(uri, "train-stage", "fr-1", "test"),
    )
    shards = shard_set(tmp_path / "shards").model_copy(update={"data_run_id": "data-run-1"})
    cfg = TrainConfig(
        workers=2,
        steps=60,
        checkpoint_every=30,
        log_every=2,
        seq_len=32,
        d_model=32,
        micro_batch=8,
        warmup_steps=5,
        model_factory="support.train_support:build_byte_gru",
        batch_format="support.train_support:reversed_blocks",
    )

    @flow
    def stage_flow():
        trained = train_fsdp(cfg, shards, ray_cluster, lineage)
        gate = ValidationConfig(max_bits_per_byte=7.5, max_texts=8, batch_size=4)
        return trained, validate_checkpoint(gate, cfg, trained, shards, lineage, return_state=True)

    @flow
    def strict_gate_flow(trained, other):
        gate = ValidationConfig(max_bits_per_byte=0.01, max_texts=4, batch_size=4)
        state = validate_checkpoint(gate, cfg, trained, shards, other, return_state=True)
        return {"failed": state.is_failed(), "task_run_id": state.state_details.task_run_id, "message": state.message}

    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_progress_values, args=(stop, seen), daemon=True)
    watcher.start()
    try:
        trained, state = stage_flow()
    finally:
        stop.set()
        watcher.join()
    validated = state.result()

    # the progress artifact moved during training and ended at 100
    assert any(0 < v < 100 for v in seen), seen
    assert seen[-1] == 100.0
    # the run trained the plug-in model to the end; its lineage tags and loss curve are in MLflow
    client = MlflowClient(uri)
    assert trained.step == 60 and trained.world_size == 2
    train_run = client.get_run(trained.train_run_id)
    assert train_run.data.tags[TAG_DATASET_DIGEST] == shards.dataset_digest
    assert train_run.data.tags[TAG_DATA_RUN_ID] == "data-run-1"
    assert train_run.data.tags[TAG_MANIFEST_URI] == shards.manifest_uri
    assert train_run.data.tags[TAG_CHECKPOINT_URI] == trained.checkpoint_uri
    # the network profile the workers trained with is in the run's lineage
    assert train_run.data.tags["shardline.network"] == "tcp"
    assert (
        train_run.data.params["network.NCCL_IB_DISABLE"] == "1"
        and train_run.data.params["network.NCCL_NET"] == "Socket"
    )
    assert "loss_curve.png" in [a.path for a in client.list_artifacts(trained.train_run_id)]
    loss = sorted(client.get_metric_history(trained.train_run_id, "loss"), key=lambda m: m.step)
    assert loss[-1].value < loss[0].value - 0.5
    # validation: tagged with what it consumed, logged the model, which serves [B, T] -> [B, T, 256]
    val_run = client.get_run(validated.validation_run_id)
    assert val_run.data.tags[TAG_TRAIN_RUN_ID] == trained.train_run_id
    assert val_run.data.tags[TAG_CHECKPOINT_URI] == trained.checkpoint_uri
    assert val_run.data.tags[TAG_MODEL_URI] == validated.model_uri
    assert val_run.data.metrics["val_bits_per_byte"] == pytest.approx(validated.val_bits_per_byte)
    assert validated.val_bits_per_byte < 7.5 and validated.seq_len == 32
    # torch.export specialises the GRU's sequence length, so validation logged its eager form (factory + weights)
    from training.servable import eager_spec, load_served_model

    assert eager_spec(validated.model_uri)["factory"] == "support.train_support:build_byte_gru"
    assert load_served_model(validated.model_uri)(torch.randint(0, 256, (2, 7))).shape == (2, 7, 256)

    # a gate that cannot pass fails the task once: GateFailed is not retried
    other = lineage.model_copy(
        update={"flow_run_id": "fr-2", "parent_run_id": open_parent_run(uri, "train-stage", "fr-2", "test-2")}
    )
    failed = strict_gate_flow(trained, other)
    assert failed["failed"]
    assert "GateFailed" in failed["message"] and "> validation.max_bits_per_byte 0.01" in failed["message"]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as pc:
        assert pc.read_task_run(failed["task_run_id"]).run_count == 1
