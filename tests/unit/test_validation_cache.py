"""The Prefect cache key of validation (tasks/cache.py): it changes with everything validation reads."""

from __future__ import annotations

from types import SimpleNamespace

from deployments.config import RegistryConfig
from tasks.cache import validation_key
from training.chat_template import ChatFormat
from training.config import TrainConfig, ValidationConfig


def _inputs(tmp_path, **change):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    if not (ckpt / "manifest.rank00000.json").exists():
        (ckpt / "manifest.rank00000.json").write_text('{"files": {"a": "00"}}')
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = dict(
        cfg=ValidationConfig(),
        train_cfg=TrainConfig(),
        shards=SimpleNamespace(dataset_digest="d1"),
        trained=SimpleNamespace(checkpoint_uri=str(ckpt), world_size=1),
        lineage=SimpleNamespace(tracking_uri=uri, experiment="e"),
        registry=RegistryConfig(model_name="m"),
    )
    return {**base, **change}


def test_key_follows_checkpoint_bytes_data_config_and_champion(tmp_path):
    import mlflow

    key = validation_key(**_inputs(tmp_path))
    assert key is not None and key == validation_key(**_inputs(tmp_path))
    assert validation_key(**_inputs(tmp_path, shards=SimpleNamespace(dataset_digest="d2"))) != key
    assert validation_key(**_inputs(tmp_path, cfg=ValidationConfig(max_texts=7))) != key
    assert validation_key(**_inputs(tmp_path, train_cfg=TrainConfig(d_model=32, n_head=2))) != key
    templated = validation_key(**_inputs(tmp_path), chat_template="{{ messages[0].content }}")
    assert templated != key  # another model
    with_eos = ChatFormat("{{ messages[0].content }}", eos_token="</s>")  # the same template, other special tokens
    assert validation_key(**_inputs(tmp_path), chat_template=with_eos) not in (key, templated)
    assert validation_key(**_inputs(tmp_path), chat_template=ChatFormat()) == key  # no template: as before
    (tmp_path / "ckpt" / "manifest.rank00000.json").write_text('{"files": {"a": "01"}}')  # rewritten checkpoint
    rewritten = validation_key(**_inputs(tmp_path))
    assert rewritten != key

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    client.create_registered_model("m")
    run = client.create_run(client.create_experiment("x"))
    client.create_model_version("m", source="file:///nowhere", run_id=run.info.run_id)
    client.set_registered_model_alias("m", "champion", "1")
    assert validation_key(**_inputs(tmp_path)) != rewritten  # compared with another champion now


def test_no_key_without_a_readable_manifest(tmp_path):
    inputs = _inputs(tmp_path)
    inputs["trained"] = SimpleNamespace(checkpoint_uri=str(tmp_path / "missing"), world_size=2)
    assert validation_key(**inputs) is None
