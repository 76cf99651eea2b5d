"""`shardline shard`: the data stage alone, from the command line, logged to MLflow like the pipeline's stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
from support.data_helpers import make_corpus

from infra.names import TAG_DATASET_DIGEST, TAG_PARENT, TAG_STAGE

REPO = Path(__file__).resolve().parents[2]


def _shardline(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDLINE_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "shard", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_shard_publishes_logs_and_prints_the_set_then_hits_the_cache(tmp_path):
    corpus = make_corpus(tmp_path / "c", n=60)
    args = [
        "--set",
        f"data.source={corpus}",
        "--set",
        f"data.output={tmp_path / 'out'}",
        "--set",
        "data.val_fraction=0.25",
        "--set",
        "data.workers=2",
        "--set",
        "data.chunk_bytes=2048",
        "--json",
    ]
    proc = _shardline(*args, home=tmp_path / "home")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["dataset_digest"]) == 32 and out["num_train"] + out["num_val"] == 60
    assert out["chunks"] >= 10 and out["workers"] == 2 and out["wall_seconds"] > 0 and not out["cache_hit"]
    assert Path(out["manifest_uri"]).is_file()
    assert all(Path(u).is_file() for u in out["train_shards"] + out["val_shards"])
    assert out["total_bytes"] == sum(Path(u).stat().st_size for u in out["train_shards"] + out["val_shards"])
    assert "| dataset digest | " + out["dataset_digest"] in proc.stderr  # the table goes to stderr with --json

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    parent = client.get_run(out["parent_run_id"])
    assert parent.data.tags[TAG_STAGE] == "shard" and parent.info.status == "FINISHED"
    stage = client.get_run(out["data_run_id"])
    assert stage.data.tags[TAG_PARENT] == parent.info.run_id and stage.data.tags[TAG_STAGE] == "shard_dataset"
    assert stage.data.tags[TAG_DATASET_DIGEST] == out["dataset_digest"] and stage.data.metrics["chunks"] >= 10

    again = _shardline(*args, home=tmp_path / "home")
    second = json.loads(again.stdout.strip().splitlines()[-1])
    assert again.returncode == 0 and second["cache_hit"] and second["dataset_digest"] == out["dataset_digest"]


def test_config_mistakes_exit_2_with_one_line(tmp_path):
    proc = _shardline("--set", "data.workerz=2", home=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "shardline: config (with --set): unknown key 'data.workerz'"
    proc = _shardline("--set", "data.output=s3://AKIAEXAMPLE:hunter2@bucket/x", home=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "data.output" in proc.stderr and "hunter2" not in proc.stderr
    proc = _shardline("--set", "data.engine=spark", home=tmp_path)
    assert proc.returncode == 2 and "data.engine" in proc.stderr and "spark" in proc.stderr
    # a corpus path that does not exist is a config mistake too: refused before the stage's MLflow run starts
    proc = _shardline("--set", f"data.source={tmp_path / 'typo'}", home=tmp_path / "home2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"shardline: data.source: {tmp_path / 'typo'}: no such file or directory"
    assert not (tmp_path / "home2" / "mlflow.db").exists()


def test_a_failed_stage_exits_1_with_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = _shardline(
        "--set", f"data.source={tmp_path / 'empty'}", "--set", f"data.output={tmp_path / 'out'}", home=tmp_path / "home"
    )
    assert proc.returncode == 1 and proc.stdout == ""
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last == f"shardline: shard failed: DataError: {tmp_path / 'empty'}: no files matching '*' "
        "(empty directory? data.include)"
    )
    assert "Traceback" not in proc.stderr


def test_shard_with_a_tokenizer_prints_its_ids_and_a_bad_tokenizer_exits_2_before_the_stage_runs(tmp_path):
    corpus = make_corpus(tmp_path / "c", n=40)
    base = [
        "--set",
        f"data.source={corpus}",
        "--set",
        f"data.output={tmp_path / 'out'}",
        "--set",
        "data.val_fraction=0.25",
    ]
    proc = _shardline(
        *base, "--set", "tokenizer.kind=train", "--set", "tokenizer.vocab_size=300", "--json", home=tmp_path / "home"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["vocab_size"] == 300 and out["token_dtype"] == "<u2"
    assert f"tokenizer {out['tokenizer_sha256'][:12]}, 300 ids, <u2" in proc.stderr  # the table goes to stderr

    # a tokenizer file that is not one, or not there, is a config mistake: refused before the stage's MLflow run
    bad = tmp_path / "tokenizer.json"
    bad.write_text("not json", encoding="utf-8")
    for path, why in ((bad, "not a tokenizer.json"), (tmp_path / "typo.json", "No such file or directory")):
        proc = _shardline(
            *base, "--set", "tokenizer.kind=file", "--set", f"tokenizer.path={path}", home=tmp_path / "h2"
        )
        assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("shardline: tokenizer.path") and str(path) in line and why in line
        assert not (tmp_path / "h2" / "mlflow.db").exists()
