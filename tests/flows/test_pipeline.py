"""The whole debug pipeline, twice, on a real Prefect server, real Ray, real MLflow: first champion, then canary."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.config import load_config
from infra.tracking import (
    STAGES,
    TAG_DATA_RUN_ID,
    TAG_DATASET_DIGEST,
    TAG_FLOW_RUN_ID,
    TAG_PARENT,
    TAG_STAGE,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("shardline-home")
    old = os.environ.get("SHARDLINE_HOME")
    os.environ["SHARDLINE_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield home
    if old is None:
        os.environ.pop("SHARDLINE_HOME", None)
    else:
        os.environ["SHARDLINE_HOME"] = old


def _client(home: Path):
    import mlflow

    uri = f"sqlite:///{home / 'mlflow.db'}"
    return mlflow.MlflowClient(uri, registry_uri=uri)


def _children(client, parent_run_id: str) -> dict:
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.`{TAG_PARENT}` = '{parent_run_id}'")
    return {r.data.tags[TAG_STAGE]: r for r in runs}


def test_first_run_makes_a_champion_with_full_lineage(prefect_server, home):
    from flows.pipeline import shardline_pipeline

    cfg = load_config(REPO / "configs" / "debug.toml")
    summary = shardline_pipeline(cfg)

    assert summary.decision == "first-champion"
    assert str(summary.model_version) == "1" and str(summary.champion_version) == "1"
    assert 0 < summary.val_bits_per_byte <= cfg.validation.max_bits_per_byte
    assert len(summary.dataset_digest) == 32

    client = _client(home)
    parent = client.get_run(summary.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags[TAG_FLOW_RUN_ID] == summary.flow_run_id
    children = _children(client, summary.parent_run_id)
    assert sorted(children) == sorted(STAGES)
    assert all(r.info.status == "FINISHED" for r in children.values())

    champion = client.get_model_version_by_alias(cfg.registry.model_name, "champion")
    assert str(champion.version) == "1"
    assert champion.run_id == children["train_fsdp"].info.run_id == summary.train_run_id
    data_run = children["shard_dataset"]
    logged = [d.dataset.digest for d in data_run.inputs.dataset_inputs]
    assert champion.tags[TAG_DATASET_DIGEST] == summary.dataset_digest
    assert summary.dataset_digest in logged
    assert champion.tags[TAG_DATA_RUN_ID] == data_run.info.run_id
    assert champion.tags[TAG_FLOW_RUN_ID] == summary.flow_run_id
    # the training run's metrics came from the Ray Train rank-0 worker
    losses = client.get_metric_history(summary.train_run_id, "loss")
    assert len(losses) >= 2 and losses[-1].value < losses[0].value


def test_second_run_through_the_cli_goes_through_a_real_canary(prefect_server, home, s3_server):
    # Same corpus; shards and Ray Train checkpoints on a real S3 API server this time (moto_server, endpoint from env).
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "SHARDLINE_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", "configs/debug.toml", "--json",
         "--set", "data.output=s3://shardline/flow-shards", "--set", "train.storage_path=s3://shardline/flow-ckpt"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("model_name", "model_version", "decision", "parent_run_id", "dataset_digest"):
        assert key in summary
    assert str(summary["model_version"]) == "2"
    assert summary["decision"] in ("promoted", "rejected")

    client = _client(home)
    name = summary["model_name"]
    children = _children(client, summary["parent_run_id"])
    assert sorted(children) == sorted(STAGES)
    canary_run = children["canary_deploy"]
    # the canary moved real traffic: every ramp step when it promoted, up to the failing step when it rejected
    ramp = (10, 50, 100) if summary["decision"] == "promoted" else (10,)
    for pct in ramp:
        assert canary_run.data.metrics.get(f"step{pct}.requests", 0) > 0, canary_run.data.metrics
    champion = client.get_model_version_by_alias(name, "champion")
    v2 = client.get_model_version(name, "2")
    if summary["decision"] == "promoted":
        assert str(champion.version) == "2"
    else:
        assert str(champion.version) == "1" and "rejected" in v2.tags
    # same corpus and split: the digest is over content, so it is the same wherever the shards live
    v1 = client.get_model_version(name, "1")
    assert v1.tags[TAG_DATASET_DIGEST] == v2.tags[TAG_DATASET_DIGEST] == summary["dataset_digest"]
    assert summary["manifest_uri"] == f"s3://shardline/flow-shards/{summary['dataset_digest']}/manifest.json"
    train_tags = client.get_run(summary["train_run_id"]).data.tags
    assert summary["checkpoint_uri"].startswith(f"s3://shardline/flow-ckpt/train-{train_tags['shardline.train_key']}/")
    assert train_tags["shardline.init_from_version"] == f"{name}/1"  # debug.toml: init_from = "champion"
    assert v2.tags["shardline.checkpoint_uri"] == summary["checkpoint_uri"]
    assert "testing" not in json.dumps(client.get_run(children["shard_dataset"].info.run_id).data.params)

    # `shardline lineage` follows the same chain from the champion back to the digest the data stage logged
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "lineage", "--model", name, "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    chain = json.loads(proc.stdout.strip().splitlines()[-1])
    assert chain["version"] == str(champion.version) and chain["consistent"] is True
    assert chain["dataset_digest"] == summary["dataset_digest"]
    assert chain["train_run_id"] == champion.run_id


def test_azure_blob_source_and_output(prefect_server, home, azurite, unique_prefix):
    """The whole pipeline with the corpus read from and the shards written to Azure Blob (Azurite)."""
    import sysconfig

    from flows.pipeline import shardline_pipeline
    from infra import storage

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:80]:
        storage.upload_file(str(path), f"az://shardline/{unique_prefix}/corpus/{path.name}")
    cfg = load_config(REPO / "configs" / "debug.toml", [
        f"data.source=az://shardline/{unique_prefix}/corpus",
        f"data.output=az://shardline/{unique_prefix}/shards",
        "canary.enabled=false",
    ])
    summary = shardline_pipeline(cfg)
    assert summary.manifest_uri.startswith(f"az://shardline/{unique_prefix}/shards/{summary.dataset_digest}/")
    assert storage.exists(summary.manifest_uri)
    assert summary.decision == "registered"  # a champion exists and the canary is off: registered, not promoted
    client = _client(home)
    version = client.get_model_version(summary.model_name, summary.model_version)
    assert version.tags[TAG_DATASET_DIGEST] == summary.dataset_digest
    assert "AccountKey" not in json.dumps(client.get_run(summary.parent_run_id).data.tags)
