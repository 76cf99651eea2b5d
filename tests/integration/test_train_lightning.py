"""train.loop = "lightning" for real: a LightningModule under Ray Train's Lightning integration (RayDDPStrategy or
Lightning's FSDP2 strategy, RayLightningEnvironment, shardline's report callback) on 2 workers. SIGKILL one
mid-run: the group restarts, both ranks restore the latest complete DCP checkpoint (weights, optimizer, Lightning's
step, the data position), the replayed steps' losses equal the first attempt's, the run ends at exactly
train.steps; the checkpoint is the built-in loop's layout (sharded per rank under FSDP2) and loads into the
module's model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.train_support import shard_set, train_and_kill_rank, worker_records

from training import checkpoint as ck
from training.config import LIGHTNING_FACTORY, TrainConfig

pytestmark = pytest.mark.slow

CFG = TrainConfig(
    loop="lightning",
    lightning_module="support.lightning_support:RecordingByteGPT",
    parallelism="ddp",
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
    dropout=0.1,  # the replayed steps match only if the checkpoint restored the RNG the DataLoader must not move
    micro_batch=8,
    grad_accum=2,
    lr=3e-3,
    warmup_steps=4,
)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_lightning_run_killed_mid_run_resumes_from_its_checkpoint(parallelism, records, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    cfg = CFG.model_copy(update={"parallelism": parallelism})
    for done in records.glob("rank*-pid*.json"):  # the module's Ray cluster: an earlier run's workers are gone
        done.unlink()

    assert cfg.model_factory == LIGHTNING_FACTORY  # validation and serving rebuild the module's `.model`
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("l", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    shards = shard_set(tmp_path / "shards")

    result, killed_at = train_and_kill_rank(cfg, shards, uri, run_id, "lit-run", records, at_step=23)
    assert 23 <= killed_at < cfg.steps, f"run ended (or stalled) before the kill; last step {killed_at}"

    seen = worker_records(records)
    assert sorted(r["rank"] for r in seen) == [0, 0, 1, 1] and len({r["pid"] for r in seen}) == 4
    # exactly train.steps optimizer steps (Lightning's counter continued), in the built-in loop's checkpoint layout
    assert result.step == cfg.steps
    info = ck.verify_checkpoint(result.checkpoint_uri)
    assert (info.step, info.world_size) == (cfg.steps, 2)
    # FSDP2 writes each rank's half of every weight; DDP's ranks hold full replicas, written once
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(result.checkpoint_uri).read_metadata().state_dict_metadata["model.wte.weight"]
    assert [tuple(c.sizes) for c in stored.chunks] == ([(128, 32)] * 2 if parallelism == "fsdp" else [(256, 32)])
    manifests = [json.loads((Path(result.checkpoint_uri) / ck.manifest_name(r)).read_text()) for r in (0, 1)]
    resumed = {m["resumed_from"] for m in manifests}
    assert len(resumed) == 1  # both ranks restored the same checkpoint
    (resumed_from,) = resumed

    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: (m.timestamp, m.step))
    steps = [m.step for m in history]
    assert sorted(set(steps)) == list(range(1, cfg.steps + 1))
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart:] == list(range(resumed_from + 1, cfg.steps + 1))
    first = {m.step: m.value for m in history[:restart]}
    second = {m.step: m.value for m in history[restart:]}
    # exact resume: the steps the first attempt ran past its checkpoint come out the same again (weights, optimizer,
    # data position and dropout RNG restored), and training goes on from there
    # (rank 0 logs in the background: the first attempt may have logged a step or two past the one the kill saw)
    last_logged = max(first)
    assert resumed_from % cfg.checkpoint_every == 0
    # step k logged: every rank finished step k, so the checkpoint of a step below k had been saved
    assert (killed_at - 1) // cfg.checkpoint_every * cfg.checkpoint_every <= resumed_from <= last_logged
    replayed = [s for s in second if s in first]
    assert replayed == list(range(resumed_from + 1, last_logged + 1))
    assert [second[s] for s in replayed] == pytest.approx([first[s] for s in replayed], abs=1e-6)
    assert sum(second[s] for s in range(cfg.steps - 4, cfg.steps + 1)) / 5 < first[1] - 1.5
    # the learning rate followed the schedule across the restart (Lightning's step counter was restored)
    lrs = {m.step: m.value for m in client.get_metric_history(run_id, "lr")}
    from training.loop import lr_at

    assert lrs[resumed_from + 1] == pytest.approx(lr_at(resumed_from, cfg))
    # the checkpoint loads into the module's model, as validation will
    from training.lightning_loop import lightning_model

    model = lightning_model(cfg)
    ck.load_unsharded(model, result.checkpoint_uri)
    assert model(torch.randint(0, 256, (2, 32))).shape == (2, 32, 256)
