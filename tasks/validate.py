"""validate_checkpoint: verify the DCP checkpoint, gate on held-out bits per byte, log the servable model."""
from __future__ import annotations

import mlflow
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from infra.tracking import TAG_CHECKPOINT_URI, TAG_MODEL_URI, TAG_TRAIN_RUN_ID, Lineage, flat_params, stage_run
from tasks.retry import retry_unless
from training.checkpoint import CheckpointError
from training.config import TrainConfig, ValidationConfig
from training.data import ShardSet
from training.evaluate import GateFailed, ValidationResult, evaluate_checkpoint, log_servable_model
from training.trainer import TrainResult


@task(name="validate_checkpoint", retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2),
      cache_policy=NO_CACHE, retry_condition_fn=retry_unless(GateFailed, CheckpointError))
def validate_checkpoint(cfg: ValidationConfig, train_cfg: TrainConfig, trained: TrainResult, shards: ShardSet,
                        lineage: Lineage) -> ValidationResult:
    """Load the checkpoint without a process group, gate on validation bits per byte, log the model.

    Args:
        cfg: the gate (max bits per byte) and how much held-out text to evaluate.
        train_cfg: the model that was trained (factory and sizes).
        trained: the training stage's result: checkpoint URI and run id.
        shards: the shard set; its validation shards are the held-out text.
        lineage: the flow run's MLflow run tree.

    Raises:
        GateFailed: bits per byte above validation.max_bits_per_byte (not retried).
        CheckpointError: the checkpoint is incomplete, corrupt or non-finite (not retried).
    """
    logger = get_run_logger()
    with stage_run(lineage, "validate_checkpoint") as run_id:
        mlflow.set_tags({TAG_TRAIN_RUN_ID: trained.train_run_id, TAG_CHECKPOINT_URI: trained.checkpoint_uri})
        mlflow.log_params(flat_params("validation", cfg))
        model, bpb = evaluate_checkpoint(trained.checkpoint_uri, train_cfg, shards.val_shards, cfg.batch_size,
                                         cfg.eval_batches)
        mlflow.log_metric("val_bits_per_byte", bpb)
        passed = bpb <= cfg.max_bits_per_byte
        logger.info("val bits/byte %.4f (gate %.4f): %s", bpb, cfg.max_bits_per_byte, "pass" if passed else "FAIL")
        if not passed:
            raise GateFailed(f"val_bits_per_byte {bpb:.4f} > validation.max_bits_per_byte {cfg.max_bits_per_byte}")
        model_uri = log_servable_model(model, train_cfg.seq_len)
        mlflow.set_tag(TAG_MODEL_URI, model_uri)
        return ValidationResult(validation_run_id=run_id, checkpoint_uri=trained.checkpoint_uri,
                                val_bits_per_byte=bpb, model_uri=model_uri, seq_len=train_cfg.seq_len, passed=True)
