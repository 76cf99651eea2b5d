"""The same train_func under torchrun (no Ray): FSDP2 and DDP + PowerSGD on 2 processes, checkpoints, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.train_support import make_shards

from training import checkpoint as ck
from training.config import TrainConfig
from training.model import build_gpt

CFG = TrainConfig(
    workers=2,
    steps=16,
    checkpoint_every=8,
    keep_checkpoints=1,
    log_every=4,
    seq_len=32,
    n_layer=2,
    n_head=2,
    d_model=32,
    micro_batch=4,
    grad_accum=2,
    lr=6e-3,
    warmup_steps=2,
)


def torchrun(tmp_path: Path, cfg: TrainConfig, name: str) -> dict:
    train, _ = make_shards(tmp_path / "shards")
    config = {"train": cfg.model_dump(), "train_shards": train, "checkpoint_root": str(tmp_path / name)}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "training.loop", str(path)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "update",
    [{"parallelism": "fsdp", "activation_checkpointing": True}, {"parallelism": "ddp", "powersgd_rank": 2}],
    ids=["fsdp-ac", "ddp-powersgd"],
)
def test_torchrun_trains_and_checkpoints(tmp_path, update):
    cfg = CFG.model_copy(update=update)
    summary = torchrun(tmp_path, cfg, "run")
    assert summary["step"] == 16 and summary["world_size"] == 2
    assert summary["loss"] < 4.8  # ln 256 = 5.55 at the start
    dirs = sorted((tmp_path / "run").glob("checkpoint_*"))
    assert [d.name for d in dirs] == ["checkpoint_00000016"]  # keep_checkpoints=1
    info = ck.verify_checkpoint(dirs[0])
    assert (info.step, info.world_size) == (16, 2)
    plain = build_gpt(cfg)
    ck.load_unsharded(plain, dirs[0])  # FQNs are the plain model's, with AC wrappers and DDP alike
    assert all(torch.isfinite(p).all() for p in plain.parameters())
    # a second launch of the finished run resumes at step 16 and trains nothing
    again = torchrun(tmp_path, cfg, "run")
    assert again["step"] == 16 and again["tokens_per_s"] == 0.0
