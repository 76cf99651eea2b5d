"""validate_checkpoint on a shard set of token ids (a real MLflow store, a real DCP checkpoint, no Ray): the model
is built for the set's ids, scored in bits per byte of the set's texts with its tokenizer, compared with a byte-level
champion on the same texts, logged for all its logits with its tokenizer, and, promoted, scored with that tokenizer."""

from __future__ import annotations

import mlflow
import pytest
import torch
import torch.distributed as dist
from support.data_helpers import config, make_corpus

from deployments.config import RegistryConfig
from deployments.registry import client_for, register_version
from tasks.validate import validate_checkpoint
from training import checkpoint as ck
from training import tokenizer as tk
from training.config import TrainConfig, ValidationConfig
from training.data import build_shards
from training.evaluate import held_out_bpb, load_checkpoint_model
from training.loop import build_optimizer
from training.model import build_gpt
from training.parallelize import parallelize
from training.servable import log_servable_model, served_tokenizer
from training.trainer import TrainResult, fit_vocabulary

CFG = TrainConfig(workers=1, seq_len=16, n_layer=1, n_head=2, d_model=16)
VAL = ValidationConfig(max_bits_per_byte=64.0, batch_size=4, max_texts=6)
NAME = "bpe-vs-bytes"


@pytest.fixture()
def pg():
    """A real one-rank gloo process group (FSDP2 and DCP need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture()
def token_set(tmp_path):
    corpus = make_corpus(tmp_path / "corpus", n=16)
    tok = tk.train_bpe((p.read_bytes() for p in sorted(corpus.rglob("*.txt"))), 300)
    return build_shards(config(corpus, tmp_path / "out"), tok), tok


def _trained(tmp_path, shards, run_id: str) -> TrainResult:
    """A DCP checkpoint of a GPT over the set's ids, as a training worker saves it."""
    torch.manual_seed(0)
    fitted = fit_vocabulary(CFG, shards)
    model = parallelize(build_gpt(fitted), fitted, torch.device("cpu"), 1)
    directory = tmp_path / "checkpoints" / "checkpoint_000001"
    ck.save_checkpoint(directory, model, build_optimizer(model, fitted, torch.device("cpu")), 1, 0, 0, 1)
    return TrainResult(
        train_run_id=run_id, checkpoint_uri=str(directory), step=1, final_loss=1.0, tokens_per_s=1.0, world_size=1
    )


def _byte_champion(tracking_uri: str, experiment: str) -> torch.nn.Module:
    torch.manual_seed(1)
    model = build_gpt(CFG).eval()
    with mlflow.start_run(experiment_id=experiment) as run:
        uri = log_servable_model(model, CFG.seq_len)
    client = client_for(tracking_uri)
    client.set_registered_model_alias(NAME, "champion", register_version(client, NAME, uri, run.info.run_id))
    return model


def test_a_token_model_is_scored_per_byte_against_a_byte_champion_on_the_same_texts(
    tmp_path, token_set, mlflow_store, lineage_for, pg
):
    shards, tok = token_set
    assert shards.vocab_size == 300 and shards.tokenizer_uri
    trained = _trained(tmp_path, shards, "train-run")
    champion = _byte_champion(*mlflow_store)

    registry = RegistryConfig(model_name=NAME)
    result = validate_checkpoint.fn(VAL, CFG, trained, shards, lineage_for("bpe"), registry)

    # the challenger's figure is its tokenizer's bits over the texts' bytes; the champion's, bytes on those texts
    model = load_checkpoint_model(trained.checkpoint_uri, fit_vocabulary(CFG, shards))
    assert model.wte.num_embeddings == 300
    args = (shards.val_shards, shards.num_val, CFG.seq_len, VAL.batch_size, VAL.max_texts)
    assert result.val_bits_per_byte == pytest.approx(held_out_bpb(model, *args, tokenizer=tok), rel=1e-5)
    assert result.champion_val_bits_per_byte == pytest.approx(held_out_bpb(champion, *args), rel=1e-5)
    assert result.champion_version == "1"
    run = mlflow.get_run(result.validation_run_id)
    assert run.data.metrics["champion_val_bits_per_byte"] == pytest.approx(result.champion_val_bits_per_byte)
    # logged for the endpoint with every one of its 300 logits, and the rebuild config sized for them
    assert mlflow.models.get_model_info(result.model_uri).metadata["vocab_size"] == 300

    # the version carries its tokenizer: promoted, it is scored with it against the next challenger
    assert served_tokenizer(result.model_uri).to_str() == tok.to_str()
    assert run.data.tags["shardline.tokenizer_sha256"] == shards.tokenizer_sha256
    # what it consumed: the checkpoint's train run and the held-out split it scored
    assert run.data.tags["shardline.train_run_id"] == "train-run"
    assert run.data.tags["shardline.dataset_digest"] == shards.dataset_digest
    assert run.data.tags["shardline.manifest_uri"] == shards.manifest_uri
    client = client_for(mlflow_store[0])
    client.set_registered_model_alias(
        NAME, "champion", register_version(client, NAME, result.model_uri, result.validation_run_id)
    )
    again = validate_checkpoint.fn(VAL, CFG, trained, shards, lineage_for("against-tokens"), registry)
    assert again.champion_version == "2"
    assert again.champion_val_bits_per_byte == pytest.approx(result.val_bits_per_byte, rel=1e-5)  # the same model


def test_a_champion_is_scored_at_its_own_context_when_the_run_changed_train_seq_len(
    tmp_path, token_set, mlflow_store, lineage_for, pg
):
    """The new run doubles train.seq_len: the champion has no position embedding past its own 16, and the endpoint
    scores it at 16, so validation does too (at the run's 32 it raised an IndexError the stage retried)."""
    shards, _ = token_set
    longer = CFG.model_copy(update={"seq_len": 32})
    torch.manual_seed(0)
    fitted = fit_vocabulary(longer, shards)
    model = parallelize(build_gpt(fitted), fitted, torch.device("cpu"), 1)
    directory = tmp_path / "checkpoints" / "checkpoint_000001"
    ck.save_checkpoint(directory, model, build_optimizer(model, fitted, torch.device("cpu")), 1, 0, 0, 1)
    trained = TrainResult(
        train_run_id="t", checkpoint_uri=str(directory), step=1, final_loss=1.0, tokens_per_s=1.0, world_size=1
    )
    champion = _byte_champion(*mlflow_store)
    result = validate_checkpoint.fn(
        VAL, longer, trained, shards, lineage_for("longer"), RegistryConfig(model_name=NAME)
    )
    at_its_own = held_out_bpb(champion, shards.val_shards, shards.num_val, CFG.seq_len, VAL.batch_size, VAL.max_texts)
    assert result.champion_version == "1"
    assert result.champion_val_bits_per_byte == pytest.approx(at_its_own, rel=1e-5)
