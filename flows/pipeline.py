"""The shardline DAG: shard -> provision -> train -> validate -> promote -> canary, under one MLflow run tree."""
from __future__ import annotations

from typing import Literal

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from deployments.release_lock import release_lock
from flows import log_hygiene
from flows.config import PipelineConfig, check_no_credentials, check_remote_storage, check_serving
from infra import orphans
from infra.cluster import ClusterInfo, teardown
from infra.tracking import Lineage, close_run, open_parent_run, resolve_tracking_uri, stage_seconds
from tasks.canary import canary_deploy
from tasks.cluster import provision_cluster
from tasks.data import shard_dataset
from tasks.promote import promote_model
from tasks.train import train_fsdp
from tasks.validate import cached as validate_cached

FLOW_TIMEOUT_S = 72 * 3600  # every stage's own bound (tasks/retry.TIMEOUT_S) with their retries fits well inside


class PipelineSummary(BaseModel):
    """What one run produced and decided; `shardline run --json` prints this."""

    model_name: str
    model_version: str
    decision: Literal["first-champion", "promoted", "rejected", "registered"]
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


@flow(name="shardline", log_prints=True, timeout_seconds=FLOW_TIMEOUT_S)
def shardline_pipeline(config: PipelineConfig = PipelineConfig()) -> PipelineSummary:  # noqa: B008
    """Take a text corpus to a served model: shard, train with FSDP on Ray, validate, register, canary.

    Args:
        config: one section per stage (data, cluster, train, validation, registry, canary); the same model
            as the TOML config file. Every field has a description in the form.
    """
    log_hygiene.install()  # masked credentials, one-line expected failures (also when a worker runs the flow)
    orphans.record_children()  # e.g. Prefect's temporary server: a rerun stops it if this process is killed
    check_no_credentials(config, "flow parameter")
    logger = get_run_logger()
    tracking_uri = resolve_tracking_uri(config.registry.tracking_uri)
    check_remote_storage(config, "flow parameter", tracking_uri)  # before anything is submitted to a remote cluster
    check_serving(config, "flow parameter")
    run_id, run_name = str(flow_run.id or "local"), str(flow_run.name or "shardline")
    lineage = Lineage(
        tracking_uri=tracking_uri,
        experiment=config.registry.experiment,
        parent_run_id=open_parent_run(tracking_uri, config.registry.experiment, run_id, run_name),
        flow_run_id=run_id,
    )
    logger.info("MLflow parent run %s (%s)", lineage.parent_run_id, tracking_uri.split("://")[0])

    cluster: ClusterInfo | None = None
    sharding = None
    ok = False
    try:
        if config.data.engine == "ray":  # the chunks run as tasks on the cluster: it comes first
            cluster = provision_cluster(config.cluster, lineage)
            shards = shard_dataset(config.data, lineage, cluster)
        else:  # independent: the corpus is sharded while Ray starts (on this thread, where Ray wants its driver)
            sharding = shard_dataset.submit(config.data, lineage)
            cluster = provision_cluster(config.cluster, lineage)
            shards = sharding.result()
        trained = train_fsdp(config.train, shards, cluster, lineage, config.registry.model_name)
        validated = validate_cached()(config.validation, config.train, trained, shards, lineage, config.registry)
        # one release at a time per model: a concurrent run waits here, then compares with the champion of then
        with release_lock(config.registry.model_name, tracking_uri, config.canary.lock_timeout_s) as lock:
            logger.info("holding the release lock of %s (%s)", config.registry.model_name, lock)
            promoted = promote_model(config.registry, validated, trained, shards, lineage)
            canary = canary_deploy(config.canary, config.serve, promoted, shards, cluster, config.registry, lineage)
        ok = True
    finally:
        if sharding is not None:
            sharding.wait()  # provisioning failed first: let the data stage finish, not leave it running
        teardown(cluster)
        close_run(tracking_uri, lineage.parent_run_id, ok)
        orphans.forget()

    if promoted.decision == "first-champion":
        decision, reason, champion = "first-champion", "no champion existed", promoted.version
    elif canary.decision in ("promoted", "rejected"):
        decision, reason = canary.decision, canary.reason
        champion = promoted.version if canary.decision == "promoted" else (promoted.champion_version or "")
    else:
        decision, reason, champion = "registered", canary.reason, promoted.champion_version or ""
    summary = PipelineSummary(
        model_name=promoted.model_name,
        model_version=promoted.version,
        decision=decision,
        reason=reason,
        champion_version=champion,
        val_bits_per_byte=validated.val_bits_per_byte,
        parent_run_id=lineage.parent_run_id,
        train_run_id=trained.train_run_id,
        dataset_digest=shards.dataset_digest,
        manifest_uri=shards.manifest_uri,
        checkpoint_uri=trained.checkpoint_uri,
        flow_run_id=run_id,
        endpoint_url=canary.endpoint_url,
        stage_seconds=stage_seconds(tracking_uri, lineage.parent_run_id),
    )
    logger.info("decision=%s version=%s champion=%s: %s", decision, promoted.version, champion, reason)
    return summary
