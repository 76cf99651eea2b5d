"""Checkpoint benchmark (prints ratios; not a test): DCP save of the training state (shardline's writer: N files
per rank, XXH3-128 of each file while written, XXH3-64 of each tensor, fsync, then the manifest) against torch.save
of the same state, fsynced too. target >= 0.8x of torch.save + fsync.

    python bench/bench_checkpoint.py [--sizes demo,1gb] [--repeat 3]

One process, world size 1 (gloo), FSDP2-sharded model + AdamW state after one step, on CPU.
`demo` is configs/demo.toml's model (d_model 128, 4 layers); `1gb` a ~1 GB state (d_model 1024, 7 layers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from training import checkpoint as ckpt
from training.config import TrainConfig
from training.loop import build_optimizer
from training.model import build_gpt
from training.parallelize import parallelize

SIZES = {"demo": dict(d_model=128, n_layer=4, n_head=4), "1gb": dict(d_model=1024, n_layer=7, n_head=8)}


def bench_size(name: str, repeat: int) -> None:
    cfg = TrainConfig(workers=1, seq_len=128, **SIZES[name])
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = parallelize(build_gpt(cfg), cfg, cpu, 1)
    opt = build_optimizer(model, cfg, cpu)
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters())

    def median(fn) -> float:
        times = []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
                t = time.perf_counter()
                fn(tmp)
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    def torch_save(tmp: str) -> None:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        with open(f"{tmp}/state.pt", "wb") as f:
            torch.save({"model": full, "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    import torch.distributed.checkpoint as dcp

    def dcp_plain(tmp: str, threads: int) -> None:  # DCP's own writer: no hashing, no checksums, no manifest
        from torch.distributed.checkpoint import FileSystemWriter

        dcp.save(
            ckpt.training_state(model, opt, 1, 1, 0, 1),
            storage_writer=FileSystemWriter(f"{tmp}/w", thread_count=threads, sync_files=True),
        )

    with tempfile.TemporaryDirectory() as tmp:
        ckpt.save_checkpoint(f"{tmp}/probe", model, opt, 1, 1, 0, 1)
        mb = sum(f.stat().st_size for f in Path(tmp, "probe").iterdir()) / 2**20
    ts = median(torch_save)
    print(f"[{name}] state: {params / 1e6:.1f}M params, {mb:.0f} MB (model + AdamW moments); median of {repeat}")
    print(f"[{name}] {'writer (all fsynced)':40s} {'s':>7s} {'MB/s':>8s} {'vs torch.save':>14s}")
    print(f"[{name}] {'torch.save':40s} {ts:7.2f} {mb / ts:8.0f} {1.0:14.2f}")
    files = ckpt.files_per_rank(ckpt.training_state(model, opt, 1, 1, 0, 1), TrainConfig().checkpoint_threads)
    for threads in sorted({1, files}):
        for label, fn in (
            (f"DCP plain, {threads} file(s)/rank", lambda d, n=threads: dcp_plain(d, n)),
            (
                f"DCP + checksums + manifest, {threads} file(s)",
                lambda d, n=threads: ckpt.save_checkpoint(f"{d}/c", model, opt, 1, 1, 0, 1, threads=n),
            ),
        ):
            t = median(fn)
            print(f"[{name}] {label:40s} {t:7.2f} {mb / t:8.0f} {ts / t:14.2f}")
    print(
        f"[{name}] the training loop writes {files} file(s) per rank for this state (train.checkpoint_threads = "
        f"{TrainConfig().checkpoint_threads}, one file per {ckpt.FILE_BYTES >> 20} MB at most)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="demo,1gb", help="comma-separated: " + ", ".join(SIZES))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for name in args.sizes.split(","):
        bench_size(name.strip(), args.repeat)
    print("target: DCP + checksums + manifest >= 0.8x torch.save (both fsynced)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
