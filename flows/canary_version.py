"""Canary one registered version against the current champion, on the held-out shards it was trained with."""

from __future__ import annotations

from typing import Any

from prefect import flow

from deployments.registry import CHAMPION, PromotionResult, client_for, read_aliases
from deployments.release_lock import release_lock
from flows.config import ConfigError, PipelineConfig
from flows.release import CANARY_TIMEOUT_S, open_shard_set
from flows.run_context import shardline_run
from infra.names import TAG_MANIFEST_URI
from tasks.canary import canary_deploy
from tasks.cluster import provision_cluster


def challenge(model_name: str, version: str, aliases: dict[str, str]) -> PromotionResult:
    """The promotion result the canary expects, for an existing version against today's champion.

    Raises:
        ConfigError: no champion to compare against, or the version is the champion already (the caller's
            argument: one line, not a traceback).
    """
    champion = aliases.get(CHAMPION)
    if champion is None:
        raise ConfigError(f"{model_name} has no champion; there is nothing to canary version {version} against")
    if champion == version:
        raise ConfigError(f"{model_name} version {version} is the champion already")
    return PromotionResult(
        model_name=model_name,
        version=version,
        decision="challenger",
        champion_version=champion,
        challenger_version=version,
    )


def held_out_manifest(client: Any, model_name: str, version: str) -> str:
    """The manifest of the shard set `version` of `model_name` was trained on: its held-out shards are the canary's.

    A version that is not a number, or that the registry does not have, is the caller's argument gone wrong: a
    one-line ConfigError (flows.log_hygiene), not a traceback from MLflow. Other registry errors (a server that
    did not answer) stay what they are.

    Raises:
        ConfigError: `version` is not a version number, or `model_name` has no such version.
        ConfigError: the version has no manifest tag (not one the pipeline registered).
    """
    from mlflow.exceptions import MlflowException

    if not version.isdigit():
        raise ConfigError(f"version {version!r} of model {model_name!r}: not a version number")
    try:
        mv = client.get_model_version(model_name, version)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise ConfigError(f"model {model_name!r} has no version {version}") from None
    manifest = str((mv.tags or {}).get(TAG_MANIFEST_URI, ""))
    if not manifest:
        raise ConfigError(
            f"{model_name} version {version} has no {TAG_MANIFEST_URI} tag; its held-out shards are unknown"
        )
    return manifest


@flow(name="shardline-canary", log_prints=True, timeout_seconds=CANARY_TIMEOUT_S)
def canary_version(version: str, config: PipelineConfig = PipelineConfig()) -> dict:  # noqa: B008 - Prefect's form default; never mutated
    """Ramp traffic from the champion to `version` and promote it or roll it back, by the canary's gates.

    Args:
        version: the registered model version (of `config.registry.model_name`) to canary.
        config: the pipeline config; its `registry`, `cluster` and `canary` sections are used.
    """
    name = config.registry.model_name
    with shardline_run(config, "shardline-canary", version=version) as run:
        client = client_for(run.tracking_uri)
        shards = open_shard_set(held_out_manifest(client, name, str(version)), run.lineage)
        run.cluster = provision_cluster(config.cluster, run.lineage)
        # the champion is read under the release lock: another release may move it while this one waits
        with release_lock(name, run.tracking_uri, config.canary.lock_timeout_s):
            promoted = challenge(name, str(version), read_aliases(client, name))
            canary = canary_deploy(
                config.canary, config.serve, promoted, shards, run.cluster, config.registry, run.lineage
            )
    run.logger.info("version %s of %s: %s (%s)", version, name, canary.decision, canary.reason)
    return {
        "model_name": name,
        "model_version": str(version),
        "decision": canary.decision,
        "reason": canary.reason,
        "parent_run_id": run.lineage.parent_run_id,
    }
