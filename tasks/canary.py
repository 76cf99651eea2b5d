"""canary_deploy: ramp the challenger against the champion on Ray Serve; promote it or roll it back."""
from __future__ import annotations

from itertools import islice

import mlflow
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from deployments.canary import (
    CanaryDecided, CanaryResult, log_decision, result_of, run_canary, skip_reason, skipped, steps_table,
)
from deployments.config import CanaryConfig, RegistryConfig
from deployments.registry import CHAMPION, AliasChanged, PromotionResult, client_for, read_aliases
from infra.cluster import ClusterInfo
from infra.tracking import (
    TAG_CLUSTER_ADDRESS, TAG_DATASET_DIGEST, TAG_MODEL_VERSION, TAG_TRAIN_RUN_ID, Lineage,
    flat_params, stage_run,
)
from tasks.retry import retry_unless
from training.data import ShardSet
from training.data.loader import iter_texts

HELD_OUT_TEXTS = 256  # request bodies are drawn from the first this-many validation texts


@task(name="canary_deploy", retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2),
      cache_policy=NO_CACHE, retry_condition_fn=retry_unless(CanaryDecided, AliasChanged, ValueError))
def canary_deploy(cfg: CanaryConfig, promoted: PromotionResult, shards: ShardSet, cluster: ClusterInfo,
                  registry: RegistryConfig, lineage: Lineage) -> CanaryResult:
    """Serve champion and challenger behind a weighted router, ramp traffic over HTTP, then promote or roll back.

    Args:
        cfg: ramp steps, requests per step and the gates.
        promoted: the promotion stage's result: the challenger version and the champion it challenges.
        shards: the held-out shards the requests are drawn from.
        cluster: the Ray cluster (already initialised in this process) Serve runs on.
        registry: the registered model.
        lineage: the flow run's MLflow run tree.

    Returns:
        The decision ("promoted", "rejected" or "skipped"), its reason and the per-step metrics.
    """
    logger = get_run_logger()
    with stage_run(lineage, "canary_deploy"):
        client = client_for(lineage.tracking_uri)
        challenger_run = client.get_model_version(registry.model_name, promoted.challenger_version).run_id
        mlflow.set_tags({TAG_MODEL_VERSION: promoted.challenger_version, TAG_DATASET_DIGEST: shards.dataset_digest,
                         TAG_TRAIN_RUN_ID: challenger_run or "", TAG_CLUSTER_ADDRESS: cluster.address,
                         "shardline.champion_version": str(promoted.champion_version)})
        mlflow.log_params(flat_params("canary", cfg))
        why_not = skip_reason(client, cfg, registry.model_name, promoted.champion_version, promoted.challenger_version)
        if why_not:
            decision = skipped(registry.model_name, promoted.challenger_version, promoted.champion_version, why_not)
            log_decision(decision)
            logger.info("canary skipped: %s", why_not)
            return result_of(decision, champion=read_aliases(client, registry.model_name).get(CHAMPION))
        texts = [text for _, text in islice(iter_texts(shards.val_shards), HELD_OUT_TEXTS)]
        result = run_canary(cfg, registry.model_name, promoted.champion_version, promoted.challenger_version,
                            texts, lineage.tracking_uri, on_step=lambda i, s: logger.info(
                                "step %d%%: %s", s.percent, "; ".join(s.failures) or "passed"),
                            log=log_decision)
        logger.info("canary %s: %s", result.decision, result.reason)
        if TaskRunContext.get() is not None:  # an artifact needs a task run (not so under task.fn() in tests)
            create_table_artifact(steps_table(result.steps), key="canary-decision",
                                  description=f"canary {result.decision}: {result.reason}")
        return result
