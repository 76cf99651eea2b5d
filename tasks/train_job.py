"""train_fsdp on a remote cluster: the training runs as a Ray Job, this process records, follows and re-attaches.

Called by tasks.train inside the stage's MLflow run; not a task of its own (the retries, timeout and lineage are
train_fsdp's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlflow

from infra import jobs
from infra.config import ClusterConfig
from infra.network import network_env
from infra.tracking import Lineage
from training.config import TrainConfig
from training.data import ShardSet
from training.trainer import TrainResult, logged_step, storage_root

POLL_S = 2.0


def train_as_job(
    cfg: TrainConfig,
    shards: ShardSet,
    cluster: ClusterConfig,
    lineage: Lineage,
    run_id: str,
    train_key: str,
    init_checkpoint: str,
    logger: Any,
    on_progress: Callable[[int], object],
) -> tuple[TrainResult, str]:
    """Train through the cluster's job server; (the result, the MLflow run the job logs its metrics to).

    The job of the same training key still running (or already succeeded) on this cluster is re-attached to; else
    a new job is submitted, its id tagged on the training run first, so a follower killed at any point leaves a
    record a rerun finds. Cancelling or interrupting the stage stops the job.

    Raises:
        ValueError: a config problem found before submitting (global batch).
        infra.jobs.JobFailed: the job ended FAILED or STOPPED (a retry submits a new one, which resumes from the
            training's checkpoints: the Ray Train run is named by the training key).
    """
    from training.config import check_global_batch

    check_global_batch(cfg, cfg.workers)
    storage = storage_root(cfg)
    client = jobs.job_client(cluster.address)
    job_id = jobs.reattachable(
        client, jobs.recorded_job_ids(lineage.tracking_uri, lineage.experiment, train_key, cluster.address)
    )
    if job_id:
        job_run = (client.get_job_info(job_id).metadata or {}).get(jobs.TAG_JOB_TRAIN_RUN_ID, run_id)
        mlflow.set_tags({jobs.TAG_RAY_JOB_ID: job_id, jobs.TAG_JOB_TRAIN_RUN_ID: job_run})
        logger.info("re-attached to Ray job %s of this training (it logs to MLflow run %s)", job_id, job_run)
    else:
        job_id, job_run = jobs.new_job_id(train_key), run_id
        # recorded before submitting: a follower killed right after submit_job is found again by its rerun
        mlflow.set_tags({jobs.TAG_RAY_JOB_ID: job_id, jobs.TAG_JOB_TRAIN_RUN_ID: job_run})
        folder = jobs.job_folder(storage, job_id)
        inputs = {
            "train": cfg.model_copy(update={"storage_path": storage}).model_dump(),
            "shards": shards.model_dump(),
            "tracking_uri": lineage.tracking_uri,
            "train_run_id": run_id,
            "run_name": f"train-{train_key}",
            "init_checkpoint": init_checkpoint,
            "result_uri": f"{folder}/result.json",
            "worker_env": network_env(cluster.network, cluster.network_env),
        }
        jobs.submit(
            client,
            cluster,
            job_id,
            inputs,
            storage,
            metadata={"shardline.train_key": train_key, jobs.TAG_JOB_TRAIN_RUN_ID: run_id},
        )
        logger.info("submitted training as Ray job %s to %s", job_id, cluster.address)
    with jobs.stopped_when_interrupted(client, job_id, logger.warning):
        jobs.follow(
            client,
            job_id,
            lambda line: logger.info("[%s] %s", job_id, line),
            lambda: on_progress(logged_step(lineage.tracking_uri, job_run)),
            POLL_S,
        )
    result = TrainResult.model_validate(jobs.read_result(storage, job_id))
    return result.model_copy(update={"train_run_id": run_id}), job_run
