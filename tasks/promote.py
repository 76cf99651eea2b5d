"""promote_model: register the validated model as a new version, tag its lineage, set its aliases."""

from __future__ import annotations

import mlflow
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from deployments.config import RegistryConfig
from deployments.registry import (
    CHALLENGER,
    CHAMPION,
    AliasChanged,
    PromotionResult,
    apply_promotion,
    clear_challenger,
    client_for,
    decide_promotion,
    read_aliases,
    register_version,
    version_tags,
)
from infra.names import (
    TAG_CHAT_TEMPLATE_SHA256,
    TAG_CHAT_TOKENS,
    TAG_DATASET_DIGEST,
    TAG_MODEL_URI,
    TAG_MODEL_VERSION,
    TAG_REJECTED,
    TAG_TOKENIZER_SHA256,
    TAG_TRAIN_RUN_ID,
    TAG_VALIDATION_RUN_ID,
)
from infra.tracking import Lineage, flat_params, stage_run
from tasks.retry import TIMEOUT_S, retry_unless
from training.chat_template import tokens_tag
from training.data import ShardSet
from training.evaluate import ValidationResult
from training.trainer import TrainResult


@task(
    name="promote_model",
    timeout_seconds=TIMEOUT_S["promote_model"],
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless(AliasChanged, ValueError),
)
def promote_model(
    cfg: RegistryConfig, validated: ValidationResult, trained: TrainResult, shards: ShardSet, lineage: Lineage
) -> PromotionResult:
    """Register the validated model; alias it `challenger`, and `champion` too when there is none yet.

    A rerun that reuses a version an earlier canary rejected (the same checkpoint: training was reused) gets that
    version back with decision "rejected": no alias moves to it (a `challenger` one left on it is removed) and its
    lineage tags are left as they were when it was judged. Any other version reused by its checkpoint keeps the
    lineage of the logged model it was registered from; this run is recorded as its revalidation (register_version).

    Args:
        cfg: the registered model's name.
        validated: the validation stage's result; its model_uri is what gets registered.
        trained: the training run the version is attributed to (the version's run_id).
        shards: the dataset the model was trained on (its digest is tagged on the version).
        lineage: the flow run's MLflow run tree.
    """
    logger = get_run_logger()
    with stage_run(lineage, "promote_model"):
        mlflow.log_params(flat_params("registry", cfg))
        client = client_for(lineage.tracking_uri)
        tags = version_tags(
            dataset_digest=shards.dataset_digest,
            flow_run_id=lineage.flow_run_id,
            train_run_id=trained.train_run_id,
            checkpoint_uri=trained.checkpoint_uri,
            validation_run_id=validated.validation_run_id,
            model_uri=validated.model_uri,
            data_run_id=shards.data_run_id,
            manifest_uri=shards.manifest_uri,
            extra={
                "shardline.val_bits_per_byte": f"{validated.val_bits_per_byte:.6f}",
                TAG_TOKENIZER_SHA256: shards.tokenizer_sha256,  # "" (bytes) is left out; the model carries the file
                TAG_CHAT_TEMPLATE_SHA256: validated.chat_template_sha256,  # likewise: none is left out
                TAG_CHAT_TOKENS: tokens_tag(validated.chat_tokens),  # what that template sees ('' left out)
            },
        )
        version = register_version(client, cfg.model_name, validated.model_uri, trained.train_run_id, tags)
        stage_tags = {
            TAG_MODEL_VERSION: version,
            TAG_MODEL_URI: validated.model_uri,
            TAG_TRAIN_RUN_ID: trained.train_run_id,
            TAG_VALIDATION_RUN_ID: validated.validation_run_id,
            TAG_DATASET_DIGEST: shards.dataset_digest,
        }
        rejected = (client.get_model_version(cfg.model_name, version).tags or {}).get(TAG_REJECTED)
        if rejected:  # judged before: not to be canaried (or served) again
            clear_challenger(client, cfg.model_name, version)
            result = PromotionResult(
                model_name=cfg.model_name,
                version=version,
                decision="rejected",
                champion_version=read_aliases(client, cfg.model_name).get(CHAMPION),
                challenger_version=version,
                reason=f"version {version} was already rejected by a canary ({rejected}); not made '{CHALLENGER}'",
            )
            mlflow.log_dict(result.model_dump(mode="json"), "promotion_decision.json")
            mlflow.set_tags(stage_tags | {"shardline.promotion": "rejected"})
            logger.warning("%s version %s: %s", cfg.model_name, version, result.reason)
            return result
        decision = decide_promotion(cfg.model_name, version, read_aliases(client, cfg.model_name))
        mlflow.log_dict(decision.model_dump(mode="json"), "promotion_decision.json")
        mlflow.set_tags(stage_tags | {"shardline.promotion": decision.verdict})
        result = apply_promotion(client, decision)
        logger.info("%s version %s: %s", cfg.model_name, version, decision.reason)
        return result
