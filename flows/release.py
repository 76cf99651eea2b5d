"""Retrain and release from an existing shard set: provision -> train -> validate -> promote -> canary.

The data stage is skipped: the shard set named by its prefix (or manifest) is opened and verified as published.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from deployments.release_lock import release_lock
from flows.config import ConfigError, PipelineConfig, chat_template_of
from flows.run_context import shardline_run
from infra.names import TAG_DATASET_DIGEST, TAG_MANIFEST_URI, TAG_TOKENIZER_SHA256
from infra.tracking import Lineage, stage_run
from tasks.canary import canary_deploy
from tasks.cluster import provision_cluster
from tasks.promote import promote_model
from tasks.retry import flow_timeout_s, retry_unless
from tasks.train import train_fsdp
from tasks.validate import cached as validate_cached
from training.data import ShardSet

# Bounds, so a hung stage frees its concurrency slot instead of holding the deployment forever.
OPEN_TIMEOUT_S = 600
# a release trains, so it is bounded like the pipeline: one attempt of each stage it runs, with room
FLOW_TIMEOUT_S = flow_timeout_s(
    "provision_cluster", "train_fsdp", "validate_checkpoint", "promote_model", "canary_deploy", opened_s=OPEN_TIMEOUT_S
)
CANARY_TIMEOUT_S = 12 * 3600  # canary-version: provision and canary (6.5 h), and the release lock's wait (2 h)


def shard_set_prefix(uri: str) -> str:
    """The shard-set prefix for a prefix or a manifest URI ('.../DIGEST' or '.../DIGEST/manifest.json')."""
    uri = uri.strip().rstrip("/")
    if not uri:
        raise ConfigError("shard_set is empty; give the shard set's prefix or manifest URI")
    return uri.removesuffix("/manifest.json")


def unused_tokenizer(config: PipelineConfig, shards: ShardSet) -> str:
    """One warning line when the config's `[tokenizer]` section is not the default and the shard set's ids (which a
    release trains on regardless) may not be what it asks for; "" for the default, or bytes asked of a text set."""
    wanted = config.tokenizer
    if wanted == type(wanted)() or (wanted.kind == "bytes" and not shards.tokenizer_sha256):
        return ""
    if wanted.kind == "train" and shards.tokenizer_sha256 and wanted.vocab_size == shards.vocab_size:
        return ""  # a BPE of that size, trained when the set was built
    if wanted.kind == "file" and shards.tokenizer_sha256 and _fingerprint_of(wanted.path) == shards.tokenizer_sha256:
        return ""  # the set's own tokenizer: its chat template (beside it) is the new version's
    held = (
        f"token ids of tokenizer {shards.tokenizer_sha256[:12]} ({shards.vocab_size} ids)"
        if shards.tokenizer_sha256
        else "bytes"
    )
    return (
        f"tokenizer: kind={wanted.kind!r} is not used: shard set {shards.dataset_digest[:12]} holds {held}, which "
        "this release trains on (build a set with that tokenizer with `shardline shard` to train on its ids)"
    )


def _fingerprint_of(path: str) -> str:
    """The fingerprint of the tokenizer.json at `path`; "" when it cannot be read (the warning then stands)."""
    from training import tokenizer as tk

    try:
        return tk.fingerprint(tk.load(path))
    except tk.TokenizerError:
        return ""


@task(
    name="open_shard_set",
    retries=2,
    retry_delay_seconds=5,
    # a mistyped or empty shard_set (ValueError), a set that is not published or fails verification (DataError)
    # and a bad manifest or tokenizer (ValidationError, TokenizerError: ValueErrors too) fail the same way every
    # time; storage outages (StorageError, an OSError) and tracking hiccups are worth retrying
    retry_condition_fn=retry_unless(ValueError),
    cache_policy=NO_CACHE,
    timeout_seconds=OPEN_TIMEOUT_S,
)
def open_shard_set(uri: str, lineage: Lineage) -> ShardSet:
    """Open and verify a published shard set; it is logged as the data child run's dataset input (as the data
    stage does: a version's lineage checks it), and its digest and manifest (and a set of token ids' tokenizer
    fingerprint) are tagged on that run."""
    import mlflow

    from training.data.publish import load_shard_set
    from training.data.tracking import log_dataset

    with stage_run(lineage, "shard_dataset") as run_id:
        shards = load_shard_set(shard_set_prefix(uri))
        log_dataset(shards)
        mlflow.set_tags(
            {
                TAG_DATASET_DIGEST: shards.dataset_digest,
                TAG_MANIFEST_URI: shards.manifest_uri,
                "shardline.reused_shard_set": "true",
            }
            | ({TAG_TOKENIZER_SHA256: shards.tokenizer_sha256} if shards.tokenizer_sha256 else {})
        )
    return shards.model_copy(update={"data_run_id": run_id})


@flow(name="shardline-release", log_prints=True, timeout_seconds=FLOW_TIMEOUT_S)
def release_from_shards(shard_set: str, config: PipelineConfig = PipelineConfig()) -> dict:  # noqa: B008 - Prefect's form default; never mutated
    """Train a new version on an existing shard set and release it through the canary.

    Args:
        shard_set: prefix ({data.output}/{digest}) or manifest URI of a published shard set.
        config: the pipeline config; its `data` and `tokenizer` sections are not used (the set's ids are what
            they are: its own tokenizer travels with it), but for the tokenizer's chat template, which the new
            version carries (`tokenizer.chat_template`, or the one beside `tokenizer.path`); a `tokenizer` section
            that asks for other ids is logged as a warning.
    """
    with shardline_run(config, "shardline-release", shard_set=shard_set) as run:
        shards = open_shard_set(shard_set, run.lineage)
        if warning := unused_tokenizer(config, shards):
            run.logger.warning(warning)
        # read and parsed before anything trains; not looked for beside a tokenizer.path the set's ids are not of
        chat_template = chat_template_of(config, "flow parameter", run.logger.warning, discover=not warning)
        run.cluster = provision_cluster(config.cluster, run.lineage)
        trained = train_fsdp(config.train, shards, run.cluster, run.lineage, config.registry.model_name)
        validated = validate_cached()(
            config.validation, config.train, trained, shards, run.lineage, config.registry, chat_template
        )
        with release_lock(config.registry.model_name, run.tracking_uri, config.canary.lock_timeout_s):
            promoted = promote_model(config.registry, validated, trained, shards, run.lineage)
            canary = canary_deploy(
                config.canary, config.serve, promoted, shards, run.cluster, config.registry, run.lineage
            )
    run.logger.info("version %s of %s: %s (%s)", promoted.version, promoted.model_name, canary.decision, canary.reason)
    return {
        "model_name": promoted.model_name,
        "model_version": promoted.version,
        "decision": canary.decision,
        "reason": canary.reason,
        "dataset_digest": shards.dataset_digest,
        "parent_run_id": run.lineage.parent_run_id,
    }
