"""The shard_dataset task against a real MLflow store: dataset input, tags, GX report, cache hits."""

from __future__ import annotations

import mlflow
import pytest
from support.data_helpers import config, make_corpus

from infra.tracking import TAG_DATASET_DIGEST, TAG_MANIFEST_URI
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
