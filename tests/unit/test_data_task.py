"""The shard_dataset task against a real MLflow store: dataset input, tags, GX report, cache hits."""

from __future__ import annotations

import mlflow
import pytest
from support.data_helpers import config, make_corpus

from infra.names import TAG_DATASET_DIGEST, TAG_MANIFEST_URI
from tasks.data import shard_dataset
from training.data import DataError


def test_task_logs_dataset_input_tags_and_report_also_on_cache_hit(tmp_path, lineage):
    cfg = config(make_corpus(tmp_path / "c"), tmp_path / "out")
    first = shard_dataset.fn(cfg, lineage)
    second = shard_dataset.fn(cfg, lineage)
    assert not first.cache_hit and second.cache_hit and first.data_run_id == second.data_run_id != ""
    client = mlflow.MlflowClient(lineage.tracking_uri)
    run = client.get_run(first.data_run_id)
    assert run.data.tags[TAG_DATASET_DIGEST] == first.dataset_digest
    assert run.data.tags[TAG_MANIFEST_URI] == first.manifest_uri
    assert run.data.params["data.source"] == cfg.source and run.data.metrics["cache_hit"] == 1
    digests = [d.dataset.digest for d in run.inputs.dataset_inputs]
    assert digests and set(digests) == {first.dataset_digest}
    artifacts = [a.path for a in client.list_artifacts(first.data_run_id, "data")]
    assert artifacts == ["data/validation.json"]


def test_bad_input_fails_the_stage_run_with_the_cause(tmp_path, lineage):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty.*no files matching"):
        shard_dataset.fn(config(tmp_path / "empty", tmp_path / "out"), lineage)
    client = mlflow.MlflowClient(lineage.tracking_uri)
    runs = client.search_runs(
        [client.get_run(lineage.parent_run_id).info.experiment_id],
        filter_string="tags.`shardline.stage` = 'shard_dataset'",
    )
    assert [r.info.status for r in runs] == ["FAILED"]


def test_credentials_in_a_uri_fail_before_anything_is_logged(tmp_path, lineage):
    cfg = config(make_corpus(tmp_path / "c"), "s3://AKIAEXAMPLE:hunter2@bucket/out")
    with pytest.raises(DataError, match="data.output: .*credentials") as err:
        shard_dataset.fn(cfg, lineage)
    assert "hunter2" not in str(err.value)
    client = mlflow.MlflowClient(lineage.tracking_uri)
    runs = client.search_runs(
        [client.get_run(lineage.parent_run_id).info.experiment_id],
        filter_string="tags.`shardline.stage` = 'shard_dataset'",
    )
    assert len(runs) == 1 and runs[0].data.params == {} and runs[0].info.status == "FAILED"


def test_a_trained_tokenizer_is_logged_with_the_set_and_tagged_with_its_fingerprint(tmp_path, lineage, lineage_for):
    from infra.names import TAG_TOKENIZER_SHA256, TAG_TOKENIZER_TRAINED_ON
    from training import tokenizer as tk

    cfg, tok_cfg = (
        config(make_corpus(tmp_path / "c"), tmp_path / "out"),
        tk.TokenizerConfig(kind="train", vocab_size=300),
    )
    first = shard_dataset.fn(cfg, lineage, None, tok_cfg)
    second = shard_dataset.fn(cfg, lineage, None, tok_cfg)
    assert first.vocab_size == 300 and first.token_dtype == "<u2" and first.tokenizer_sha256
    assert second.cache_hit and second.dataset_digest == first.dataset_digest
    text_only = shard_dataset.fn(cfg, lineage_for("flow-run-2"))  # the set the BPE learned from
    assert text_only.tokenizer_sha256 == "" and text_only.dataset_digest != first.dataset_digest

    client = mlflow.MlflowClient(lineage.tracking_uri)
    run, rerun = client.get_run(first.data_run_id), client.get_run(second.data_run_id)
    assert run.data.tags[TAG_TOKENIZER_SHA256] == first.tokenizer_sha256
    assert run.data.tags[TAG_TOKENIZER_TRAINED_ON] == text_only.dataset_digest
    assert {k: v for k, v in run.data.params.items() if k.startswith("tokenizer.")} == {
        "tokenizer.kind": "train",
        "tokenizer.vocab_size": "300",
        "tokenizer.min_frequency": "2",
    }
    assert run.data.metrics["vocab_size"] == 300 and rerun.data.metrics["tokenizer_cache_hit"] == 1
    logged = mlflow.artifacts.load_text(f"runs:/{first.data_run_id}/tokenizer/tokenizer.json")
    assert tk.fingerprint(tk.Tokenizer.from_str(logged)) == first.tokenizer_sha256
    assert "tokenizer.kind" not in client.get_run(text_only.data_run_id).data.params


def test_a_bad_tokenizer_fails_the_stage_in_one_line_and_publishes_nothing(tmp_path, lineage, lineage_for):
    from training import tokenizer as tk

    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": ', encoding="utf-8")
    cfg = config(make_corpus(tmp_path / "c"), tmp_path / "out")
    with pytest.raises(tk.TokenizerError, match="tokenizer.json") as err:
        shard_dataset.fn(cfg, lineage, None, tk.TokenizerConfig(kind="file", path=str(bad)))
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    secret = tk.TokenizerConfig(kind="file", path="s3://AKIAEXAMPLE:hunter2@b/t.json")
    with pytest.raises(tk.TokenizerError, match="tokenizer.path=") as err:
        shard_dataset.fn(cfg, lineage_for("flow-run-2"), None, secret)
    assert "hunter2" not in str(err.value)
    client = mlflow.MlflowClient(lineage.tracking_uri)
    runs = client.search_runs(
        [client.get_run(lineage.parent_run_id).info.experiment_id],
        filter_string="tags.`shardline.stage` = 'shard_dataset'",
        order_by=["attributes.start_time ASC"],
    )
    assert [r.info.status for r in runs] == ["FAILED", "FAILED"]
    assert runs[0].data.params["tokenizer.path"] == str(bad) and "tokenizer.vocab_size" not in runs[0].data.params
    assert runs[1].data.params == {}  # the credential never reached MLflow
