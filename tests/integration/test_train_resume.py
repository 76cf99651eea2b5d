"""Fault tolerance for real: SIGKILL a Ray Train worker mid-run; the group restarts, every rank resumes from the
latest complete checkpoint, the run ends at exactly train.steps and the loss curve continues."""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.train_support import shard_set, train_and_kill_rank, worker_records

from training import checkpoint as ck
from training.config import TrainConfig

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

CFG = TrainConfig(
    workers=2,
    steps=40,
    checkpoint_every=10,
    keep_checkpoints=2,
    max_failures=2,
    log_every=1,
    seq_len=32,
    n_layer=2,
    n_head=2,
    d_model=32,
    micro_batch=8,
    lr=3e-3,
    warmup_steps=4,
    model_factory="support.train_support:recording_gpt",
)


def test_sigkill_mid_run_resumes_exactly(records, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("r", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    shards = shard_set(tmp_path / "shards")

    result, killed_at = train_and_kill_rank(CFG, shards, uri, run_id, "kill-run", records, at_step=23)
    assert 23 <= killed_at < CFG.steps, f"run ended (or stalled) before the kill; last step {killed_at}"

    # Ray started a second worker group: 2 ranks x 2 attempts, distinct processes
    seen = worker_records(records)
    assert sorted(r["rank"] for r in seen) == [0, 0, 1, 1]
    assert len({r["pid"] for r in seen}) == 4

    # the run ended at exactly train.steps with a complete checkpoint
    assert result.step == CFG.steps
    info = ck.verify_checkpoint(result.checkpoint_uri)
    assert (info.step, info.world_size) == (CFG.steps, 2)

    # every rank of the second attempt resumed from the latest complete checkpoint before the kill
    manifests = [json.loads((Path(result.checkpoint_uri) / ck.manifest_name(r)).read_text()) for r in (0, 1)]
    resumed = {m["resumed_from"] for m in manifests}
    assert len(resumed) == 1
    (resumed_from,) = resumed
    # rank 0 logs step k only after every rank finished step k, so the checkpoint of a step below k was complete;
    # it logs in the background, so the first attempt may have logged a step or two past the one the poll saw
    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: (m.timestamp, m.step))
    steps = [m.step for m in history]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert resumed_from % CFG.checkpoint_every == 0
    assert (killed_at - 1) // CFG.checkpoint_every * CFG.checkpoint_every <= resumed_from <= max(steps[:restart])

    # the loss curve continues: steps after the checkpoint are logged again, nothing before it, no reset
    assert sorted(set(steps)) == list(range(1, CFG.steps + 1))
    assert steps[restart] == resumed_from + 1
    assert steps[restart:] == list(range(resumed_from + 1, CFG.steps + 1))
    first = {m.step: m.value for m in history[:restart]}
    second = {m.step: m.value for m in history[restart:]}
    assert second[resumed_from + 1] < first[1] - 1.0  # not back at the untrained loss (~5.5)
    assert abs(second[resumed_from + 1] - first[resumed_from]) < 0.5
    assert second[CFG.steps] < first[resumed_from]
