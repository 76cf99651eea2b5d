"""The Prefect cache key of validation (tasks/cache.py): it changes with everything validation reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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


def _record(result: object, serializer: str = "json") -> bytes:
    from prefect.results import ResultRecord, ResultRecordMetadata
    from prefect.serializers import JSONSerializer, PickleSerializer

    chosen = JSONSerializer() if serializer == "json" else PickleSerializer()
    return ResultRecord(metadata=ResultRecordMetadata(serializer=chosen, storage_key="k"), result=result).serialize()


class _Planted:
    """Unpickling this writes its file: proof that a record was decoded with pickle."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (type(self.path).write_text, (self.path, "unpickled"))


def test_a_record_prefect_would_unpickle_is_moved_aside_before_prefect_reads_it(tmp_path):
    """Prefect decodes a record with the serializer the record names, even to check that it exists: a pickle one
    planted where the validation cache keeps its results is moved aside once its key is computed, so Prefect finds
    no record (the task runs again) and nothing of it is unpickled. A JSON record of validation stays and is read."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore
    from prefect.serializers import JSONSerializer

    from tasks.cache import UntrustedRecord, checked_record, screen_record
    from training.evaluate import ValidationResult

    good = ValidationResult(
        validation_run_id="r1", checkpoint_uri="ckpt", val_bits_per_byte=2.5, champion_val_bits_per_byte=None,
        champion_version=None, model_uri="runs:/r1/model", seq_len=64, chat_template_sha256="", chat_tokens={},
    )  # fmt: skip
    marker = tmp_path / "marker"
    (tmp_path / "good").write_bytes(_record(good))
    (tmp_path / "planted").write_bytes(_record(_Planted(marker), serializer="pickle"))
    for key in ("good", "planted", "absent"):
        screen_record(tmp_path / key)
    store = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path)), serializer=JSONSerializer())
    assert store.exists("good") and store.read("good").result == good
    assert not store.exists("planted") and not marker.exists()
    assert (tmp_path / "planted.refused").is_file()
    with pytest.raises(UntrustedRecord, match=r"x: its serializer \{'type': 'pickle'"):
        checked_record("x", (tmp_path / "planted.refused").read_bytes())
    named = _record(good).replace(b"training.evaluate.ValidationResult", b"subprocess.Popen")
    with pytest.raises(UntrustedRecord, match="its result names class 'subprocess.Popen'"):
        checked_record("x", named)
    decoder = _record(good).replace(b"prefect_json_object_decoder", b"evil_decoder")
    with pytest.raises(UntrustedRecord, match="evil_decoder"):
        checked_record("x", decoder)
    assert not marker.exists()
