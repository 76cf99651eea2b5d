"""Prefect task of stage 1: shard the corpus (content-addressed, so reruns are cache hits) and record lineage."""

from __future__ import annotations

import logging
import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.tasks import exponential_backoff

from infra import storage
from infra.cluster import ClusterInfo
from infra.names import (
    TAG_CLUSTER_ADDRESS,
    TAG_DATASET_DIGEST,
    TAG_MANIFEST_URI,
    TAG_TOKENIZER_SHA256,
    TAG_TOKENIZER_TRAINED_ON,
)
from infra.tracking import Lineage, flat_params, safe_tags, stage_run
from tasks.retry import TIMEOUT_S, retry_unless
from training.data import DataError, ShardSet, build_shards
from training.data.config import DataConfig
from training.tokenizer import TokenizerConfig, TokenizerError


@task(
    name="shard_dataset",
    timeout_seconds=TIMEOUT_S["shard_dataset"],
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
    retry_jitter_factor=0.5,
    # Bad input and a failed quality gate fail the same way every time; storage outages are worth retrying.
    retry_condition_fn=retry_unless(DataError, TokenizerError),
    cache_policy=NO_CACHE,  # idempotence is the content-addressed output, not Prefect's cache
)
def shard_dataset(
    cfg: DataConfig,
    lineage: Lineage,
    cluster: ClusterInfo | None = None,
    tokenizer: TokenizerConfig | None = None,
) -> ShardSet:
    """Read the corpus, split it, write validated WebDataset shards and publish them under their digest.

    With a tokenizer other than bytes, every record also carries its token ids (training.data.tokenized): the
    tokenizer.json is logged to the stage's run as `tokenizer/tokenizer.json`, its fingerprint is the
    `shardline.tokenizer_sha256` tag, and a trained BPE's text set is `shardline.tokenizer_trained_on`.

    Args:
        cfg: the `data` section: source, output, split, shard limits, parallelism and the bad-input policies.
        lineage: the flow run's MLflow parent run; this stage logs into its `shard_dataset` child run.
        cluster: the Ray cluster the chunks run on when data.engine='ray' (this process is its driver).
        tokenizer: the `tokenizer` section; None or kind='bytes' builds the text set only.
    """
    import mlflow

    from training.data.build import check_locations
    from training.data.quality import QualityError
    from training.data.tokenized import build_tokenized
    from training.data.tracking import log_dataset

    try:
        logger = get_run_logger()
    except MissingContextError:  # called as shard_dataset.fn(...) outside a run, e.g. from a REPL or a unit test
        logger = logging.getLogger("shardline.data")
    with stage_run(lineage, "shard_dataset") as run_id:
        check_locations(cfg)  # a URI with credentials in it must fail before the config is logged
        tok_cfg = tokenizer if tokenizer is not None and tokenizer.kind != "bytes" else None
        if tok_cfg is not None:
            _check_tokenizer_path(tok_cfg.path)
        mlflow.log_params({**flat_params("data", cfg), **(_tokenizer_params(tok_cfg) if tok_cfg else {})})
        if cluster is not None:
            mlflow.set_tag(TAG_CLUSTER_ADDRESS, cluster.address)
        start = time.monotonic()
        try:
            built = build_tokenized(cfg, tok_cfg) if tok_cfg is not None else None
            shards = built.shards if built is not None else build_shards(cfg)
        except QualityError as err:
            mlflow.log_dict(err.report, "data/validation.json")
            raise
        log_dataset(shards, cfg.storage_retries)
        mlflow.set_tags(safe_tags({TAG_DATASET_DIGEST: shards.dataset_digest, TAG_MANIFEST_URI: shards.manifest_uri}))
        if built is not None:
            # the set's own copy: the artifact is exactly the tokenizer its manifest names
            tokenizer_text = storage.read_bytes(shards.tokenizer_uri, cfg.storage_retries).decode("utf-8")
            mlflow.log_text(tokenizer_text, "tokenizer/tokenizer.json")
            mlflow.set_tags(
                {TAG_TOKENIZER_SHA256: shards.tokenizer_sha256}  # the set's own (its manifest and tokenizer.json)
                | ({TAG_TOKENIZER_TRAINED_ON: built.text_digest} if built.text_digest else {})
            )
            mlflow.log_metrics({"vocab_size": shards.vocab_size, "tokenizer_cache_hit": int(built.tokenizer_cache_hit)})
        mlflow.log_metrics(
            {
                "num_train": shards.num_train,
                "num_val": shards.num_val,
                "total_bytes": shards.total_bytes,
                "cache_hit": int(shards.cache_hit),
                "chunks": shards.chunks,
                "workers": shards.workers,
                "seconds": time.monotonic() - start,
                **{f"skipped_{k}": v for k, v in shards.skipped.items()},
            }
        )
        logger.info(
            "dataset %s%s: %d train / %d val records, %d shards, %.1f MB, %s, skipped %s; %d chunks, engine %s, "
            "%d workers, %.1f s",
            shards.dataset_digest,
            f" (token ids of tokenizer {shards.tokenizer_sha256[:12]}, {shards.vocab_size} ids)" if built else "",
            shards.num_train,
            shards.num_val,
            len(shards.train_shards) + len(shards.val_shards),
            shards.total_bytes / 1e6,
            "published" if not shards.cache_hit else "cache hit" if shards.chunks else "cache hit, corpus unread",
            shards.skipped or "none",
            shards.chunks,
            cfg.engine,
            shards.workers,
            time.monotonic() - start,
        )
    return shards.model_copy(update={"data_run_id": run_id})


def _tokenizer_params(tok_cfg: TokenizerConfig) -> dict[str, str]:
    """The tokenizer settings its kind uses, as MLflow params (a file's path, or a trained BPE's settings)."""
    used = {"file": ("kind", "path"), "train": ("kind", "vocab_size", "min_frequency")}[tok_cfg.kind]
    return {k: v for k, v in flat_params("tokenizer", tok_cfg).items() if k.split(".", 1)[1] in used}


def _check_tokenizer_path(path: str) -> None:
    """TokenizerError before anything is logged when tokenizer.path holds a credential (it would reach MLflow)."""
    from infra.redact import find_credential, redact

    what = find_credential(path)
    if what:
        raise TokenizerError(
            f"tokenizer.path={redact(path)!r} holds {what}; give credentials through the environment or a Prefect "
            "Secret block (see README)"
        )
