"""A real 2-worker Ray Train run: loss goes down, sharded checkpoints merge into one, the last N are kept,
a finished run resumes to itself, and the checkpoint validates and serves as an exported MLflow model."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from support.train_support import ray_runtime_env, shard_set

from training import checkpoint as ck
from training.config import TrainConfig

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

CFG = TrainConfig(
    workers=2,
    steps=24,
    checkpoint_every=8,
    keep_checkpoints=2,
    log_every=2,
    seq_len=32,
    n_layer=2,
    n_head=2,
    d_model=48,
    micro_batch=8,
    lr=3e-3,
    warmup_steps=4,
)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=ray_runtime_env(), log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture()
def tracking(tmp_path, monkeypatch):
    """A real MLflow store (SQLite) and a training run in it."""
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    return uri, client, client.create_run(exp).info.run_id


def test_two_worker_fsdp_run_checkpoints_and_validates(ray_cluster, tracking, tmp_path):
    from training.evaluate import held_out_bpb, load_checkpoint_model
    from training.trainer import run_training, storage_root

    uri, client, run_id = tracking
    shards = shard_set(tmp_path / "shards")
    result = run_training(CFG, shards, uri, run_id, "ray-run")

    # the run ended at exactly the configured step, on 2 ranks, with a complete merged checkpoint
    assert (result.step, result.world_size, result.train_run_id) == (24, 2, run_id)
    run_dir = Path(storage_root(CFG)) / "ray-run"
    assert Path(result.checkpoint_uri) == run_dir / "checkpoint_00000024"
    info = ck.verify_checkpoint(result.checkpoint_uri)
    assert (info.step, info.world_size) == (24, 2)
    names = set(os.listdir(result.checkpoint_uri))
    assert {".metadata", ck.manifest_name(0), ck.manifest_name(1)} <= names
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)
    # keep the last N
    assert sorted(p.name for p in run_dir.glob("checkpoint_0*")) == ["checkpoint_00000016", "checkpoint_00000024"]

    # rank 0 logged every metric every log_every steps; the loss went down
    loss = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in loss] == list(range(2, 25, 2))
    assert loss[-1].value < loss[0].value - 0.5
    assert result.final_loss == pytest.approx(loss[-1].value)
    for key in ("lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_memory_mb", "mfu"):
        values = [m.value for m in client.get_metric_history(run_id, key)]
        assert len(values) == 12 and all(v > 0 for v in values), key
    assert result.tokens_per_s > 0

    # the same run name again: resumes at step 24 and returns the same checkpoint without training
    t0 = time.monotonic()
    again = run_training(CFG, shards, uri, run_id, "ray-run")
    assert again.checkpoint_uri == result.checkpoint_uri and again.step == 24
    assert len(client.get_metric_history(run_id, "loss")) == 12  # nothing re-trained
    assert time.monotonic() - t0 < 60

    # validation: plain model, no process group, bits per byte well under uniform
    model = load_checkpoint_model(result.checkpoint_uri, CFG)
    bpb = held_out_bpb(model, shards.val_shards, shards.num_val, CFG.seq_len, batch_size=4, max_texts=8)
    assert 0 < bpb < 7.0
    assert loss[-1].value / 0.6931 < 8.0


def test_a_tokenized_set_trains_a_gpt_over_its_tokenizers_ids(ray_cluster, tracking, tmp_path):
    from support.data_helpers import config, make_corpus

    from training import tokenizer as tk
    from training.data import build_shards
    from training.evaluate import load_checkpoint_model
    from training.trainer import fit_vocabulary, run_training

    uri, client, run_id = tracking
    corpus = make_corpus(tmp_path / "c", n=80)
    tok = tk.train_bpe((p.read_bytes() for p in sorted(corpus.rglob("*.txt"))), 300)
    shards = build_shards(config(corpus, tmp_path / "out"), tok)
    assert (shards.vocab_size, shards.token_dtype) == (300, "<u2")
    cfg = CFG.model_copy(update={"steps": 16, "checkpoint_every": 16})
    result = run_training(cfg, shards, uri, run_id, "bpe-run")

    assert fit_vocabulary(cfg, shards).vocab_size == 300
    model = load_checkpoint_model(result.checkpoint_uri, fit_vocabulary(cfg, shards))  # 300 rows, or it would not load
    assert model.wte.num_embeddings == 300 and model.config()["vocab"] == 300
    loss = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    assert loss[-1].value < loss[0].value - 1.0  # from about ln 300 = 5.7 nats: it learned the ids, not noise


def test_global_batch_mismatch_fails_before_any_worker_starts(ray_cluster, tracking, tmp_path):
    from training.trainer import run_training

    uri, _, run_id = tracking
    cfg = CFG.model_copy(update={"global_batch": 10})
    shards = shard_set(tmp_path / "shards")
    expected = r"train.global_batch=10 != micro_batch 8 x grad_accum 1 x workers 2 = 16; set it to 16 or 0"
    with pytest.raises(ValueError, match=expected):
        run_training(cfg, shards, uri, run_id, "bad-batch")


def test_logged_model_is_pt2_with_dynamic_length(tmp_path):
    import mlflow

    from training.model import build_gpt
    from training.servable import load_served_model, log_servable_model

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'm.db'}")
    exp = mlflow.create_experiment("m", artifact_location=(tmp_path / "art").as_uri())
    model = build_gpt(CFG).eval()
    with mlflow.start_run(experiment_id=exp):
        model_uri = log_servable_model(model, CFG.seq_len)
    metadata = mlflow.models.get_model_info(model_uri).metadata
    assert metadata["seq_len"] == 32
    # the built-in GPT also carries its config and weights (tensors only) for the replicas' KV-cached decoding
    assert metadata["eager_gpt"]["config"]["seq_len"] == 32
    local = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "dl")))
    assert (local / "artifacts" / "program" / "data" / "model.pt2").is_file()  # torch.export archive, not a pickle
    assert not list(local.rglob("*.pth"))
    served = load_served_model(model_uri)
    for t in (1, 9, 32):
        x = torch.randint(0, 256, (3, t))
        with torch.no_grad():
            assert torch.allclose(served(x), model(x), atol=1e-5)
