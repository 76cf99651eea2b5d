"""GPU check of the real per-worker loop: train_func on one GPU (NCCL, bf16 FSDP2, async DCP saves), then resume.

    python bench/gpu_loop_check.py            # on a GPU machine; prints one JSON object
    python bench/gpu_loop_check.py --cpu      # the same on CPU (sync saves), as a smoke test

Builds a small WebDataset shard set from the standard library, trains 40 steps with a checkpoint every 10 (async
on GPU: published once every rank's background write is done), verifies every kept checkpoint, runs the same
config again (must resume at step 40 and train nothing) and evaluates the last checkpoint on CPU without a
process group.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test helpers: tests/support

import torch
import torch.distributed as dist
from support.train_support import make_shards

from training import checkpoint as ckpt
from training.config import TrainConfig
from training.evaluate import bits_per_byte
from training.loop import train_func
from training.model import build_gpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    with tempfile.TemporaryDirectory() as tmp:
        train, val = make_shards(Path(tmp) / "shards")
        cfg = TrainConfig(
            workers=1,
            steps=40,
            checkpoint_every=10,
            keep_checkpoints=4,
            log_every=10,
            seq_len=128,
            n_layer=4,
            n_head=4,
            d_model=256,
            micro_batch=16,
            warmup_steps=5,
            use_gpu=gpu,
        )
        config = {"train": cfg.model_dump(), "train_shards": train, "checkpoint_root": f"{tmp}/ckpt"}
        t = time.perf_counter()
        first = train_func(config)
        first_s = time.perf_counter() - t
        dirs = sorted(Path(tmp, "ckpt").glob("checkpoint_0*"))
        infos = [ckpt.verify_checkpoint(d) for d in dirs]
        again = train_func(config)  # resumes at 40: nothing to train
        dist.destroy_process_group()
        plain = build_gpt(cfg)
        ckpt.load_unsharded(plain, dirs[-1])
        from training.data.loader import iter_texts

        bpb = bits_per_byte(plain, (t for _, t in iter_texts(val)), cfg.seq_len)
    out = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "first_run": first,
        "first_run_s": round(first_s, 1),
        "checkpoints": [(i.step, i.world_size, i.total_bytes) for i in infos],
        "resumed_run": again,
        "val_bits_per_byte": round(bpb, 3),
    }
    print(json.dumps(out))
    assert [i.step for i in infos] == [10, 20, 30, 40], infos
    assert again["step"] == 40 and again["tokens_per_s"] == 0.0
    assert bpb < 8.0


if __name__ == "__main__":
    main()
