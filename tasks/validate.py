"""validate_checkpoint: verify the DCP checkpoint, gate on held-out bits per byte (absolute and against the
champion), log the servable model (training.servable) and prove it runs at serving shapes before anything is
registered."""

from __future__ import annotations

import logging
from typing import Any

import mlflow
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from prefect.tasks import exponential_backoff

from deployments.config import RegistryConfig
from deployments.model_server import check_backend
from deployments.registry import ChampionUnloadable
from infra.names import (
    TAG_CHAT_TEMPLATE_SHA256,
    TAG_CHAT_TOKENS,
    TAG_CHECKPOINT_URI,
    TAG_DATA_RUN_ID,
    TAG_DATASET_DIGEST,
    TAG_MANIFEST_URI,
    TAG_MODEL_URI,
    TAG_TOKENIZER_SHA256,
    TAG_TRAIN_RUN_ID,
)
from infra.tracking import Lineage, flat_params, safe_tags, stage_run
from tasks.cache import VALIDATION_CACHE, results_dir
from tasks.retry import TIMEOUT_S, retry_unless
from training.chat_template import ChatFormat, fingerprint, tokens_tag
from training.checkpoint import CheckpointError
from training.config import TrainConfig, ValidationConfig
from training.data import ShardSet
from training.evaluate import GateFailed, ValidationResult, held_out_bpb, load_checkpoint_model
from training.servable import log_servable_model, served_chat, served_tokenizer, vocab_of
from training.trainer import TrainResult, fit_vocabulary


@task(
    name="validate_checkpoint",
    timeout_seconds=TIMEOUT_S["validate_checkpoint"],
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    cache_policy=NO_CACHE,  # the flows call cached() below; called directly (tests), nothing is persisted
    retry_condition_fn=retry_unless(GateFailed, CheckpointError, ChampionUnloadable),
)
def validate_checkpoint(
    cfg: ValidationConfig,
    train_cfg: TrainConfig,
    trained: TrainResult,
    shards: ShardSet,
    lineage: Lineage,
    registry: RegistryConfig | None = None,
    chat_template: ChatFormat | str = "",
) -> ValidationResult:
    """Load the checkpoint without a process group, gate on held-out bits per byte, log the model for serving.

    A shard set of token ids is scored with its own tokenizer (the summed token NLL over the texts' UTF-8 bytes),
    so the figure compares with a byte model's on the same held-out texts; its model is built for the set's ids as
    the workers built it (trainer.fit_vocabulary) and logged with the tokenizer inside it. The champion is scored
    the same way with the tokenizer its version carries (none: bytes), so a BPE challenger and a byte-level
    champion are judged on the same texts.

    Through `cached()` (as the flows call it) Prefect caches it (tasks/cache.py): a rerun with the same checkpoint
    bytes, data, config and champion gets the recorded result back, pointing at the validation run and logged
    model of the attempt that computed it.

    Args:
        cfg: the gates (max bits per byte, max regression against the champion) and how much text to evaluate.
        train_cfg: the model that was trained (factory and sizes).
        trained: the training stage's result: checkpoint URI and run id.
        shards: the shard set; its validation shards are the held-out text.
        lineage: the flow run's MLflow run tree.
        registry: the registered model whose champion this checkpoint is compared with (none: no comparison).
        chat_template: the tokenizer's chat format (flows.config.chat_template_of: the template, with the special
            tokens it sees), logged inside the model (the endpoint renders chat requests to the version with it);
            the template is fingerprinted as a tag. '' or false for none.

    Raises:
        GateFailed: a gate failed, or the model cannot be served (NotServable); not retried.
        CheckpointError: the checkpoint is incomplete, corrupt or non-finite (not retried).
        ChampionUnloadable: the registered champion does not load as served (not retried; its store not
            answering is a RegistryError, retried).
    """
    from deployments.registry import champion_model, seq_len_of

    try:
        logger = get_run_logger()
    except MissingContextError:  # called as validate_checkpoint.fn(...) outside a run (a unit test, a REPL)
        logger = logging.getLogger("shardline.validate")
    with stage_run(lineage, "validate_checkpoint") as run_id:
        # what it consumed: the checkpoint and the held-out split it scores (lineage from the data to the gate)
        mlflow.set_tags(
            safe_tags(
                {
                    TAG_TRAIN_RUN_ID: trained.train_run_id,
                    TAG_CHECKPOINT_URI: trained.checkpoint_uri,
                    TAG_DATASET_DIGEST: shards.dataset_digest,
                    TAG_DATA_RUN_ID: shards.data_run_id,
                    TAG_MANIFEST_URI: shards.manifest_uri,
                }
            )
        )
        mlflow.log_params(flat_params("validation", cfg))
        train_cfg = fit_vocabulary(train_cfg, shards)  # the model as the workers built it, for the set's ids
        model = load_checkpoint_model(trained.checkpoint_uri, train_cfg)
        tokenizer = None
        if shards.tokenizer_uri:
            from training.tokenizer import load as load_tokenizer

            tokenizer = load_tokenizer(shards.tokenizer_uri)
            mlflow.set_tag(TAG_TOKENIZER_SHA256, shards.tokenizer_sha256)

        def score(m: Any, tok: Any = tokenizer, seq_len: int = train_cfg.seq_len) -> float:
            """The trained nn.Module, or the champion as it is served: each at its own context length."""
            return held_out_bpb(m, shards.val_shards, shards.num_val, seq_len, cfg.batch_size, cfg.max_texts, tok)

        bpb = score(model)
        texts = min(shards.num_val, cfg.max_texts or shards.num_val)
        mlflow.log_metrics({"val_bits_per_byte": bpb, "val_texts": texts})
        failures = (
            [f"val_bits_per_byte {bpb:.4f} > validation.max_bits_per_byte {cfg.max_bits_per_byte}"]
            if bpb > cfg.max_bits_per_byte
            else []
        )
        champion_version, champion_bpb = None, None
        champion = champion_model(lineage.tracking_uri, registry.model_name) if registry else None
        if champion is not None and registry is not None:
            champion_version, champion_model_obj = champion
            champion_uri = f"models:/{registry.model_name}/{champion_version}"
            champion_tok = served_tokenizer(champion_uri)
            # its context as logged and as the endpoint scores it: a run that changed train.seq_len must not feed
            # the champion positions it has no embedding for (an IndexError), nor fewer than it serves with
            champion_seq_len = seq_len_of(champion_uri)
            # the width of its logits, as logged (a forward pass for a version logged before vocab_size was)
            width = (mlflow.models.get_model_info(champion_uri).metadata or {}).get("vocab_size")
            if champion_tok is None and (width or vocab_of(champion_model_obj, champion_seq_len)) != 256:
                raise GateFailed(
                    f"champion v{champion_version} predicts token ids but carries no tokenizer: it cannot be "
                    "scored on the held-out texts"
                )
            champion_bpb = score(champion_model_obj, champion_tok, champion_seq_len)  # its own ids, the same texts
            mlflow.log_metric("champion_val_bits_per_byte", champion_bpb)
            mlflow.set_tag("shardline.champion_version", champion_version)
            limit = cfg.max_regression_vs_champion
            if limit is not None and bpb - champion_bpb > limit:
                failures.append(
                    f"val_bits_per_byte {bpb:.4f} is {bpb - champion_bpb:+.4f} against champion "
                    f"v{champion_version}'s {champion_bpb:.4f} on the same data > "
                    f"validation.max_regression_vs_champion {limit}"
                )
        logger.info(
            "val bits/byte %.4f (gate %.4f%s): %s",
            bpb,
            cfg.max_bits_per_byte,
            f"; champion v{champion_version} {champion_bpb:.4f}" if champion_bpb is not None else "",
            "FAIL" if failures else "pass",
        )
        if failures:
            raise GateFailed("; ".join(failures))
        # the pt2 program, or the eager form when export cannot serve it; proven at every serving shape either way
        tokenizer_json = tokenizer.to_str() if tokenizer is not None else ""
        model_uri = log_servable_model(
            model,
            train_cfg.seq_len,
            factory=train_cfg.model_factory,
            train_config=train_cfg.model_dump(mode="json"),
            tokenizer_json=tokenizer_json,
            chat_template=chat_template,
        )
        chat = served_chat(chat_template, tokenizer_json)  # as the logged model carries it
        template_sha256, chat_tokens = fingerprint(chat.template), chat.tokens()  # '' and {} for none
        if template_sha256:
            mlflow.set_tag(TAG_CHAT_TEMPLATE_SHA256, template_sha256)
        if chat_tokens:
            mlflow.set_tag(TAG_CHAT_TOKENS, tokens_tag(chat_tokens))
        check_backend(model_uri, model, train_cfg.seq_len)  # a KV-cached backend decodes as the model computes
        mlflow.set_tag(TAG_MODEL_URI, model_uri)
        return ValidationResult(
            validation_run_id=run_id,
            checkpoint_uri=trained.checkpoint_uri,
            val_bits_per_byte=bpb,
            champion_val_bits_per_byte=champion_bpb,
            champion_version=champion_version,
            model_uri=model_uri,
            seq_len=train_cfg.seq_len,
            chat_template_sha256=template_sha256,
            chat_tokens=chat_tokens,
        )


def cached() -> Task[..., ValidationResult]:
    """validate_checkpoint under Prefect's cache (tasks/cache.py), results persisted as JSON (never pickle) under
    $SHARDLINE_HOME/results, where a record of another kind is never decoded (tasks.cache.screen_record): resolved
    when a flow calls it, not at import."""
    return validate_checkpoint.with_options(
        cache_policy=VALIDATION_CACHE, persist_result=True, result_serializer="json", result_storage=results_dir()
    )
