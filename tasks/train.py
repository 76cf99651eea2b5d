"""train_fsdp: FSDP2 training on Ray Train, with a Prefect progress artifact and the loss curve in MLflow."""
from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from infra.cluster import ClusterInfo
from infra.tracking import (
    TAG_CHECKPOINT_URI, TAG_CLUSTER_ADDRESS, TAG_DATA_RUN_ID, TAG_DATASET_DIGEST, TAG_MANIFEST_URI, Lineage,
    flat_params, stage_run,
)
from tasks.retry import retry_unless
from training.config import TrainConfig
from training.data import ShardSet
from training.trainer import TrainResult, logged_step, loss_curve_png, run_training

POLL_S = 2.0


@task(name="train_fsdp", retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2), cache_policy=NO_CACHE,
      retry_condition_fn=retry_unless(ValueError))
def train_fsdp(cfg: TrainConfig, shards: ShardSet, cluster: ClusterInfo, lineage: Lineage) -> TrainResult:
    """Train the model with FSDP2 on Ray Train; a retry resumes from the latest checkpoint.

    A config mistake (ValueError: global batch, import paths) fails at once, without retries.

    Args:
        cfg: model, optimisation, parallelism and checkpointing.
        shards: the published shard set to train on.
        cluster: the Ray cluster provision_cluster connected this process to.
        lineage: the flow run's MLflow run tree.
    """
    logger = get_run_logger()
    with stage_run(lineage, "train_fsdp") as run_id:
        mlflow.set_tags({TAG_DATASET_DIGEST: shards.dataset_digest, TAG_DATA_RUN_ID: shards.data_run_id,
                         TAG_MANIFEST_URI: shards.manifest_uri, TAG_CLUSTER_ADDRESS: cluster.address})
        mlflow.log_params(flat_params("train", cfg))
        progress = create_progress_artifact(0.0, key="train-progress", description=f"train_fsdp: {cfg.steps} steps")
        # Ray Train blocks in fit(); run it beside this thread, which moves the progress bar from MLflow.
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(run_training, cfg, shards, lineage.tracking_uri, run_id, f"train-{run_id}")
            while not future.done():
                time.sleep(POLL_S)
                step = logged_step(lineage.tracking_uri, run_id)
                update_progress_artifact(progress, min(100.0, 100.0 * step / cfg.steps))
            result = future.result()
        update_progress_artifact(progress, 100.0)
        with tempfile.TemporaryDirectory() as tmp:
            mlflow.log_artifact(str(loss_curve_png(lineage.tracking_uri, run_id, Path(tmp) / "loss_curve.png")))
        mlflow.log_metrics({"final_loss": result.final_loss, "tokens_per_s": result.tokens_per_s})
        mlflow.set_tag(TAG_CHECKPOINT_URI, result.checkpoint_uri)
        logger.info("trained %d steps on %d workers: loss %.4f, %.0f tokens/s, checkpoint %s", result.step,
                    result.world_size, result.final_loss, result.tokens_per_s, result.checkpoint_uri)
        return result
