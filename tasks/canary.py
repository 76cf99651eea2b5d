"""canary_deploy: release the registered version into the live endpoint (ramp, judge, promote or roll back)."""

from __future__ import annotations

from itertools import islice

import mlflow
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from deployments.canary_records import CanaryResult, result_of, skipped, steps_table
from deployments.config import CanaryConfig, RegistryConfig, ServeConfig
from deployments.endpoint import reconcile
from deployments.registry import (
    CHAMPION,
    TAG_REJECTED,
    AliasChanged,
    PromotionResult,
    clear_challenger,
    client_for,
    read_aliases,
)
from deployments.rollout import CanaryDecided, describe_skipped, log_decision, run_rollout, skip_reason
from deployments.serving import api_token, replica_runtime_env, token_digest
from infra.cluster import ClusterInfo
from infra.names import TAG_CLUSTER_ADDRESS, TAG_DATASET_DIGEST, TAG_MODEL_VERSION, TAG_TRAIN_RUN_ID
from infra.tracking import Lineage, flat_params, stage_run
from tasks.retry import TIMEOUT_S, retry_unless
from training.data import ShardSet
from training.data.loader import iter_texts

HELD_OUT_TEXTS = 256  # probe bodies are drawn from the first this-many validation texts


@task(
    name="canary_deploy",
    timeout_seconds=TIMEOUT_S["canary_deploy"],
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    cache_policy=NO_CACHE,
    retry_condition_fn=retry_unless(CanaryDecided, AliasChanged, ValueError),
)
def canary_deploy(
    cfg: CanaryConfig,
    serve: ServeConfig,
    promoted: PromotionResult,
    shards: ShardSet,
    cluster: ClusterInfo,
    registry: RegistryConfig,
    lineage: Lineage,
) -> CanaryResult:
    """Serve the champion on the live endpoint; ramp a challenger on live traffic, then promote or roll back.

    Args:
        cfg: ramp steps, baking, probe traffic and the gates.
        serve: the live endpoint (address, limits, auth).
        promoted: the promotion stage's result: the challenger version and the champion it challenges.
        shards: the held-out shards probe traffic is drawn from.
        cluster: the Ray cluster (already connected) the endpoint runs on.
        registry: the registered model.
        lineage: the flow run's MLflow run tree.
    """
    logger = get_run_logger()
    name, challenger, champion = registry.model_name, promoted.challenger_version, promoted.champion_version
    with stage_run(lineage, "canary_deploy") as stage_run_id:
        client = client_for(lineage.tracking_uri)
        mlflow.set_tags(
            {
                TAG_MODEL_VERSION: challenger,
                TAG_DATASET_DIGEST: shards.dataset_digest,
                TAG_TRAIN_RUN_ID: client.get_model_version(name, challenger).run_id or "",
                TAG_CLUSTER_ADDRESS: cluster.address,
                "shardline.champion_version": champion or "",  # "": a first champion has none
            }
        )
        mlflow.log_params(flat_params("canary", cfg) | flat_params("serve", serve))
        why_not = skip_reason(client, cfg, name, champion, challenger)
        if why_not:
            describe_skipped(client, name, challenger, why_not)  # a first champion: no challenger alias; described
            if TAG_REJECTED in (client.get_model_version(name, challenger).tags or {}):
                clear_challenger(client, name, challenger)  # rejected before (a rerun reused it): no challenger
        if why_not and not serve.enabled:  # the config check made sure the canary is off too
            decision = skipped(name, challenger, champion, f"{why_not}; serve.enabled is false: no endpoint")
            log_decision(decision)
            logger.info("canary skipped (%s); serve.enabled is false: no endpoint started or changed", why_not)
            return result_of(decision, 0, champion=read_aliases(client, name).get(CHAMPION, str(champion or "")))
        token, env = api_token(serve), replica_runtime_env(cluster.mode)
        if why_not:
            served = reconcile(serve, name, lineage.tracking_uri, token_digest(token), env)
            decision = skipped(name, challenger, champion, why_not)
            log_decision(decision)
            logger.info("canary skipped (%s); endpoint %s: %s", why_not, served.url, served.action)
            return result_of(decision, 0, champion=served.champion, endpoint_url=served.url)
        texts = [text for _, text in islice(iter_texts(shards.val_shards), HELD_OUT_TEXTS)]
        result = run_rollout(
            cfg,
            serve,
            name,
            str(champion),
            challenger,
            lineage.tracking_uri,
            texts,
            token,
            token_digest(token),
            env,
            log_decision=log_decision,
            run_id=stage_run_id,
            on_step=lambda i, s: logger.info(
                "step %d%%: %d requests (%d probe), %d paired in %.1f s: %s",
                s.percent,
                s.requests,
                s.probe_requests,
                s.paired,
                s.seconds,
                "; ".join(s.failures) or ("inconclusive: " + "; ".join(s.inconclusive) if s.inconclusive else "passed"),
            ),
        )
        logger.info(
            "canary %s: %s; endpoint %s serves v%s",
            result.decision,
            result.reason,
            result.endpoint_url,
            result.champion_version,
        )
        if TaskRunContext.get() is not None:  # an artifact needs a task run (not so under task.fn() in tests)
            create_table_artifact(
                steps_table(result.steps),
                key="canary-decision",
                description=f"canary {result.decision}: {result.reason}",
            )
        return result
