"""train_fsdp: FSDP2 training on Ray Train, with a Prefect progress artifact and the loss curve in MLflow."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import cast
from uuid import UUID

import mlflow
from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from infra.cluster import ClusterInfo
from infra.names import (
    TAG_CHECKPOINT_URI,
    TAG_CLUSTER_ADDRESS,
    TAG_DATA_RUN_ID,
    TAG_DATASET_DIGEST,
    TAG_MANIFEST_URI,
    TAG_NETWORK,
)
from infra.tracking import Lineage, flat_params, safe_tags, stage_run
from tasks.retry import TIMEOUT_S, retry_unless
from tasks.train_job import train_as_job
from training import resume
from training.checkpoint import CheckpointError
from training.config import TrainConfig
from training.data import ShardSet
from training.trainer import (
    PlacementTimeout,
    TrainResult,
    fit_vocabulary,
    logged_step,
    loss_curve_png,
    run_training,
)

POLL_S = 2.0


@task(
    name="train_fsdp",
    timeout_seconds=TIMEOUT_S["train_fsdp"],
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless(ValueError, CheckpointError, PlacementTimeout),
)
def train_fsdp(
    cfg: TrainConfig, shards: ShardSet, cluster: ClusterInfo, lineage: Lineage, model_name: str = ""
) -> TrainResult:
    """Train the model with FSDP2 on Ray Train; a retry or a rerun resumes from the latest checkpoint.

    With a remote cluster's job-server address the training runs as a Ray Job (tasks.train_job): a rerun
    re-attaches to the job of the same training still running there, and cancelling the stage stops it.

    The Ray Train run is named by the training key (dataset digest, training config, starting weights): a rerun
    after the process died continues that run; a training already finished is reused without retraining. A
    config mistake (ValueError), an unusable train.init_from (CheckpointError) or workers the cluster could not place
    within train.placement_timeout_s (PlacementTimeout) fail at once, without retries.

    Args:
        cfg: model, optimisation, parallelism, checkpointing and the weights to start from (init_from).
        shards: the published shard set to train on.
        cluster: the Ray cluster provision_cluster connected this process to.
        lineage: the flow run's MLflow run tree.
        model_name: the registered model whose champion `train.init_from = "champion"` names.
    """
    logger = get_run_logger()
    with stage_run(lineage, "train_fsdp") as run_id:
        mlflow.set_tags(
            safe_tags(
                {
                    TAG_DATASET_DIGEST: shards.dataset_digest,
                    TAG_DATA_RUN_ID: shards.data_run_id,
                    TAG_MANIFEST_URI: shards.manifest_uri,
                    TAG_CLUSTER_ADDRESS: cluster.address,
                }
            )
        )
        mlflow.log_params(flat_params("train", cfg))
        # the fabric the workers were told to use: a slow or hung run is often a network profile mismatch
        mlflow.set_tag(TAG_NETWORK, cluster.network)
        mlflow.log_params({f"network.{k}": v for k, v in cluster.network_env.items()})
        init = resume.resolve_init_from(cfg.init_from, model_name, lineage.tracking_uri, shards.tokenizer_sha256)
        if init is not None:  # against the model as the workers will build it, sized for the set's ids
            resume.check_init_checkpoint(init, fit_vocabulary(cfg, shards))
            mlflow.set_tags(
                safe_tags(
                    {resume.TAG_INIT_CHECKPOINT: init.checkpoint_uri, resume.TAG_INIT_VERSION: init.model_version}
                )
            )
        logger.info(
            "starting from %s",
            init.label if init else ("scratch: no champion yet" if cfg.init_from == "champion" else "scratch"),
        )
        request = resume.request_key(cfg, shards.dataset_digest)
        done = resume.find_completed(lineage.tracking_uri, lineage.experiment, request, init)
        if done is not None:
            mlflow.set_tags(
                safe_tags({resume.TAG_REUSED_FROM: done.train_run_id, TAG_CHECKPOINT_URI: done.checkpoint_uri})
            )
            logger.info("reusing finished training %s: %s", done.train_run_id, done.checkpoint_uri)
            return done
        key = resume.training_key(request, init)
        mlflow.set_tags({resume.TAG_TRAIN_REQUEST: request, resume.TAG_TRAIN_KEY: key})
        # sync context: the artifact's id, not a coroutine (Prefect's helpers are typed for both)
        progress = cast(
            UUID, create_progress_artifact(0.0, key="train-progress", description=f"train_fsdp: {cfg.steps} steps")
        )
        metrics_run = run_id  # where rank 0 logs the loss: a re-attached job keeps the run it was submitted with
        if cluster.config.job_server:
            result, metrics_run = train_as_job(
                cfg,
                shards,
                cluster.config,
                lineage,
                run_id,
                key,
                init.checkpoint_uri if init else "",
                logger,
                lambda step: update_progress_artifact(progress, min(100.0, 100.0 * step / cfg.steps)),
            )
        else:  # Ray Train blocks in fit(); run it beside this thread, which moves the progress bar from MLflow.
            with ThreadPoolExecutor(max_workers=1) as pool:
                future = pool.submit(
                    run_training,
                    cfg,
                    shards,
                    lineage.tracking_uri,
                    run_id,
                    f"train-{key}",
                    init.checkpoint_uri if init else "",
                    cluster.network_env,
                )
                while not wait([future], timeout=POLL_S).done:  # returns as soon as fit() does
                    step = logged_step(lineage.tracking_uri, run_id)
                    update_progress_artifact(progress, min(100.0, 100.0 * step / cfg.steps))
                result = future.result()
        update_progress_artifact(progress, 100.0)
        with tempfile.TemporaryDirectory() as tmp:
            mlflow.log_artifact(str(loss_curve_png(lineage.tracking_uri, metrics_run, Path(tmp) / "loss_curve.png")))
        mlflow.log_metrics({"final_loss": result.final_loss, "tokens_per_s": result.tokens_per_s})
        mlflow.set_tags(
            safe_tags(
                {
                    TAG_CHECKPOINT_URI: result.checkpoint_uri,
                    resume.TAG_RESUMED_FROM_STEP: _resumed_from(result.checkpoint_uri),
                }
            )
        )
        logger.info(
            "trained %d steps on %d workers: loss %.4f, %.0f tokens/s, checkpoint %s",
            result.step,
            result.world_size,
            result.final_loss,
            result.tokens_per_s,
            result.checkpoint_uri,
        )
        return result


def _resumed_from(checkpoint_uri: str) -> int:
    """The step the attempt that wrote the final checkpoint started from (0: it ran from the start)."""
    from infra import storage
    from training.checkpoint import manifest_name

    try:
        return int(json.loads(storage.read_bytes(storage.join(checkpoint_uri, manifest_name(0))))["resumed_from"])
    except (OSError, ValueError, KeyError):
        return 0
