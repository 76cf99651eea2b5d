"""Registry functions against a real MLflow SQLite store: versions, lineage tags, aliases, compare-and-set."""

from __future__ import annotations

import pytest

from deployments.config import CanaryConfig
from deployments.registry import (
    TAG_CANARY_DECISION,
    TAG_REJECTED,
    AliasChanged,
    PromotionDecision,
    apply_promotion,
    client_for,
    decide_promotion,
    move_alias,
    read_aliases,
    register_version,
    tag_rejected,
)
from deployments.rollout import skip_reason
from infra.names import (
    TAG_CHAT_TEMPLATE_SHA256,
    TAG_CHAT_TOKENS,
    TAG_CHECKPOINT_URI,
    TAG_DATASET_DIGEST,
    TAG_MANIFEST_URI,
    TAG_TRAIN_RUN_ID,
)

NAME = "tiny"


@pytest.fixture()
def store(mlflow_store):
    """A real SQLite tracking store (tests/conftest.py); (uri, client, experiment id)."""
    uri, exp = mlflow_store
    return uri, client_for(uri), exp


def _train_run_and_model(client, exp):
    """A training run, and a logged model from a separate (validation) run, as the pipeline has them."""
    import mlflow

    train = client.create_run(exp, run_name="train_fsdp").info.run_id
    val = client.create_run(exp, run_name="validate_checkpoint").info.run_id
    model = mlflow.initialize_logged_model(name="model", source_run_id=val, experiment_id=exp)
    return train, f"models:/{model.model_id}", model.model_id


def _promote(client, train, model_uri, digest="a" * 32):
    version = register_version(client, NAME, model_uri, train, {TAG_DATASET_DIGEST: digest, TAG_TRAIN_RUN_ID: train})
    return apply_promotion(client, decide_promotion(NAME, version, read_aliases(client, NAME)))


def test_register_attributes_the_version_to_the_training_run(store):
    _, client, exp = store
    train, uri, model_id = _train_run_and_model(client, exp)
    assert read_aliases(client, NAME) == {}
    version = register_version(client, NAME, uri, train, {TAG_DATASET_DIGEST: "a" * 32, "empty": ""})
    mv = client.get_model_version(NAME, version)
    assert version == "1"
    assert mv.run_id == train  # not the validation run that logged the model
    assert mv.source == uri
    # the version's artifacts are the logged model's (the SQL store resolves models:/<id> at registration)
    import mlflow

    logged = mlflow.MlflowClient(client.tracking_uri).get_logged_model(model_id)
    assert client.get_model_version_download_uri(NAME, version) == logged.artifact_location
    assert mv.tags[TAG_DATASET_DIGEST] == "a" * 32 and "empty" not in mv.tags
    # a retried task reuses the version instead of registering a second one
    assert register_version(client, NAME, uri, train, {"extra": "x"}) == "1"
    assert client.get_model_version(NAME, "1").tags["extra"] == "x"
    assert len(client.search_model_versions(f"name = '{NAME}'")) == 1


def test_a_rerun_reuses_the_version_of_its_checkpoint_unless_the_model_carries_something_else(store):
    _, client, exp = store
    train, first, _ = _train_run_and_model(client, exp)
    chat = {TAG_CHECKPOINT_URI: "/ck/7", TAG_CHAT_TEMPLATE_SHA256: "a" * 64, TAG_CHAT_TOKENS: '{"eos_token": "<e>"}'}
    assert register_version(client, NAME, first, train, chat) == "1"
    # a rerun after a crash validates the same checkpoint again: another logged model, the same content
    _, again, _ = _train_run_and_model(client, exp)
    assert register_version(client, NAME, again, train, chat) == "1"
    # the same checkpoint with another chat template, or with none, is another model: a new version whose tags
    # describe its own source (no stale template hash left from version 1)
    _, changed, _ = _train_run_and_model(client, exp)
    assert register_version(client, NAME, changed, train, {**chat, TAG_CHAT_TEMPLATE_SHA256: "b" * 64}) == "2"
    _, bare, _ = _train_run_and_model(client, exp)
    assert register_version(client, NAME, bare, train, {TAG_CHECKPOINT_URI: "/ck/7"}) == "3"
    three = client.get_model_version(NAME, "3")
    assert three.source == bare and TAG_CHAT_TEMPLATE_SHA256 not in three.tags and TAG_CHAT_TOKENS not in three.tags
    assert client.get_model_version(NAME, "1").tags[TAG_CHAT_TEMPLATE_SHA256] == "a" * 64
    assert register_version(client, NAME, bare, train, {TAG_CHECKPOINT_URI: "/ck/7"}) == "3"  # its own source


def test_first_version_becomes_champion_then_next_is_challenger(store):
    _, client, exp = store
    first = _promote(client, *_train_run_and_model(client, exp)[:2])
    assert (first.decision, first.version, first.champion_version) == ("first-champion", "1", None)
    assert read_aliases(client, NAME) == {"champion": "1", "challenger": "1"}

    second = _promote(client, *_train_run_and_model(client, exp)[:2])
    assert (second.decision, second.version, second.champion_version) == ("challenger", "2", "1")
    assert read_aliases(client, NAME) == {"champion": "1", "challenger": "2"}
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"  # int on SQLite


def test_promotion_refuses_when_the_champion_moved_after_the_decision(store):
    _, client, exp = store
    _promote(client, *_train_run_and_model(client, exp)[:2])
    train, uri, _ = _train_run_and_model(client, exp)
    v2 = register_version(client, NAME, uri, train)
    decision = decide_promotion(NAME, v2, read_aliases(client, NAME))
    assert decision.baseline == "1"
    client.set_registered_model_alias(NAME, "champion", v2)  # someone else moved it in between
    with pytest.raises(AliasChanged, match="alias 'champion' is at version 2, the decision expected 1"):
        apply_promotion(client, decision)


def test_first_champion_refuses_when_another_version_became_champion(store):
    _, client, exp = store
    train, uri, _ = _train_run_and_model(client, exp)
    v1 = register_version(client, NAME, uri, train)
    decision = PromotionDecision(model_name=NAME, candidate=v1, baseline=None, verdict="first-champion", reason="")
    train2, uri2, _ = _train_run_and_model(client, exp)
    client.set_registered_model_alias(NAME, "champion", register_version(client, NAME, uri2, train2))
    with pytest.raises(AliasChanged, match="at version 2, the decision expected None"):
        apply_promotion(client, decision)
    assert read_aliases(client, NAME)["champion"] == "2"


def _two_versions(client, exp):
    _promote(client, *_train_run_and_model(client, exp)[:2])
    _promote(client, *_train_run_and_model(client, exp)[:2])


def test_canary_promotion_is_a_compare_and_set_on_the_champion(store):
    # what rollout.apply_decision does to the registry for a promotion, before the endpoint follows it
    _, client, exp = store
    _two_versions(client, exp)
    move_alias(client, NAME, "champion", "1", "2")
    assert read_aliases(client, NAME)["champion"] == "2"
    move_alias(client, NAME, "champion", "1", "2")  # a retried apply: already there, not an error
    assert read_aliases(client, NAME)["champion"] == "2"


def test_canary_rejection_tags_the_reason_and_is_not_rerun(store):
    _, client, exp = store
    _two_versions(client, exp)
    tag_rejected(client, NAME, "2", "step 10%: bits/byte 7.9 vs 2.1")
    assert read_aliases(client, NAME)["champion"] == "1"
    tags = client.get_model_version(NAME, "2").tags
    assert tags[TAG_REJECTED] == "step 10%: bits/byte 7.9 vs 2.1"
    assert tags[TAG_CANARY_DECISION] == "rejected"
    assert skip_reason(client, CanaryConfig(), NAME, "1", "2") == (
        "version 2 was already rejected: step 10%: bits/byte 7.9 vs 2.1"
    )


def test_canary_promotion_refuses_a_champion_that_moved(store):
    _, client, exp = store
    _two_versions(client, exp)
    _promote(client, *_train_run_and_model(client, exp)[:2])  # version 3
    client.set_registered_model_alias(NAME, "champion", "3")
    with pytest.raises(AliasChanged, match="refusing to move it to 2"):
        move_alias(client, NAME, "champion", "1", "2")
    assert read_aliases(client, NAME)["champion"] == "3"
    with pytest.raises(AliasChanged, match="promotion stage saw 1"):
        skip_reason(client, CanaryConfig(), NAME, "1", "2")


def test_skip_reasons(store):
    _, client, exp = store
    _two_versions(client, exp)
    assert skip_reason(client, CanaryConfig(enabled=False), NAME, "1", "2") == "canary.enabled is false"
    assert "first run" in skip_reason(client, CanaryConfig(), NAME, None, "1")
    assert "first run" in skip_reason(client, CanaryConfig(), NAME, "1", "1")
    assert skip_reason(client, CanaryConfig(), NAME, "1", "2") == ""
    move_alias(client, NAME, "champion", "1", "2")
    assert "already 'champion'" in skip_reason(client, CanaryConfig(), NAME, "1", "2")


def test_a_rejected_version_with_no_champion_left_is_skipped_as_rejected_not_as_a_first_run(store):
    _, client, exp = store
    _two_versions(client, exp)
    tag_rejected(client, NAME, "2", "error rate 0.2 > 0.01")
    client.delete_registered_model_alias(NAME, "champion")  # an operator removed the champion alias since
    why = skip_reason(client, CanaryConfig(), NAME, None, "2")
    assert why == "version 2 was already rejected: error rate 0.2 > 0.01; no champion to serve"
    client.set_registered_model_alias(NAME, "champion", "2")  # an operator made it champion anyway: it serves
    assert "first run" in skip_reason(client, CanaryConfig(), NAME, "2", "2")


def test_canarying_a_version_the_registry_does_not_have_is_a_one_line_expected_failure(store):
    """`shardline canary --version 3` of a model or version that does not exist logged MLflow's traceback."""
    from flows.canary_version import held_out_manifest
    from flows.config import ConfigError
    from flows.log_hygiene import is_expected

    _, client, exp = store
    train, model, _ = _train_run_and_model(client, exp)
    register_version(client, NAME, model, train, {TAG_MANIFEST_URI: "/s/manifest.json"})
    assert held_out_manifest(client, NAME, "1") == "/s/manifest.json"
    for name, version, message in (
        ("not-registered", "3", "model 'not-registered' has no version 3"),
        (NAME, "3", f"model '{NAME}' has no version 3"),
        (NAME, "champion", f"version 'champion' of model '{NAME}': not a version number"),
    ):
        with pytest.raises(ConfigError) as e:
            held_out_manifest(client, name, version)
        assert str(e.value) == message and is_expected(e.value)
        assert e.value.__cause__ is None and (e.value.__suppress_context__ or e.value.__context__ is None)


def test_lineage_reads_chat_tokens_as_an_object_and_keeps_a_malformed_tag_as_text(store):
    from deployments.lineage import describe_lineage

    uri, client, exp = store
    train, model, _ = _train_run_and_model(client, exp)
    register_version(client, NAME, model, train, {TAG_CHAT_TOKENS: '{"eos_token": "<|fin|>", "bos_token": "«"}'})
    assert describe_lineage(NAME, "1", uri)["chat_tokens"] == {"eos_token": "<|fin|>", "bos_token": "«"}
    client.set_model_version_tag(NAME, "1", TAG_CHAT_TOKENS, '{"eos_token": "<|fi')  # cut short, or set by hand
    assert describe_lineage(NAME, "1", uri)["chat_tokens"] == {"unparsed": '{"eos_token": "<|fi'}
    train2, model2, _ = _train_run_and_model(client, exp)
    assert describe_lineage(NAME, register_version(client, NAME, model2, train2), uri)["chat_tokens"] == {}


def test_lineage_shows_a_purged_run_as_a_missing_link_not_a_raw_mlflow_error(store):
    """A data run deleted and purged by `mlflow gc` (or a training run likewise) made `shardline lineage` fail on
    MLflow's bare 'Run with id=... not found'; the chain is shown, the link named missing and not consistent."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from deployments.lineage import describe_lineage
    from infra.names import TAG_DATA_RUN_ID

    uri, client, exp = store
    train, model, _ = _train_run_and_model(client, exp)
    data = client.create_run(exp, run_name="shard_dataset").info.run_id
    tags = {TAG_DATA_RUN_ID: data, TAG_DATASET_DIGEST: "a" * 32, TAG_CHECKPOINT_URI: "/ck/1"}
    version = register_version(client, NAME, model, train, tags)
    purge = SqlAlchemyStore(uri, client.get_experiment(exp).artifact_location)
    for run_id in (data, train):
        client.delete_run(run_id)
        purge._hard_delete_run(run_id)  # what `mlflow gc` does to a deleted run
    chain = describe_lineage(NAME, version, uri)
    assert (chain["data_run_id"], chain["train_run_id"], chain["parent_run_id"]) == (data, train, "")
    assert (chain["dataset_digest"], chain["checkpoint_uri"]) == ("a" * 32, "/ck/1")  # the version's own tags
    assert chain["consistent"] is False
    assert chain["missing"] == f"data run {data}, train run {train}"
    train2, model2, _ = _train_run_and_model(client, exp)
    assert describe_lineage(NAME, register_version(client, NAME, model2, train2), uri)["missing"] == ""


def test_a_champion_that_does_not_load_is_refused_with_the_fix_and_validation_does_not_retry_it(store):
    from prefect.states import Failed

    from deployments.registry import ChampionUnloadable, RegistryError, champion_model
    from flows.log_hygiene import is_expected
    from tasks.validate import validate_checkpoint

    uri, client, exp = store
    train, model_uri, _ = _train_run_and_model(client, exp)
    _promote(client, train, model_uri)  # champion v1: a logged model whose files were never written
    with pytest.raises(ChampionUnloadable) as unloadable:
        champion_model(uri, NAME)
    assert str(unloadable.value) == (
        "tiny champion v1 does not load as served: No such artifact: 'MLmodel'; point alias 'champion' at a version "
        "that loads, or delete the alias, to judge new versions again"
    )
    assert is_expected(unloadable.value)  # the user's to fix: one line in the logs, no traceback

    def retried(err):  # the validation task's retry_condition_fn on a failure with `err`
        return validate_checkpoint.retry_condition_fn(None, None, Failed(data=err))

    assert retried(unloadable.value) is False
    assert retried(RegistryError("tiny champion v1: its store did not answer: ...")) is True


def test_a_store_that_does_not_answer_is_told_apart_from_a_model_that_does_not_load(monkeypatch):
    import requests
    from botocore.exceptions import ClientError
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    from deployments.registry import store_unavailable

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(MlflowException) as down:  # port 9 (discard): nothing listens on 127.0.0.1 here
        MlflowClient("http://127.0.0.1:9", registry_uri="http://127.0.0.1:9").get_registered_model(NAME)
    with pytest.raises(requests.ConnectionError) as refused:
        requests.get("http://127.0.0.1:9/", timeout=5)
    try:
        raise ValueError("factory changed") from down.value  # what a caller may wrap it in
    except ValueError as wrapped:
        assert store_unavailable(wrapped)
    assert store_unavailable(down.value) and store_unavailable(refused.value)
    assert store_unavailable(TimeoutError("read timed out"))
    assert store_unavailable(RestException({"error_code": "TEMPORARILY_UNAVAILABLE", "message": "db locked"}))
    throttled = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}
    assert store_unavailable(ClientError(throttled, "GetObject"))
    # ArtifactRepository.download_artifacts's own wording when a listed file's download failed (its threads'
    # errors are collected into one MlflowException, their causes dropped): 500, unless every file was a 404
    failed = (
        "The following failures occurred while downloading one or more artifacts from s3://b/m:\n##### File MLmodel"
    )
    assert store_unavailable(MlflowException(f"{failed} #####\nConnect timeout on endpoint URL"))
    assert not store_unavailable(MlflowException(f"{failed} #####\nnot found", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not store_unavailable(MlflowException("No such artifact: 'MLmodel'"))
    assert not store_unavailable(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no model"}))
    missing = {"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}
    assert not store_unavailable(ClientError(missing, "GetObject"))
    assert not store_unavailable(RuntimeError("size mismatch for wte.weight"))
    assert not store_unavailable(FileNotFoundError("MLmodel"))
