"""The two smaller deployments' pure parts: which shard set a release reads, which canary a version gets."""

from __future__ import annotations

import pytest

from flows.canary_version import challenge
from flows.config import PipelineConfig
from flows.release import shard_set_prefix, unused_tokenizer
from training.config import TokenizerConfig
from training.data import ShardSet


def test_shard_set_prefix_accepts_prefix_or_manifest():
    assert shard_set_prefix("s3://b/shards/abc/manifest.json") == "s3://b/shards/abc"
    assert shard_set_prefix("/data/shards/abc/") == "/data/shards/abc"
    with pytest.raises(ValueError, match="shard_set is empty"):
        shard_set_prefix(" ")


def test_a_tokenizer_section_a_release_cannot_honour_is_named_in_one_line():
    base = {"uri": "u", "manifest_uri": "m", "train_shards": [], "val_shards": [], "num_train": 0, "num_val": 0}
    text = ShardSet(dataset_digest="a" * 32, total_bytes=0, cache_hit=False, **base)
    ids = text.model_copy(update={"tokenizer_sha256": "f" * 64, "vocab_size": 4096, "token_dtype": "<u2"})
    bpe = PipelineConfig(tokenizer=TokenizerConfig(kind="train", vocab_size=4096))
    explicit_bytes = PipelineConfig(tokenizer=TokenizerConfig(kind="bytes"))
    assert unused_tokenizer(PipelineConfig(), text) == unused_tokenizer(PipelineConfig(), ids) == ""
    assert unused_tokenizer(explicit_bytes, text) == ""
    assert unused_tokenizer(bpe, text) == (
        "tokenizer: kind='train' is not used: shard set aaaaaaaaaaaa holds bytes, which this release trains on "
        "(build a set with that tokenizer with `shardline shard` to train on its ids)"
    )
    # a set of ids: a BPE of its size is what it holds; anything else is named
    assert unused_tokenizer(bpe, ids) == ""
    bpe_1k = PipelineConfig(tokenizer=TokenizerConfig(kind="train", vocab_size=1024))
    assert "kind='train' is not used: shard set aaaaaaaaaaaa holds token ids of tokenizer ffffffffffff (4096 ids)," in (
        unused_tokenizer(bpe_1k, ids)
    )


def test_challenge_compares_against_todays_champion():
    promoted = challenge("m", "5", {"champion": "3", "challenger": "4"})
    assert (promoted.version, promoted.champion_version, promoted.challenger_version) == ("5", "3", "5")
    with pytest.raises(ValueError, match="no champion"):
        challenge("m", "5", {})
    with pytest.raises(ValueError, match="is the champion already"):
        challenge("m", "3", {"champion": "3"})


def test_a_release_opens_a_text_set_or_a_set_of_token_ids_and_tags_its_tokenizer(
    tmp_path, lineage, lineage_for, monkeypatch
):
    import mlflow
    from support.data_helpers import config, make_corpus

    from flows.release import open_shard_set
    from infra.names import TAG_TOKENIZER_SHA256
    from training import tokenizer as tk
    from training.data import build_shards

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    corpus = make_corpus(tmp_path / "c")
    text = build_shards(config(corpus, tmp_path / "out"))
    opened = open_shard_set.fn(text.manifest_uri, lineage)
    assert opened.dataset_digest == text.dataset_digest and not opened.tokenizer_sha256
    client = mlflow.MlflowClient(lineage.tracking_uri)
    assert TAG_TOKENIZER_SHA256 not in client.get_run(opened.data_run_id).data.tags
    tokens = build_shards(
        config(corpus, tmp_path / "out"), tk.train_bpe([corpus.joinpath("a", "doc001.txt").read_bytes()], 300)
    )
    later = lineage_for("flow-run-2")
    opened = open_shard_set.fn(tokens.uri, later)
    assert (opened.dataset_digest, opened.vocab_size) == (tokens.dataset_digest, tokens.vocab_size)
    assert opened.tokenizer_uri and opened.tokenizer_sha256 == tokens.tokenizer_sha256
    tags = mlflow.MlflowClient(later.tracking_uri).get_run(opened.data_run_id).data.tags
    assert tags[TAG_TOKENIZER_SHA256] == tokens.tokenizer_sha256


def test_a_release_logs_the_set_it_opens_as_its_data_runs_dataset_so_its_versions_lineage_is_consistent(
    tmp_path, lineage, monkeypatch
):
    import mlflow
    from support.data_helpers import config, make_corpus

    from deployments.lineage import describe_lineage
    from deployments.registry import client_for, register_version, version_tags
    from flows.release import open_shard_set
    from training.data import build_shards

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    built = build_shards(config(make_corpus(tmp_path / "c"), tmp_path / "out"))
    opened = open_shard_set.fn(built.manifest_uri, lineage)
    client = client_for(lineage.tracking_uri)
    inputs = client.get_run(opened.data_run_id).inputs.dataset_inputs
    assert [i.dataset.digest for i in inputs] == [built.dataset_digest]

    # a version trained on the opened set: its lineage reads the digest from the data run's dataset input too
    exp = client.get_run(lineage.parent_run_id).info.experiment_id
    train = client.create_run(exp, run_name="train_fsdp").info.run_id
    model = mlflow.initialize_logged_model(name="model", source_run_id=train, experiment_id=exp)
    uri = f"models:/{model.model_id}"
    tags = version_tags(
        dataset_digest=opened.dataset_digest,
        flow_run_id=lineage.flow_run_id,
        train_run_id=train,
        checkpoint_uri="/ck/1",
        validation_run_id="v",
        model_uri=uri,
        data_run_id=opened.data_run_id,
        manifest_uri=opened.manifest_uri,
    )
    chain = describe_lineage("m", register_version(client, "m", uri, train, tags), lineage.tracking_uri)
    assert (chain["data_run_id"], chain["dataset_digest"]) == (opened.data_run_id, built.dataset_digest)
    assert chain["consistent"] is True


def test_opening_a_wrong_shard_set_is_not_retried_but_a_storage_outage_is(tmp_path, lineage):
    from prefect.states import Failed

    from flows.config import ConfigError
    from flows.release import open_shard_set
    from infra.storage_retry import StorageError
    from training.data import DataError

    def retried(err):  # the task's retry_condition_fn on a failure with `err`
        return open_shard_set.retry_condition_fn(None, None, Failed(data=err))

    with pytest.raises(ValueError, match="shard_set is empty") as empty:
        open_shard_set.fn(" ", lineage)
    with pytest.raises(DataError, match="not a published shard set") as missing:
        open_shard_set.fn(str(tmp_path / "no-such-set"), lineage)
    assert retried(empty.value) is False
    assert retried(missing.value) is False
    assert retried(ConfigError("bad")) is False
    assert retried(StorageError("s3: 503 Slow Down, still failing after 5 tries", transient=True)) is True
    assert retried(ConnectionError("tracking server restarting")) is True


def test_a_stage_does_not_retry_missing_credentials_or_a_storage_error_the_storage_layer_judged_final():
    """Both are OSErrors, which stages retry: `az://` without credentials, or an AccessDenied the storage layer
    already gave up on at once, failed the same way twice more (three attempts of a stage that may hold a lock)."""
    import pickle

    from prefect.states import Failed

    from flows.release import open_shard_set
    from infra.credentials import CredentialsError
    from infra.storage_retry import StorageError, with_retries
    from tasks.data import shard_dataset
    from tasks.train import train_fsdp

    def fails(err: Exception):
        def call():
            raise err

        with pytest.raises(StorageError) as raised:
            with_retries(call, "s3://bucket/shards/x", retries=0)
        return raised.value

    denied, down = fails(PermissionError("AccessDenied")), fails(ConnectionError("endpoint down"))
    assert not denied.transient and down.transient
    assert pickle.loads(pickle.dumps(down)).transient  # as it comes back from a Ray worker
    no_credentials = CredentialsError("az://: no credentials: set AZURE_STORAGE_CONNECTION_STRING")
    for task in (open_shard_set, shard_dataset, train_fsdp):
        retried = [task.retry_condition_fn(None, None, Failed(data=err)) for err in (denied, no_credentials, down)]
        assert retried == [False, False, True], task.name


def test_a_tokenizer_file_that_is_the_set_s_own_is_used_and_its_chat_template_is_carried(tmp_path):
    """kind='file' naming the very tokenizer the set's ids came from was warned about as unused, and the chat
    template beside it was left out: the released version could not answer /v1/chat/completions."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from flows.config import chat_template_of
    from training import tokenizer as tk

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    own = PipelineConfig(tokenizer=TokenizerConfig(kind="file", path=str(tmp_path / "tokenizer.json")))
    base = {"uri": "u", "manifest_uri": "m", "train_shards": [], "val_shards": [], "num_train": 0, "num_val": 0}
    ids = ShardSet(dataset_digest="a" * 32, total_bytes=0, cache_hit=False, **base).model_copy(
        update={"tokenizer_sha256": tk.fingerprint(tok), "vocab_size": 3, "token_dtype": "<u2"}
    )
    assert unused_tokenizer(own, ids) == ""
    assert chat_template_of(own, discover=True).template  # what the release now carries
    other = ids.model_copy(update={"tokenizer_sha256": "f" * 64})
    assert unused_tokenizer(own, other).startswith("tokenizer: kind='file' is not used")
    missing = PipelineConfig(tokenizer=TokenizerConfig(kind="file", path=str(tmp_path / "gone.json")))
    assert unused_tokenizer(missing, ids).startswith("tokenizer: kind='file' is not used")


def test_every_flow_outlasts_one_attempt_of_each_stage_it_runs_and_its_release_lock_wait():
    """release-from-shards was bounded at 12 h while its train_fsdp may take 48 h: a long training the pipeline
    allows was killed by the flow's own timeout."""
    from deployments.config import CanaryConfig
    from flows.canary_version import canary_version
    from flows.pipeline import shardline_pipeline
    from flows.release import release_from_shards
    from tasks.retry import TIMEOUT_S

    lock = CanaryConfig().lock_timeout_s
    assert shardline_pipeline.timeout_seconds >= sum(TIMEOUT_S.values()) + lock
    assert release_from_shards.timeout_seconds >= sum(TIMEOUT_S.values()) - TIMEOUT_S["shard_dataset"] + lock
    assert canary_version.timeout_seconds >= TIMEOUT_S["provision_cluster"] + TIMEOUT_S["canary_deploy"] + lock
