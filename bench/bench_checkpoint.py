"""Checkpoint benchmark (prints ratios; not a test): DCP save of the training state (shardline's writer: N files
per rank, fsync, then the sha256 manifest) against torch.save of the same state, with and without fsync.
target >= 0.8x of torch.save.

    python bench/bench_checkpoint.py [--d-model 512] [--n-layer 8] [--repeat 3]

One process, world size 1 (gloo), FSDP2-sharded model + AdamW state after one step.
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from training import checkpoint as ckpt  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.loop import build_optimizer  # noqa: E402
from training.model import build_gpt  # noqa: E402
from training.parallelize import parallelize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainConfig(workers=1, seq_len=128, n_layer=args.n_layer, n_head=8, d_model=args.d_model)
    cpu = torch.device("cpu")
    model = parallelize(build_gpt(cfg), cfg, cpu, 1)
    opt = build_optimizer(model, cfg, cpu)
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    opt.step()
    params = sum(p.numel() for p in model.parameters())

    def median(fn) -> float:
        times = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
                t = time.perf_counter()
                fn(tmp)
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    def torch_save(tmp: str, fsync: bool) -> None:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        with open(f"{tmp}/state.pt", "wb") as f:
            torch.save({"model": full, "optim": opt.state_dict()}, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    with tempfile.TemporaryDirectory() as tmp:
        ckpt.save_checkpoint(f"{tmp}/probe", model, opt, 1, 1, 0, 1)
        mb = sum(f.stat().st_size for f in Path(tmp, "probe").iterdir()) / 2**20
    ts_nosync = median(lambda d: torch_save(d, False))
    ts_sync = median(lambda d: torch_save(d, True))
    print(f"state: {params / 1e6:.1f}M params, {mb:.0f} MB (model + AdamW moments); median of {args.repeat}")
    print(f"{'writer':34s} {'s':>7s} {'MB/s':>8s} {'vs torch.save':>14s} {'vs torch.save+fsync':>20s}")
    print(f"{'torch.save (no fsync)':34s} {ts_nosync:7.2f} {mb / ts_nosync:8.0f} {1.0:14.2f} "
          f"{ts_sync / ts_nosync:20.2f}")
    print(f"{'torch.save + fsync':34s} {ts_sync:7.2f} {mb / ts_sync:8.0f} {ts_nosync / ts_sync:14.2f} {1.0:20.2f}")
    import torch.distributed.checkpoint as dcp

    def dcp_write(tmp: str, threads: int) -> None:  # without the manifest (no sha256)
        dcp.save(ckpt.training_state(model, opt, 1, 1, 0, 1), storage_writer=ckpt._writer(f"{tmp}/w", threads))

    for threads in (1, 4, 8):
        for label, fn in ((f"DCP write only, {threads} file(s)/rank", lambda d, n=threads: dcp_write(d, n)),
                          (f"DCP + manifest, {threads} file(s)/rank",
                           lambda d, n=threads: ckpt.save_checkpoint(f"{d}/c", model, opt, 1, 1, 0, 1, threads=n))):
            t = median(fn)
            print(f"{label:34s} {t:7.2f} {mb / t:8.0f} {ts_nosync / t:14.2f} {ts_sync / t:20.2f}")
    print("target: DCP >= 0.8x torch.save")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
