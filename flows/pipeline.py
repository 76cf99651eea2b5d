"""The shardline DAG: shard -> provision -> train -> validate -> promote -> canary, under one MLflow run tree."""

from __future__ import annotations

from typing import Literal

from prefect import flow
from pydantic import BaseModel, Field

from deployments.canary_records import CanaryResult
from deployments.registry import PromotionResult
from deployments.release_lock import release_lock
from flows.config import PipelineConfig, chat_template_of, check_tokenizer_fits
from flows.run_context import shardline_run
from infra.tracking import stage_seconds
from tasks.canary import canary_deploy
from tasks.cluster import provision_cluster
from tasks.data import shard_dataset
from tasks.promote import promote_model
from tasks.retry import TIMEOUT_S, flow_timeout_s
from tasks.train import train_fsdp
from tasks.validate import cached as validate_cached

FLOW_TIMEOUT_S = flow_timeout_s(*TIMEOUT_S)  # one attempt of every stage (tasks/retry.TIMEOUT_S), with room
Decision = Literal["first-champion", "promoted", "rejected", "inconclusive", "aborted", "registered"]


class PipelineSummary(BaseModel):
    """What one run produced and decided; `shardline run --json` prints this."""

    model_name: str
    model_version: str
    decision: Decision
    reason: str
    champion_version: str
    val_bits_per_byte: float
    parent_run_id: str
    train_run_id: str
    dataset_digest: str
    manifest_uri: str
    checkpoint_uri: str
    flow_run_id: str
    endpoint_url: str = ""
    stage_seconds: dict[str, float] = Field(default_factory=dict, description="Wall seconds per stage run.")


def run_outcome(promoted: PromotionResult, canary: CanaryResult) -> tuple[Decision, str, str]:
    """The run's (decision, reason, champion version afterwards) from the promotion and the canary stages."""
    if promoted.decision == "first-champion":  # no champion existed, or it is this version already (a rerun)
        return "first-champion", promoted.reason or "no champion existed", promoted.version
    if promoted.decision == "rejected":  # a rerun reused a version an earlier canary rejected: no alias moved
        return "rejected", promoted.reason, promoted.champion_version or ""
    if canary.decision in ("promoted", "rejected", "inconclusive", "aborted"):  # "skipped": registered only
        champion = promoted.version if canary.decision == "promoted" else (promoted.champion_version or "")
        return canary.decision, canary.reason, champion
    return "registered", canary.reason, promoted.champion_version or ""


@flow(name="shardline", log_prints=True, timeout_seconds=FLOW_TIMEOUT_S)
def shardline_pipeline(config: PipelineConfig = PipelineConfig()) -> PipelineSummary:  # noqa: B008 - Prefect's form default; never mutated
    """Take a text corpus to a served model: shard, train with FSDP on Ray, validate, register, canary.

    Args:
        config: one section per stage (data, cluster, train, validation, registry, canary); the same model
            as the TOML config file. Every field has a description in the form.
    """
    with shardline_run(config, "shardline") as run:
        chat_template = chat_template_of(config, "flow parameter", run.logger.warning)  # before anything trains
        check_tokenizer_fits(config, "flow parameter")  # a tokenizer file's ids, before the corpus is tokenized
        if config.data.engine == "ray":  # the chunks run as tasks on the cluster: it comes first
            run.cluster = provision_cluster(config.cluster, run.lineage)
            shards = shard_dataset(config.data, run.lineage, run.cluster, config.tokenizer)
        else:  # independent: the corpus is sharded while Ray starts (on this thread, where Ray wants its driver)
            sharding = shard_dataset.submit(config.data, run.lineage, tokenizer=config.tokenizer)
            try:
                run.cluster = provision_cluster(config.cluster, run.lineage)
            finally:
                sharding.wait()  # provisioning failed first: let the data stage finish, not leave it running
            shards = sharding.result()
        trained = train_fsdp(config.train, shards, run.cluster, run.lineage, config.registry.model_name)
        validated = validate_cached()(
            config.validation, config.train, trained, shards, run.lineage, config.registry, chat_template
        )
        # one release at a time per model: a concurrent run waits here, then compares with the champion of then
        with release_lock(config.registry.model_name, run.tracking_uri, config.canary.lock_timeout_s) as lock:
            run.logger.info("holding the release lock of %s (%s)", config.registry.model_name, lock)
            promoted = promote_model(config.registry, validated, trained, shards, run.lineage)
            canary = canary_deploy(
                config.canary, config.serve, promoted, shards, run.cluster, config.registry, run.lineage
            )

    decision, reason, champion = run_outcome(promoted, canary)
    summary = PipelineSummary(
        model_name=promoted.model_name,
        model_version=promoted.version,
        decision=decision,
        reason=reason,
        champion_version=champion,
        val_bits_per_byte=validated.val_bits_per_byte,
        parent_run_id=run.lineage.parent_run_id,
        train_run_id=trained.train_run_id,
        dataset_digest=shards.dataset_digest,
        manifest_uri=shards.manifest_uri,
        checkpoint_uri=trained.checkpoint_uri,
        flow_run_id=run.lineage.flow_run_id,
        endpoint_url=canary.endpoint_url,
        stage_seconds=stage_seconds(run.tracking_uri, run.lineage.parent_run_id),
    )
    run.logger.info("decision=%s version=%s champion=%s: %s", decision, promoted.version, champion, reason)
    return summary
