"""train.loop = "lightning" through the real train_fsdp and validate_checkpoint Prefect tasks on real Ray and MLflow:
the LightningModule trains on 2 workers, its DCP checkpoint is validated like any other, and the logged model is the
module's GPT, which serves [B, T] -> [B, T, 256] with the trained model's bits per byte."""

from __future__ import annotations

import pytest
import torch
from support.train_support import shard_set

pytestmark = pytest.mark.slow


def test_a_lightning_module_goes_through_the_train_and_validate_tasks(
    prefect_server, ray_cluster, tmp_path, monkeypatch
):
    from mlflow import MlflowClient
    from prefect import flow

    import tasks.train
    from infra.names import TAG_CHECKPOINT_URI, TAG_DATASET_DIGEST, TAG_TRAIN_RUN_ID
    from infra.tracking import Lineage, open_parent_run
    from tasks.train import train_fsdp
    from tasks.validate import validate_checkpoint
    from training.config import LIGHTNING_FACTORY, TrainConfig, ValidationConfig
    from training.servable import load_served_model

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tasks.train, "POLL_S", 0.3)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lineage = Lineage(
        tracking_uri=uri,
        experiment="lightning-stage",
        flow_run_id="fr-l",
        parent_run_id=open_parent_run(uri, "lightning-stage", "fr-l", "test"),
    )
    shards = shard_set(tmp_path / "shards").model_copy(update={"data_run_id": "data-run-l"})
    cfg = TrainConfig(
        loop="lightning",
        lightning_module="training.lightning_example:ByteGPTModule",
        parallelism="ddp",
        workers=2,
        steps=60,
        checkpoint_every=30,
        log_every=5,
        seq_len=32,
        n_layer=2,
        n_head=2,
        d_model=32,
        micro_batch=8,
        warmup_steps=5,
    )

    @flow
    def stage_flow():
        trained = train_fsdp(cfg, shards, ray_cluster, lineage)
        gate = ValidationConfig(max_bits_per_byte=7.5, max_texts=8, batch_size=4)
        return trained, validate_checkpoint(gate, cfg, trained, shards, lineage)

    trained, validated = stage_flow()
    client = MlflowClient(uri)
    assert trained.step == 60 and trained.world_size == 2
    train_run = client.get_run(trained.train_run_id)
    assert train_run.data.tags[TAG_DATASET_DIGEST] == shards.dataset_digest
    assert train_run.data.params["train.loop"] == "lightning"
    loss = sorted(client.get_metric_history(trained.train_run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in loss] == list(range(5, 61, 5)) and loss[-1].value < loss[0].value - 0.5
    assert set(train_run.data.metrics) >= {"tokens_per_s", "mfu", "grad_norm", "lr"}
    val_run = client.get_run(validated.validation_run_id)
    assert val_run.data.tags[TAG_TRAIN_RUN_ID] == trained.train_run_id
    assert val_run.data.tags[TAG_CHECKPOINT_URI] == trained.checkpoint_uri
    assert validated.val_bits_per_byte < 7.5
    # the served form is the module's `.model`, rebuilt through the Lightning factory
    assert cfg.model_factory == LIGHTNING_FACTORY
    served = load_served_model(validated.model_uri)
    assert served(torch.randint(0, 256, (2, 7))).shape == (2, 7, 256)
