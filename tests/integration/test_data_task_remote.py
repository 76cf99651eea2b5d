"""shard_dataset against S3 / Azurite with a real MLflow store: lineage recorded, credentials nowhere in it."""

from __future__ import annotations

import json

import mlflow
import pytest
from support.data_helpers import config, make_corpus

from infra.names import TAG_DATASET_DIGEST
from tasks.data import shard_dataset

SECRET = "sEcReT-shardline-4242"


def _everything_logged(client, run_id, tmp_path) -> str:
    run = client.get_run(run_id)
    parts = [json.dumps(run.data.params), json.dumps(run.data.tags), json.dumps(run.data.metrics)]
    parts += [d.dataset.source + d.dataset.name for d in run.inputs.dataset_inputs]
    local = mlflow.artifacts.download_artifacts(
        run_id=run_id, dst_path=str(tmp_path / "artifacts"), tracking_uri=client.tracking_uri
    )
    parts += [p.read_text(errors="replace") for p in __import__("pathlib").Path(local).rglob("*") if p.is_file()]
    return "\n".join(parts)


@pytest.mark.parametrize("scheme", ["s3", "az"])
def test_remote_output_records_lineage_without_credentials(
    tmp_path, lineage, monkeypatch, scheme, unique_prefix, request, caplog
):
    if scheme == "s3":
        request.getfixturevalue("s3_server")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # moto accepts any key; now it is recognisable
        secrets = [SECRET]
    else:
        secrets = [
            part.split("=", 1)[1]
            for part in request.getfixturevalue("azurite").split(";")
            if part.startswith("AccountKey=")
        ]
    out = f"{scheme}://shardline/{unique_prefix}/out"
    caplog.set_level("DEBUG")
    shards = shard_dataset.fn(config(make_corpus(tmp_path / "c"), out), lineage)
    again = shard_dataset.fn(config(make_corpus(tmp_path / "c"), out), lineage)
    assert shards.uri.startswith(out) and again.cache_hit
    client = mlflow.MlflowClient(lineage.tracking_uri)
    run = client.get_run(shards.data_run_id)
    assert run.data.tags[TAG_DATASET_DIGEST] == shards.dataset_digest
    assert {d.dataset.digest for d in run.inputs.dataset_inputs} == {shards.dataset_digest}
    assert any(out in d.dataset.source for d in run.inputs.dataset_inputs)
    logged = _everything_logged(client, shards.data_run_id, tmp_path) + caplog.text
    for secret in secrets:
        assert secret not in logged
